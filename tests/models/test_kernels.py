"""The fused kernels (models/kernels/) against their fp64 references, under Triton's interpreter
on a CPU and on CUDA, a tiny Mamba's and RWKV's losses with the kernels against the PyTorch path,
and the dispatch: which path runs where, what it records and what it refuses.

The interpreter must be switched on before triton is imported, so the CPU cases run in one
subprocess (tests/models/kernel_cases.py, which also lists the cases and their shapes)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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
# the fused ops each kernel case and each tiny model runs
CASE_OPS = {"scan": ("causal_conv1d", "selective_scan"), "wkv": ("wkv",), "ssd": ("ssd",)}
MODEL_OPS = {
    "mamba": ("causal_conv1d", "selective_scan"),
    "rwkv": ("wkv",),
    "mamba2": ("causal_conv1d", "ssd"),
}


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
    assert result["paths"] == dict.fromkeys(MODEL_OPS[arch], "triton")


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
    # ... but not for fp32 tensors where the field's kernel would round its matmuls to TF32
    ssd_imports = importlib.util.find_spec("mamba_ssm") is not None
    assert choose("ssd", on_cuda=True, needs_grad=False) == ("field" if ssd_imports else "triton")
    assert choose("ssd", on_cuda=True, needs_grad=False, fp32=True) == "triton"
    assert choose("wkv", on_cuda=True, needs_grad=False, fp32=True) == want  # (exact in fp32)
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

    kind = KERNEL_CASES[case]["kernel"]
    for op in CASE_OPS[kind]:
        for module in OPS[op].field_needs:
            pytest.importorskip(module, reason=f"the field's {op} kernel is an optional package")
    result = kernel_error(case, "cuda", path="field")
    if kind == "ssd":  # mamba_ssm's Triton dots take fp32 operands as TF32 (11-bit significands)
        assert result["error"] <= 5e-3 * result["scale"], result
    else:
        assert result["error"] <= TOLERANCE, result


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MODEL_CASES)
def test_tiny_model_losses_with_kernels_equal_the_pytorch_path_on_cuda(arch):
    result = model_error(arch, "cuda")
    assert result["mean_nll"] > 1.0 and result["error"] <= TOLERANCE, result


def compile_for_hopper(kernel, bf16: set[str], constexprs: dict, options: dict, ints=None):
    """`kernel` through Triton's compiled frontend (not the interpreter) to an sm_90 cubin, on a
    CPU: pointers named in `bf16` to bf16, the others to fp32, `dt_min`/`dt_max` fp32, the rest
    i32. `ints`: example values of the integer arguments, specialized as a launch with them
    would be (a multiple of 16 marked divisible, which lets Triton vectorize loads; 1 constant)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ints or {}
    constexprs = {**constexprs, **{n: 1 for n, v in ints.items() if v == 1}}
    signature = {
        n: ("*bf16" if n in bf16 else "*fp32") if n.endswith("_ptr")
        else "constexpr" if n in constexprs
        else "fp32" if n in ("dt_min", "dt_max")
        else "i32"
        for n in kernel.arg_names
    }  # fmt: skip
    divisible = {n for n in kernel.arg_names if n.endswith("_ptr") or ints.get(n, 1) % 16 == 0}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n in divisible and n in signature and signature[n] != "constexpr"}  # fmt: skip
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["cubin"] and ".entry" in compiled.asm["ptx"], kernel
    return compiled


