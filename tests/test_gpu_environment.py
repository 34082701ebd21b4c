"""What `make test-gpu bench-gpu PY=python3` needs on a GPU machine's own Python: torch,
transformers, tokenizers, pyarrow, numpy, numba and triton (and pytest for the tests), never the
data side's duckdb or polars nor the other extras. Checked by running the benchmark (in its --tiny
CPU mode) and collecting the GPU tests with those packages made unimportable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# importable here (the development extras) but not to be needed by the GPU path
ABSENT_ON_A_GPU_MACHINE = [
    "duckdb", "polars", "ray", "matplotlib", "tiktoken", "zstandard", "datasets", "omegaconf",
    "tokengrams", "websocket",
]  # fmt: skip
# None in sys.modules: `import duckdb` raises ModuleNotFoundError and importlib.util.find_spec
# answers None, as where the package is not installed
BLOCK = "import sys; sys.modules.update(dict.fromkeys({absent!r}))\n"


def run_without(absent: list[str], code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK.format(absent=set(absent)) + code],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_the_gpu_benchmark_runs_without_the_data_sides_packages(tmp_path):
    table = tmp_path / "gpu-eval.md"
    argv = ["--tiny", "--case", "mamba-130m", "rwkv-169m", "mamba2-130m", "--out", str(table)]
    done = run_without(
        [*ABSENT_ON_A_GPU_MACHINE, "pytest", "hypothesis"],
        f"import runpy; sys.argv = ['gpu_eval.py', *{argv!r}]; "
        "runpy.run_path('benchmarks/gpu_eval.py', run_name='__main__')",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in table.read_text().splitlines() if line.startswith("| Mamba-130M")]
    assert rows and "selective_scan: pytorch" in rows[0]  # the CPU path, recorded
    assert re.search(r"\| RWKV-169M .* \| wkv: pytorch \|", table.read_text())
    assert re.search(
        r"\| Mamba-2-130M .* \| causal_conv1d: pytorch, ssd: pytorch \|", table.read_text()
    )


def test_the_gpu_tests_collect_without_the_data_sides_packages():
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) -m pytest -m gpu -q $(GPU_TESTS)" in makefile  # the files that hold them only
    done = run_without(
        ABSENT_ON_A_GPU_MACHINE,
        f"import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu', *{files!r}]))",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    collected = re.search(r"(\d+)/\d+ tests collected", done.stdout)
    assert collected and int(collected.group(1)) >= 20, done.stdout[-500:]


def test_make_runs_the_gpu_targets_with_any_python():
    done = subprocess.run(
        ["make", "-n", "test-gpu", "bench-gpu", "PY=python3"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "python3 -m pytest -m gpu -q tests/" in done.stdout
    assert "python3 $f" in done.stdout and ".venv" not in done.stdout
