"""Inputs that are not what they claim to be get a one-line message saying what they are, and the
worker processes of a stage die with it when it is killed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability import REPO, WINDOW, arslice_argv, cli, tiny_run  # noqa: F401  (a fixture)

CONFIGS = REPO / "pipeline" / "configs"


def refused(capsys, *argv) -> str:
    """The one line `arslice ARGV` printed, with exit status 2 and no traceback."""
    rc = cli(*map(str, argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ---- files that are not what their place says --------------------------------------------------


def random_bytes(path: Path, n: int = 4096) -> Path:
    """`n` random bytes (seeded) at `path`."""
    import random

    data = random.Random(23).randbytes(n)
    assert not data.startswith((b"PK", b"\x80"))  # neither a zip archive nor a pickle
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "head, words",
    [
        (b"", "not a PyTorch checkpoint (neither the zip archive torch.save writes nor a pickle)"),
        (b"\x80\x02", "not a readable PyTorch checkpoint (a damaged pickle: Unsupported operand"),
    ],
    ids=["random-bytes", "pickle-header-then-random-bytes"],
)
def test_random_bytes_as_a_zoology_checkpoint(tiny_run, tmp_path, capsys, head, words):  # noqa: F811
    ckpt = random_bytes(tmp_path / "model.pt")
    ckpt.write_bytes(head + ckpt.read_bytes())
    err = refused(capsys, "eval", "--model", f"zoology:{ckpt}", "--tags", tiny_run["run"] / "tags",
                  "--device", "cpu", "--out", tmp_path / "losses")  # fmt: skip
    assert f"{ckpt}: {words}" in err
    assert "pickle holds objects" not in err


def test_garbage_pytorch_model_bin_in_a_transformers_directory(
    tiny_run,  # noqa: F811
    tmp_path,
    capsys,
    bpe_tokenizer_path,
):
    from transformers import GPTNeoXConfig

    model_dir = tmp_path / "hf"
    GPTNeoXConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=128).save_pretrained(model_dir)  # fmt: skip
    shutil.copy(bpe_tokenizer_path, model_dir / "tokenizer.json")
    weights = random_bytes(model_dir / "pytorch_model.bin")
    err = refused(capsys, "eval", "--model", f"hf:{model_dir}", "--tags", tiny_run["run"] / "tags",
                  "--device", "cpu", "--out", tmp_path / "losses")  # fmt: skip
    assert f"{weights}: not a PyTorch checkpoint" in err
    assert "Unsupported operand" not in err


@pytest.mark.parametrize("command", ["report", "query", "verify"])
def test_a_file_given_as_the_run_directory(tmp_path, capsys, command):
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0:root:/root:/bin/bash\n")
    argv = {"query": ["query", "slice_perplexity"]}.get(command, [command])
    err = refused(capsys, *argv, "--run", a_file)
    assert f"run directory {a_file}: a file, not a directory" in err


def test_a_negative_window_names_the_config_file_and_table(tmp_path, capsys):
    text = (CONFIGS / "demo.toml").read_text()
    text = re.sub(r'^run_dir = ".*"$', f'run_dir = "{tmp_path / "run"}"', text, flags=re.M)
    text, n = re.subn(r"^window = 256$", "window = -5", text, flags=re.M)
    assert n == 1
    config = tmp_path / "demo.toml"
    config.write_text(text)
    err = refused(capsys, "run", "--config", config, "--dry-run")
    assert f"{config} [tag]: window length must be a positive integer, got -5" in err


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
                     "--tokenizer", run / "tokens/train/tokenizer.json", "--shard-docs", "2"],
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