def test_kernels_compile_for_a_hopper_gpu_without_one():
    """Triton's compiler runs on a CPU: every kernel, with the block sizes the dispatch launches,
    goes through the compiled frontend (not the interpreter) to an sm_90 cubin, so an error that
    only compiled Triton would raise shows here too."""
    from models.kernels import selective_scan as ss
    from models.kernels import ssd, wkv

    ssd_flags = dict(
        HAS_D=True, D_HAS_HDIM=True, HAS_Z=True, HAS_BIAS=True, DT_SOFTPLUS=True,
        HAS_DT_LIMIT=True, HAS_H0=True, STORE_HT=True, BLOCK_P=32, BLOCK_N=16,
    )  # fmt: skip
    ssd_options = {"num_warps": ssd.SSD_WARPS, "num_stages": ssd.SSD_STAGES}
    ssd_bf16 = {"x_ptr", "dt_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr"}
    cases = [
        (ss._selective_scan_kernel, {"u_ptr", "dt_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr"},
         dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, BLOCK_E=ss.SCAN_BLOCK_E, BLOCK_N=16),
         {"num_warps": ss.SCAN_WARPS}),
        (ss._causal_conv1d_silu_kernel, {"x_ptr", "out_ptr"},
         dict(W=4, HAS_BIAS=True, BLOCK_T=ss.CONV_BLOCK_T, BLOCK_E=ss.CONV_BLOCK_E),
         {"num_warps": 4}),
        (wkv._wkv_kernel, {"k_ptr", "v_ptr", "r_ptr", "out_ptr"},
         dict(HAS_R=True, BLOCK_D=wkv.WKV_BLOCK_D), {"num_warps": wkv.WKV_WARPS}),
        # every option of the SSD scan, in bf16 and in fp32 (IEEE dots, its own chunk)
        (ssd._ssd_kernel, ssd_bf16,
         dict(ssd_flags, DOT_PRECISION="tf32", CHUNK=ssd.SSD_CHUNK), ssd_options),
        (ssd._ssd_kernel, set(),
         dict(ssd_flags, DOT_PRECISION="ieee", CHUNK=ssd.SSD_CHUNK_FP32), ssd_options),
        (ssd._ssd_kernel, ssd_bf16,  # and none of them
         dict(dict.fromkeys(ssd_flags, False), BLOCK_P=16, BLOCK_N=16, DOT_PRECISION="tf32",
              CHUNK=ssd.SSD_CHUNK), ssd_options),
    ]  # fmt: skip
    for kernel, bf16, constexprs, options in cases:
        compile_for_hopper(kernel, bf16, constexprs, options)


def test_ssd_kernel_at_mamba2_130m_shapes_fits_an_sm_without_spilling():
    """The SSD kernel as a bf16 eval of Mamba-2-130M launches it (x, B, C views of the
    convolution's 1792-wide output, dt of in_proj's 3352-wide one, 24 heads of 64, 128 states,
    T 2048), compiled for sm_90: ptxas keeps it in registers (no local memory: the block sizes'
    comment in models/kernels/ssd.py) and its shared memory fits the 99 KB an sm_86/89 GPU gives
    one program, so it launches on every GPU of benchmarks/gpu_eval.py's table."""
    import subprocess
    import tempfile

    import triton

    from models.kernels import ssd

    T, H, P, N, conv, in_proj = 2048, 24, 64, 128, 1792, 3352
    ints = dict(
        T=T, H=H, P=P, N=N, heads_per_group=H, sx_b=T * conv, sx_t=conv, sx_h=P,
        sdt_b=T * in_proj, sdt_t=in_proj, sdt_h=1, sb_b=T * conv, sb_t=conv, sb_g=N,
        sc_b=T * conv, sc_t=conv, sc_g=N, sz_b=0, sz_t=0, sz_h=0, so_b=T * H * P, so_t=H * P,
        so_h=P,
    )  # fmt: skip
    flags = dict(
        HAS_D=True, D_HAS_HDIM=False, HAS_Z=False, HAS_BIAS=True, DT_SOFTPLUS=True,
        HAS_DT_LIMIT=False, HAS_H0=False, STORE_HT=False, DOT_PRECISION="tf32",
        CHUNK=ssd.SSD_CHUNK, BLOCK_P=ssd.SSD_BLOCK_P, BLOCK_N=N,
    )  # fmt: skip
    bf16 = {"x_ptr", "dt_ptr", "B_ptr", "C_ptr", "D_ptr", "bias_ptr", "out_ptr"}
    options = {"num_warps": ssd.SSD_WARPS, "num_stages": ssd.SSD_STAGES}
    compiled = compile_for_hopper(ssd._ssd_kernel, bf16, flags, options, ints=ints)
    assert compiled.metadata.shared <= 99 * 1024, compiled.metadata.shared
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [cuobjdump, "-res-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage  # (REG: its registers)
