"""The instruction sets of torch's CPU kernels, pinned for training, so that a training run writes
the same bytes on any x86-64 CPU.

On a CPU torch computes with three libraries, each of which picks its code for the CPU it finds,
and the picks round differently: its own kernels (elementwise ops, reductions, softmax, the
optimizer; AVX-512, AVX2 or plain code, `ATEN_CPU_CAPABILITY`), MKL (the matrix products and
FFTs; its conditional numerical reproducibility mode, `MKL_CBWR`) and oneDNN (convolutions;
`ONEDNN_MAX_CPU_ISA`). Left to themselves, one `arslice train` writes other weights on an AVX-512
Xeon than on an AVX2 EPYC. Each library reads its variable once, from the environment, when torch
first uses it, so the pin (`PIN`) is set before torch loads, in every process that trains:
`arslice train` sets it first thing, `arslice run` trains in processes started with it (its own
process, which evaluates, keeps the CPU's fastest code), and a training run that finds torch
already loaded with other settings refuses, naming the fix (`require_pinned`).

Why these levels: AVX2 is the widest vector code every x86-64 CPU of the last ten years runs
(Intel since 2013, AMD since 2015), and it is what torch's kernels and oneDNN give alike on
Intel and AMD. MKL is the exception: its AVX2 branch exists only on Intel CPUs (on any other it
silently takes its automatic one), and COMPATIBLE, its SSE2 code without approximate
instructions, is the one branch it runs alike on every x86-64 CPU. The cost, measured on the
demo's models, is in docs/design.md ("Reproducible training").

What a training run used is recorded: the plan's `cpu_kernels` setting (`plan_setting`: the pin,
and whether this CPU runs it), and in its meta.json what torch and MKL report they use
(`reported`), so an output or a prebuilt model made under other kernels is refused by the plan
rule, naming them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ar_slicing.errors import ArSliceError
from models import precision

# The environment a training process runs with. (ATen's and oneDNN's names are lower/upper case
# as each library spells them.)
PIN = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# what ATen's avx2 kernels need of the CPU (they are compiled with -mavx2 -mfma); without them it
# falls back to its plain code, and so would the weights
_AVX2_FLAGS = ("avx2", "fma")
# MKL's CNR branches (mkl_cbwr_get's values; STRICT is a bit flag on top)
_MKL_BRANCHES = {
    0: "OFF", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 5: "SSE3", 6: "SSSE3",
    7: "SSE4_1", 8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512",
    13: "AVX512_MIC_E1", 14: "AVX512_E1",
}  # fmt: skip
_MKL_STRICT = 0x10000


def pin_text() -> str:
    """The pin as it is typed in a shell."""
    return " ".join(f"{k}={v}" for k, v in PIN.items())


def is_pinned() -> bool:
    """True when this process's environment holds the pin."""
    return all(os.environ.get(k) == v for k, v in PIN.items())


def pin() -> None:
    """Put the pin into this process's environment (its child processes inherit it), before torch
    loads; refused when torch is already loaded with other settings, as its libraries may have
    read theirs."""
    if is_pinned():
        return
    if "torch" in sys.modules:
        raise ArSliceError(_loaded_first())
    os.environ.update(PIN)


def _loaded_first() -> str:
    found = ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in PIN)
    return (
        f"torch was loaded in this process before its CPU kernels were pinned for training "
        f"(found {found}), so the weights would depend on this CPU; train with `arslice train` "
        f"or `arslice run` (they pin it first), or start Python with {pin_text()} in the "
        "environment, or call models.cpu_kernels.pin() before importing torch"
    )


def plan_setting(cpuinfo: str | None = None) -> str:
    """The training plan's `cpu_kernels`: the pin, and "(this CPU has no AVX2 ...)" on a CPU that
    cannot run it (its weights differ from every AVX2 CPU's). Needs no torch."""
    flags = precision.cpu_flags(cpuinfo)
    if flags is not None and not all(f in flags for f in _AVX2_FLAGS):
        missing = " and ".join(f.upper() for f in _AVX2_FLAGS if f not in flags)
        return f"{pin_text()} (this CPU has no {missing}: torch and oneDNN run older code)"
    return pin_text()


def require_pinned() -> dict:
    """In the process about to train: pin the kernels if torch is not loaded yet, refuse if it
    was loaded with other settings or runs other kernels than the pin asks, and return what
    torch and MKL report they use (`reported`), for meta.json."""
    pin()
    seen = reported()
    flags = precision.cpu_flags()
    can_run_avx2 = flags is None or all(f in flags for f in _AVX2_FLAGS)
    if can_run_avx2 and seen["aten"] != PIN["ATEN_CPU_CAPABILITY"].upper():
        raise ArSliceError(f"torch's CPU kernels run {seen['aten']}, not AVX2: " + _loaded_first())
    if seen["mkl_cbwr"] not in (None, PIN["MKL_CBWR"]):
        raise ArSliceError(f"MKL runs its {seen['mkl_cbwr']} branch: " + _loaded_first())
    return seen


def reported() -> dict:
    """What this process's torch says it computes with: its kernels' instruction set
    (`torch.backends.cpu.get_cpu_capability()`), MKL's reproducibility branch (None without MKL)
    and oneDNN's cap as set (oneDNN does not report its own)."""
    import torch

    return {
        "pinned": dict(PIN),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": mkl_branch(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }


def mkl_branch() -> str | None:
    """MKL's conditional-reproducibility branch in this process, as MKL reports it (torch links
    MKL into libtorch_cpu and exports its `mkl_serv_cbwr_get`); None where torch has no MKL."""
    import ctypes

    import torch

    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    value = get(-1)  # MKL_CBWR_ALL: the branch and the STRICT flag
    name = _MKL_BRANCHES.get(value & 0xFFFF, str(value & 0xFFFF))
    return f"{name},STRICT" if value & _MKL_STRICT else name
