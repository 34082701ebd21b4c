"""The one dispatch between the recurrences' fused GPU kernels and their PyTorch paths.

Each operation in `OPS` has up to three implementations with one signature:

  * `pytorch`: the mixer's own chunked PyTorch form (models/mixers/), the CPU path, the only one
    with autograd, and the reference the others are tested against;
  * `triton`: this project's Triton kernel (one file each here: selective_scan.py, wkv.py,
    ssd.py), on CUDA, or on a CPU under Triton's interpreter (`TRITON_INTERPRET=1`, what the
    tests do);
  * `field`: the field's CUDA kernel when its package imports (mamba_ssm's `selective_scan_fn`
    and `mamba_chunk_scan_combined`, causal-conv1d's `causal_conv1d_fn`, flash-linear-attention's
    RWKV-4 kernel; field.py holds the adapters). Those packages compile CUDA at install, so none
    is a dependency.

`run_op(name, *args)` picks one by the preference in force (`use_kernels`), the tensors' device
and what imports, and records the path it took, which the eval stage writes to meta.json
(`kernels`):

  * `auto` (the default): on CUDA the field's kernel, else this project's Triton kernel, else
    PyTorch; on a CPU, PyTorch. On fp32 tensors it passes over a field kernel whose fp32 matmuls
    run in TF32 (mamba_ssm's SSD: Triton's default precision), as fp32 promises exact losses;
  * `field`, `triton`: that path or a clear error saying why it cannot run;
  * `pytorch`: the PyTorch path everywhere.

Autograd always takes the PyTorch path (the kernels compute forward passes only). A new kernel is
one entry of `OPS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "field", "triton", "pytorch")


@dataclass(frozen=True)
class Op:
    """One fused operation's implementations, each `"module:function"`, imported when first used."""

    pytorch: str
    triton: str | None = None
    field: str | None = None
    field_needs: tuple[str, ...] = ()  # modules the field's kernel imports from
    field_tf32: bool = False  # the field's kernel takes fp32 matmul operands as TF32


OPS = {
    # silu(depthwise causal conv1d(x)): Mamba-1's short convolution before the scan
    "causal_conv1d": Op(
        pytorch="models.mixers.mamba:causal_conv1d_silu",
        triton="models.kernels.selective_scan:causal_conv1d_silu_triton",
        field="models.kernels.field:causal_conv1d_silu",
        field_needs=("causal_conv1d",),
    ),
    # Mamba-1's selective scan with softplus(dt + bias), the D skip and the SiLU(z) gate
    "selective_scan": Op(
        pytorch="models.mixers.mamba:selective_scan_gated",
        triton="models.kernels.selective_scan:selective_scan_triton",
        field="models.kernels.field:selective_scan",
        field_needs=("mamba_ssm.ops.selective_scan_interface",),
    ),
    # RWKV-4's WKV, gated by sigmoid(receptance)
    "wkv": Op(
        pytorch="models.mixers.rwkv:wkv_gated",
        triton="models.kernels.wkv:wkv_triton",
        field="models.kernels.field:wkv",
        field_needs=("fla.ops.rwkv4.fused_recurrent",),
    ),
    # Mamba-2's SSD scan with dt + bias, softplus and its limit, the D skip and the SiLU(z) gate
    "ssd": Op(
        pytorch="models.mixers.mamba2:ssd_chunked",
        triton="models.kernels.ssd:ssd_triton",
        field="models.kernels.field:ssd",
        field_needs=("mamba_ssm.ops.triton.ssd_combined",),
        field_tf32=True,
    ),
}


@dataclass
class _Policy:
    preference: str
    taken: dict  # op name -> set of the paths it took


_POLICY: contextvars.ContextVar[_Policy | None] = contextvars.ContextVar("kernels", default=None)


@contextlib.contextmanager
def use_kernels(preference: str = "auto") -> Iterator[dict]:
    """Inside, `run_op` follows `preference` (one of KERNEL_CHOICES); yields the dict it fills
    with each op's paths taken (`{"selective_scan": {"triton"}}`)."""
    if preference not in KERNEL_CHOICES:
        raise ArSliceError(f"--kernels {preference!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    policy = _Policy(preference, {})
    token = _POLICY.set(policy)
    try:
        yield policy.taken
    finally:
        _POLICY.reset(token)


def paths_taken(taken: dict) -> dict:
    """`{op: path}` as meta.json records it (a sorted list where one op took several paths)."""
    return {op: (min(p) if len(p) == 1 else sorted(p)) for op, p in sorted(taken.items())}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _resolve(target: str):
    """The function named `"module:function"`, or the error that importing it raised (a Triton
    or a field package built for another CUDA or torch fails with more than ImportError)."""
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as err:
        return err


@functools.cache
def _field_missing(op: str) -> str | None:
    """Why the field's kernel of `op` cannot run here (None: it imports)."""
    for module in OPS[op].field_needs:
        try:
            importlib.import_module(module)
        except (
            Exception
        ) as err:  # (a package built for another torch fails with more than ImportError)
            return f"{module} does not import ({type(err).__name__}: {err})"
    found = _resolve(OPS[op].field)
    return f"{found}" if isinstance(found, Exception) else None


def _triton_missing(op: str, on_cuda: bool) -> str | None:
    """Why this project's Triton kernel of `op` cannot run on these tensors (None: it can)."""
    if not on_cuda and not interpreting():
        return "its tensors are on the CPU (Triton runs there only with TRITON_INTERPRET=1)"
    found = _resolve(OPS[op].triton)
    if isinstance(found, Exception):
        return f"the kernel does not import ({found}); pip install 'ar-slicing[kernels]'"
    return None


def choose(
    op: str, on_cuda: bool, needs_grad: bool, preference: str = "auto", fp32: bool = False
) -> str:
    """The path `op` takes: "pytorch", "triton" or "field" (see the module docstring); `fp32`:
    its tensors are fp32."""
    if needs_grad or preference == "pytorch":
        return "pytorch"
    if preference == "auto":
        exact = not (fp32 and OPS[op].field_tf32)
        if on_cuda and exact and _field_missing(op) is None:
            return "field"
        if on_cuda and _triton_missing(op, on_cuda) is None:
            return "triton"
        return "pytorch"
    if preference == "field":
        why = "its tensors are not on CUDA" if not on_cuda else _field_missing(op)
    else:
        why = _triton_missing(op, on_cuda)
    if why is not None:
        raise ArSliceError(f"--kernels {preference}: the {op} kernel cannot run here: {why}")
    return preference


def implementation(op: str, path: str):
    """The function of `op`'s `path` ("pytorch", "triton" or "field"), imported now."""
    found = _resolve(getattr(OPS[op], path))
    if isinstance(found, Exception):
        raise ArSliceError(f"the {path} {op} kernel does not import: {found}")
    return found


def run_op(op: str, *args, **kwargs):
    """`op` computed by the path the policy in force picks for these arguments; the path taken is
    recorded in that policy (`use_kernels`)."""
    import torch

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    policy = _POLICY.get()
    preference = policy.preference if policy is not None else "auto"
    fp32 = tensors[0].dtype == torch.float32
    path = choose(op, tensors[0].is_cuda, needs_grad, preference, fp32)
    if policy is not None:
        policy.taken.setdefault(op, set()).add(path)
    return implementation(op, path)(*args, **kwargs)
