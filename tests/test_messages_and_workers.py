"""The worker processes of a stage die with it when it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability import REPO, WINDOW, arslice_argv, cli, tiny_run  # noqa: F401  (a fixture)

# ---- workers die with their stage --------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            state, ppid = _state_and_parent(int(entry.name))
            if ppid == pid and state != "Z":
                found.append(int(entry.name))
    return found


def _state_and_parent(pid: int) -> tuple[str | None, int | None]:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    state, _ = _state_and_parent(pid)
    return state is not None and state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("stage", ["tokenize", "tag"])
def test_workers_die_with_a_killed_stage_and_the_rerun_finishes(tiny_run, tmp_path, stage):  # noqa: F811
    run = tiny_run["run"]
    argv = {
        "tokenize": ["tokenize", "--source", tiny_run["src_train"], "--glob", "*.py",
                     "--tokenizer", run / "tokens/train/tokenizer.json"],
        "tag": ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts",
                "--window", WINDOW, "--threshold", "4", "--part-tokens", "64"],
    }[stage] + ["--workers", "2", "--out", tmp_path / stage]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(arslice_argv(*argv), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while proc.poll() is None and len(workers) < 2 and time.monotonic() < deadline:
        workers = _children(proc.pid)
        time.sleep(0.01)
    assert proc.poll() is None and len(workers) >= 2, "the stage ended before its workers started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:  # (leave nothing behind, whatever the outcome)
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"workers {survivors} outlived their killed stage by 5 s"
    assert cli(*map(str, argv)) == 0
    assert (tmp_path / stage / "meta.json").is_file()
