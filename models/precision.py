"""One precision policy for every forward pass: which device `auto` means, which autocast dtype
`auto` means on it, and the autocast context itself. Eval, train, the loaders and the Ray actors
all resolve through here, so a run's dtype never depends on which of them asked.

The rule (`resolve_dtype`):
  * CUDA: bf16 where the GPU has it; without bf16, fp16 for evaluation (the cross-entropy stays
    fp32) and fp32 for training (fp16 training would need loss scaling, which the trainer omits).
  * CPU: bf16 for evaluation on CPUs that multiply bf16 matrices in hardware (AVX512-BF16, AMX,
    Arm BF16), where it is about twice as fast as fp32; fp32 elsewhere (emulated bf16 is slower
    than fp32) and always for training, so trained weights do not depend on the CPU's model.
  * An explicit dtype is kept as asked.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ar_slicing.errors import ArSliceError

DTYPES = ("auto", "bf16", "fp16", "fp32")
# Names accepted wherever a dtype is given (CLI flags, configs, `load_model(dtype=...)`).
_ALIASES = {
    "float32": "fp32",
    "fp32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
}


def resolve_device(name: str) -> str:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda`/`cuda:N` refused without one."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ArSliceError(f"--device {name}: no CUDA device is visible to torch; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ArSliceError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    return name


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags (x86 `flags`, Arm `Features`) from /proc/cpuinfo (`cpuinfo`: its
    text); None where there is none to read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU multiplies bf16 matrices in hardware (x86 AVX512-BF16 or AMX-BF16,
    Arm BF16), where bf16 autocast runs the model's matrix products about twice as fast as fp32.
    CPUs without it emulate bf16 more slowly than fp32. `cpuinfo` is /proc/cpuinfo's text."""
    import torch

    flags = cpu_flags(cpuinfo)
    if flags is None:
        return False
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return native and torch.backends.mkldnn.is_available()


def canonical_dtype(dtype) -> str:
    """`"bfloat16"`, `"torch.bfloat16"`, `torch.bfloat16`, `"bf16"` -> `"bf16"` (and so on)."""
    text = str(dtype).removeprefix("torch.").lower()
    if text == "auto":
        return text
    try:
        return _ALIASES[text]
    except KeyError:
        raise ArSliceError(
            f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} (or float32, bfloat16, ...)"
        ) from None


def resolve_dtype(dtype: str, device: str, training: bool = False) -> str:
    """The dtype `dtype` means on `device` (see the module docstring for `auto`)."""
    import torch

    dtype = canonical_dtype(dtype)
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32" if training else "fp16"
    return "fp32" if training or not cpu_has_native_bf16() else "bf16"


def torch_dtype(dtype):
    """The torch dtype of a dtype name (None stays None: keep the weights as they are)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        canonical_dtype(dtype)
    ]


def autocast(device: str, dtype: str):
    """The autocast context of a resolved dtype on `device` (fp32: no autocast at all)."""
    import torch

    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(
        device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch_dtype(dtype)
    )


def weights_dtype(device: str, dtype: str) -> str:
    """The dtype evaluation holds the linear layers' weights in: bf16 on CUDA when the forward
    runs in bf16 (autocast would cast them to it on every forward), else fp32, so a CPU keeps
    its weights as loaded."""
    return "bf16" if device.startswith("cuda") and dtype == "bf16" else "fp32"


def hold_linear_weights(model, dtype: str) -> int:
    """Cast, in place, the weight matrices of `model`'s `nn.Linear` layers to `dtype` (fp32:
    leave them); returns how many changed.

    Under autocast in that dtype the losses stay the same: `F.linear` reads its weight rounded to
    the autocast dtype either way, now once instead of on every forward. Everything else keeps
    its dtype: biases (a layer may add its own in fp32, as Mamba's dt_proj does in the scan),
    norms, embeddings, convolutions, decays, and a weight shared with another kind of module (a
    head tied to the embedding, which reads it unrounded).
    """
    from torch import nn

    if canonical_dtype(dtype) == "fp32":
        return 0
    target = torch_dtype(dtype)
    linear, other = {}, set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            linear[id(module.weight)] = module.weight
            other.update(
                id(p) for name, p in module.named_parameters(recurse=False) if name != "weight"
            )
        else:
            other.update(id(p) for p in module.parameters(recurse=False))
    held = 0
    for key, weight in linear.items():
        if key not in other and weight.is_floating_point() and weight.dtype != target:
            weight.data = weight.data.to(target)
            held += 1
    return held


def resolve_on_cluster(executor, dtype: str, device: str) -> str:
    """`resolve_dtype` where the work runs: on one of a Ray cluster's GPUs for a CUDA evaluation
    (the driver may have no GPU, or another kind), else here as a local run would."""
    if not device.startswith("cuda"):
        return resolve_dtype(dtype, "cpu")
    if canonical_dtype(dtype) != "auto":
        return canonical_dtype(dtype)
    return executor.call(_resolve_auto_on_gpu, device, num_gpus=1)


def _resolve_auto_on_gpu(device: str) -> str:
    return resolve_dtype("auto", device)


@contextlib.contextmanager
def torch_threads(n: int):
    """Inside, `n` torch intra-op threads (0: as they are); the caller's count comes back after,
    so a stage run from Python (or a test) leaves the process as it found it."""
    import torch

    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
