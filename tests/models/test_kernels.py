"""The fused kernels (models/kernels/) against their fp64 references, under Triton's interpreter
on a CPU and on CUDA, a tiny Mamba's and RWKV's losses with the kernels against the PyTorch path,
and the dispatch: which path runs where, what it records and what it refuses.

The interpreter must be switched on before triton is imported, so the CPU cases run in one
subprocess (tests/models/kernel_cases.py, which also lists the cases and their shapes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ar_slicing.errors import ArSliceError
from tests.models.kernel_cases import (
    KERNEL_CASES,
    MODEL_CASES,
    TOLERANCE,
    kernel_error,
    model_error,
)

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def interpreted(*args: str, timeout: int = 600) -> str:
    """stdout of `python -m tests.models.kernel_cases ARGS` under Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.models.kernel_cases", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def on_the_interpreter() -> dict:
    """Every case of kernel_cases.py run once on the CPU by Triton's interpreter."""
    return json.loads(interpreted().strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_equals_fp64_reference_on_the_interpreter(case, on_the_interpreter):
    result = on_the_interpreter[case]
    assert result["scale"] > 1.0  # outputs of a few units: a wrong kernel is off by far more
    assert result["error"] <= TOLERANCE, result


@pytest.mark.parametrize("arch", MODEL_CASES)
def test_tiny_model_losses_with_kernels_equal_the_pytorch_path_on_the_interpreter(
    arch, on_the_interpreter
):
    result = on_the_interpreter[f"model {arch}"]
    assert result["mean_nll"] > 1.0 and result["error"] <= TOLERANCE, result
    want = {"causal_conv1d": "triton", "selective_scan": "triton"} if arch == "mamba" else None
    assert result["paths"] == (want or {"wkv": "triton"})


def test_auto_runs_the_pytorch_path_on_a_cpu_and_records_it(monkeypatch):
    from models.kernels import paths_taken, use_kernels
    from models.mixers.rwkv import RWKVTimeMixer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mixer = RWKVTimeMixer(24).eval()
    x = torch.randn(2, 7, 24)
    with torch.no_grad(), use_kernels() as taken:
        mixer(x)
    assert paths_taken(taken) == {"wkv": "pytorch"}
    with torch.no_grad(), use_kernels("triton"), pytest.raises(ArSliceError) as err:
        mixer(x)  # no GPU and no interpreter: refused, with the reason
    assert "--kernels triton: the wkv kernel cannot run here" in str(err.value)
    assert "TRITON_INTERPRET=1" in str(err.value)
    with use_kernels("triton") as taken:
        mixer(x).sum().backward()  # autograd takes the PyTorch path whatever is asked
    assert paths_taken(taken) == {"wkv": "pytorch"}
    assert mixer.time_decay.grad is not None


def test_dispatch_order_and_refusals(monkeypatch):
    from models.kernels import OPS, choose, use_kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for op in OPS:
        assert choose(op, on_cuda=False, needs_grad=False) == "pytorch"
        assert choose(op, on_cuda=True, needs_grad=True, preference="triton") == "pytorch"
        assert choose(op, on_cuda=True, needs_grad=False, preference="pytorch") == "pytorch"
        with pytest.raises(ArSliceError, match=f"--kernels field: the {op} kernel cannot run here"):
            choose(op, on_cuda=False, needs_grad=False, preference="field")
    # on CUDA, `auto` prefers the field's kernel when its package imports, else this project's
    field_imports = all(importlib.util.find_spec(m.split(".")[0]) for m in OPS["wkv"].field_needs)
    want = "field" if field_imports else "triton"
    assert choose("wkv", on_cuda=True, needs_grad=False) == want
    if not field_imports:
        with pytest.raises(
            ArSliceError, match="--kernels field: the wkv kernel .* does not import"
        ):
            choose("wkv", on_cuda=True, needs_grad=False, preference="field")
    with pytest.raises(ArSliceError, match="--kernels 'fast': choose one of auto, field"):
        with use_kernels("fast"):
            pass


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_equals_fp64_reference_on_cuda(case):
    assert kernel_error(case, "cuda")["error"] <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_field_kernel_equals_fp64_reference_on_cuda(case):
    from models.kernels import OPS

    ops = ["wkv"] if KERNEL_CASES[case]["kernel"] == "wkv" else ["causal_conv1d", "selective_scan"]
    for op in ops:
        for module in OPS[op].field_needs:
            pytest.importorskip(module, reason=f"the field's {op} kernel is an optional package")
    assert kernel_error(case, "cuda", path="field")["error"] <= TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MODEL_CASES)
def test_tiny_model_losses_with_kernels_equal_the_pytorch_path_on_cuda(arch):
    result = model_error(arch, "cuda")
    assert result["mean_nll"] > 1.0 and result["error"] <= TOLERANCE, result


def test_kernels_compile_for_a_hopper_gpu_without_one():
    """Triton's compiler runs on a CPU: every kernel, with the block sizes the dispatch launches,
    goes through the compiled frontend (not the interpreter) to an sm_90 cubin, so an error that
    only compiled Triton would raise shows here too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models.kernels import selective_scan as ss
    from models.kernels import wkv

    def signature(kernel, bf16: set[str], constexprs: dict) -> dict:
        return {
            n: ("*bf16" if n in bf16 else "*fp32") if n.endswith("_ptr")
            else "constexpr" if n in constexprs
            else "i32"
            for n in kernel.arg_names
        }  # fmt: skip

    cases = [
        (ss._selective_scan_kernel, {"u_ptr", "dt_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr"},
         dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, BLOCK_E=ss.SCAN_BLOCK_E, BLOCK_N=16),
         ss.SCAN_WARPS),
        (ss._causal_conv1d_silu_kernel, {"x_ptr", "out_ptr"},
         dict(W=4, HAS_BIAS=True, BLOCK_T=ss.CONV_BLOCK_T, BLOCK_E=ss.CONV_BLOCK_E), 4),
        (wkv._wkv_kernel, {"k_ptr", "v_ptr", "r_ptr", "out_ptr"},
         dict(HAS_R=True, BLOCK_D=wkv.WKV_BLOCK_D), wkv.WKV_WARPS),
    ]  # fmt: skip
    for kernel, bf16, constexprs, warps in cases:
        compiled = triton.compile(
            ASTSource(
                fn=kernel, signature=signature(kernel, bf16, constexprs), constexprs=constexprs
            ),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps},
        )
        assert compiled.asm["cubin"] and ".entry" in compiled.asm["ptx"], kernel
