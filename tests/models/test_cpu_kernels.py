"""A training run writes the same bytes whatever CPU it runs on (`models.cpu_kernels`).

Shown on one machine by asking torch's three CPU libraries for other instruction sets from the
environment, each run a fresh process: a tiny model of each kind of kernel the demo trains
(attention: MKL's matrix products and torch's own kernels; BaseConv: oneDNN's convolutions;
Hyena: MKL's FFTs) trained a few steps on one thread. Unpinned, the trainer's own loop writes
other weights when only torch's kernels go from AVX-512 to AVX2 (so the test can fail); through
`arslice train`, which pins them, the file is the same whatever the environment asks for, the
same as on a machine capped at AVX2 in all three libraries, and the same as the unpinned loop
under exactly the pin (the pin is those three settings and nothing else)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import cpu_kernels
from models.precision import cpu_flags
from tests import REPO

KERNEL_VARS = tuple(cpu_kernels.PIN)
AVX512 = {
    "ATEN_CPU_CAPABILITY": "avx512",
    "MKL_CBWR": "AVX512",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
}
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ARCHS = {
    "attention": ["--mixer-options", "num_heads=2"],
    "base_conv": [],
    "hyena": ["--mixer-options", "filter_order=16"],
}
SHAPE = ["--d-model", "32", "--n-layers", "2", "--seq-len", "64", "--batch-size", "4"]
SHAPE += ["--steps", "4", "--warmup-steps", "1", "--eval-every", "0", "--checkpoint-every", "0"]
SHAPE += ["--threads", "1", "--device", "cpu", "--no-progress"]

# The trainer's own loop with nothing pinned (what `arslice train` ran before): the config from
# the same flags, the same start and steps, the model saved by the same writer.
UNPINNED = """
import sys
import torch
from pipeline.cli import build_parser
from pipeline.config import config_from_namespace
from pipeline.train import _start
from pipeline.train.loop import Progress, TrainInputs, train_steps
from models.checkpoints.native import save_native
import contextlib

parser, command = build_parser("train")
cfg = config_from_namespace(command.config_cls, parser.parse_args(sys.argv[1:]))
torch.set_num_threads(1)
inputs = TrainInputs.open(cfg)
_, model, optimizer = _start(cfg, inputs, "cpu")
train_steps(cfg, model, optimizer, inputs, Progress(), "cpu", contextlib.nullcontext,
            checkpoint=lambda p: None, name="unpinned")
model.eval()
save_native(model, cfg.out, tokenizer_json=inputs.tokenizer_json, saved_dtype=cfg.saved_dtype)
"""


def _env(**kernels: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    return {**env, **kernels, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def train(store: Path, out: Path, arch: str, env: dict, pinned: bool = True) -> str:
    """sha256 of the model.safetensors a tiny training writes under `env`."""
    args = ["--arch", arch, "--tokens", str(store), "--out", str(out), *SHAPE, *ARCHS[arch]]
    if pinned:
        argv = [sys.executable, "-m", "pipeline.cli", "train", *args]
    else:
        argv = [sys.executable, "-c", UNPINNED, *args]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory, stdlib_texts, bpe_tokenizer, bpe_tokenizer_path) -> Path:
    from ar_slicing.data.store import write_token_store
    from ar_slicing.data.tokenizer import describe

    root = tmp_path_factory.mktemp("kernels")
    docs = [bpe_tokenizer.encode(t).ids for t in stdlib_texts[:12]]
    return write_token_store(
        root / "train",
        docs,
        tokenizer_info=describe(bpe_tokenizer, "stdlib-bpe"),
        tokenizer_json=Path(bpe_tokenizer_path).read_text(),
    ).path


def test_the_pin_names_what_each_library_reads():
    assert cpu_kernels.pin_text() == (
        "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2"
    )
    flags = "flags\t\t: fpu sse2 avx avx2 fma avx512f\n"
    assert cpu_kernels.plan_setting(flags) == cpu_kernels.pin_text()
    older = cpu_kernels.plan_setting("flags\t\t: fpu sse2 sse4_2 avx\n")
    assert older.startswith(cpu_kernels.pin_text()) and "no AVX2 and FMA" in older


@pytest.mark.skipif(
    "avx512f" not in (cpu_flags() or set()),
    reason="shows the difference between AVX-512 and AVX2 kernels: needs an AVX-512 CPU",
)
@pytest.mark.parametrize(
    "arch",
    ["attention", *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS if a != "attention")],
)
def test_training_writes_the_same_bytes_whatever_kernels_the_cpu_offers(store, tmp_path, arch):
    # unpinned, torch's own kernels alone change the bytes (the defect, and that this can fail)
    wide = train(store, tmp_path / "u512", arch, _env(ATEN_CPU_CAPABILITY="avx512"), False)
    narrow = train(store, tmp_path / "u2", arch, _env(ATEN_CPU_CAPABILITY="avx2"), False)
    assert wide != narrow
    # pinned: whatever the environment asks for, the same bytes, those of a machine whose three
    # libraries stop at AVX2, and those of the unpinned loop under exactly the pin
    hashes = {
        "AVX-512 asked for": train(store, tmp_path / "p512", arch, _env(**AVX512)),
        "nothing asked for": train(store, tmp_path / "p", arch, _env()),
        "an AVX2-only machine": train(store, tmp_path / "p2", arch, _env(**AVX2_ONLY)),
        "the unpinned loop under the pin": train(
            store, tmp_path / "pin", arch, _env(**cpu_kernels.PIN), False
        ),
    }
    assert len(set(hashes.values())) == 1, hashes
    assert wide not in hashes.values()
    meta = (tmp_path / "p512" / "meta.json").read_text()
    assert '"aten": "AVX2"' in meta and '"mkl_cbwr": "COMPATIBLE"' in meta
    assert cpu_kernels.pin_text() in meta  # the plan's setting


def test_torch_loaded_unpinned_is_refused_naming_the_fix(store, tmp_path):
    """A training started in a process that loaded torch with other settings refuses (its
    libraries may have read theirs already): one line naming the pin and how to get it."""
    code = (
        "import sys, torch\n"
        "from pipeline.cli import main\n"
        "sys.exit(main(['train', *sys.argv[1:]]))\n"
    )
    argv = [sys.executable, "-c", code, "--arch", "attention", "--tokens", str(store)]
    argv += ["--out", str(tmp_path / "m"), *SHAPE]
    done = subprocess.run(
        argv, cwd=REPO, env=_env(ATEN_CPU_CAPABILITY="avx512"), capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch was loaded in this process before" in lines[0]
    assert cpu_kernels.pin_text() in lines[0] and "ATEN_CPU_CAPABILITY=avx512" in lines[0]
    assert not (tmp_path / "m").exists()
