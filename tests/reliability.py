"""Helpers of the reliability tests (faults, determinism, bad input, verify): a tiny real run built
by the real stages through the CLI, and ways to compare output directories."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pipeline.cli import main as cli_main
from tests import REPO
from tests.conftest import stdlib_files
from tests.tiny_models import save_native_lm

WINDOW = 64  # tag window of the tiny runs: short, so there are many windows and parts


def copy_sources(dest: Path, n: int, skip: int = 0) -> Path:
    """`n` real standard-library files copied into `dest` (a directory text source)."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in stdlib_files(skip + n, max_bytes=30_000)[skip:]:
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def cli(*argv: str) -> int:
    """Run `arslice ARGV` in this process; returns the exit status."""
    return cli_main([str(a) for a in argv])


def arslice_argv(*argv) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *[str(a) for a in argv]]


def run_subprocess(*argv, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        arslice_argv(*argv), cwd=REPO, env=env, capture_output=True, text=True, **kw
    )


def save_tiny_native(out: Path, tokenizer_path: Path, *, vocab: int = 1024, l_max: int = 128):
    """A real native checkpoint (2-block attention LM) with the tokenizer beside it."""
    return save_native_lm(out, vocab, tokenizer=tokenizer_path, num_heads=2, l_max=l_max, seed=3)


def run_commands(run: Path, src_train: Path, src_val: Path, tokenizer_path: Path, model: Path):
    """The `arslice` commands (argv lists) that make a tiny run under `run`, in order."""
    tok = str(tokenizer_path)
    commands = [
        ["tokenize", "--source", src, "--glob", "*.py", "--tokenizer", tok, "--workers", "1",
         "--out", run / "tokens" / part]
        for part, src in (("train", src_train), ("val", src_val))
    ]  # fmt: skip
    commands += [
        ["count", "--tokens", run / "tokens/train", "--out", run / "counts", "--workers", "1"],
        ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", run / "tags",
         "--window", WINDOW, "--workers", "1", "--threshold", "4"],
        ["eval", "--model", f"native:{model}", "--tags", run / "tags",
         "--out", run / "losses/attention", "--device", "cpu", "--batch-size", "16",
         "--chunk-windows", "16"],
    ]  # fmt: skip
    return [[str(a) for a in c] for c in commands]


def build_run(root: Path, tokenizer_path: Path, *, n_train: int = 24, n_val: int = 3) -> dict:
    """A complete tiny run under `root/run`: stores, counts, tags and one model's losses.

    The model (a real native checkpoint, untrained: training has its own tests) lies outside
    the run, as a checkpoint a user brings would. Every stage goes through `arslice` (in this
    process), as a user would run it.
    """
    run = root / "run"
    src_train = copy_sources(root / "src-train", n_train)
    src_val = copy_sources(root / "src-val", n_val, skip=n_train)
    model = save_tiny_native(root / "model", tokenizer_path)
    for argv in run_commands(run, src_train, src_val, tokenizer_path, model):
        assert cli(*argv) == 0, argv
    return {"run": run, "src_train": src_train, "src_val": src_val, "model": model}


def final_files(out: Path) -> dict[str, Path]:
    """Files under `out` at their final names: no path part hidden (dot) or ending in `.tmp`.

    Stages keep unfinished work under hidden names (`.parts/`, `.work/`, `.x.tmp`); anything
    else a reader may pick up as finished output.
    """
    if not out.exists():
        return {}
    found = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if p.is_file() and not any(s.startswith(".") or s.endswith(".tmp") for s in rel.parts):
            found[str(rel)] = p
    return found


def as_killed(out: Path) -> dict:
    """Turn the complete output `out` into what a kill just before its meta.json leaves: its
    plan and its ledger (every finished part), no meta.json. Returns the meta.json it had."""
    from ar_slicing.machinery.io import read_json
    from ar_slicing.machinery.plan import StagePlan, open_stage

    meta = read_json(out / "meta.json")
    stage = open_stage(out, StagePlan(**meta["plan"]))
    stage.reopen()
    stage.release()
    return meta


def kill_when(argv: list, ready: Callable[[], bool], *, timeout: float = 120.0) -> tuple[bool, str]:
    """Start `arslice ARGV` in a subprocess and SIGKILL it as soon as `ready()` holds.

    Returns (killed before it finished, its stderr).
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        arslice_argv(*argv), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if ready():
            break
        time.sleep(0.001)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return killed, proc.stderr.read().decode()


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Callable[[str], None]]:
    """A tmpfs of `size` ("32k") mounted at the new folder `mount`, unmounted after; yields
    `remount(options)` ("size=64m", "ro"). Root may mount one here; elsewhere the test is
    skipped, saying why."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")

    def remount(options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)

    try:
        yield remount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, bpe_tokenizer_path) -> dict:
    """One complete tiny run shared by the reliability tests (read it; copy it before changing)."""
    return build_run(tmp_path_factory.mktemp("tiny-run"), bpe_tokenizer_path)
