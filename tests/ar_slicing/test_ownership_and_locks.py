"""A stage removes only what it wrote, one writer holds an output at a time, `arslice run`
writes nothing before its checks pass, and dry runs refuse missing inputs, all at once.

Each test is a way a user's file was lost, an output was written by two processes at once, or a
mistake surfaced only after work was done."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ar_slicing.machinery.io import read_json, write_json_atomic
from ar_slicing.machinery.ownership import ForeignFiles, output_lock
from ar_slicing.machinery.plan import StagePlan, open_stage
from tests.conftest import small_pipeline_config
from tests.reliability import REPO, arslice_argv, cli, run_subprocess, tiny_run  # noqa: F401  (a fixture)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (links as their target's path)."""
    return {
        str(p.relative_to(folder)): (
            str(os.readlink(p)).encode() if p.is_symlink() else p.read_bytes()
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def tag_argv(run: Path, out: Path, *extra) -> list[str]:
    return ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", out,
            "--window", "64", "--workers", "1", "--threshold", "4", *extra]  # fmt: skip


# ---- 1. ownership: --overwrite removes only the stage's own files -----------------------------


def test_overwrite_never_removes_a_file_the_stage_did_not_write(own_run, tmp_path, capsys):
    run = own_run["run"]
    # a folder of the user's own, and a complete tags folder the user put a file into
    mine = tmp_path / "d"
    (mine / ".ssh").mkdir(parents=True)
    (mine / ".ssh/id_rsa").write_text("k\n")
    tags = tmp_path / "tags"
    shutil.copytree(run / "tags", tags)
    (tags / "important.txt").write_text("my notes\n")
    for out, first in ((mine, mine / ".ssh"), (tags, tags / "important.txt")):
        before = tree(out)
        for flags in ((), ("--overwrite",)):
            capsys.readouterr()
            assert cli(*tag_argv(run, out, *flags)) == 2
            err = capsys.readouterr().err
            assert f"holds {first}, which the tag stage did not write" in err, err
            assert "Nothing was changed" in err and err.count("\n") == 1  # one line
            assert tree(out) == before  # the user's file, and the stage's, as they were
    # without the foreign file the same --overwrite redoes the output
    (tags / "important.txt").unlink()
    assert cli(*tag_argv(run, tags, "--overwrite")) == 0
    assert read_json(tags / "meta.json")["owns"] == ["windows.parquet", "tags-*.parquet"]


def tag_plan(**settings) -> StagePlan:
    return StagePlan("tag", {"window": 8, **settings}, {"counts": "c" * 64})


def finish_tags(out: Path, plan: StagePlan) -> None:
    stage = open_stage(out, plan, overwrite=True)
    with stage.running():
        stage.expect([out / "tags-00000.parquet"])
        (out / "tags-00000.parquet").write_text(json.dumps(plan.settings))
        stage.finish({"stage": "tag"})


def test_a_linked_output_folder_is_followed_and_its_target_kept(tmp_path):
    target = tmp_path / "elsewhere"
    finish_tags(target, tag_plan())
    link = tmp_path / "tags"
    link.symlink_to(target)
    finish_tags(link, tag_plan(window=16))  # was: OSError: Cannot call rmtree on a symbolic link
    assert link.is_symlink() and target.is_dir()
    assert read_json(target / "meta.json")["plan"]["settings"]["window"] == 16
    (target / "mine.txt").write_text("kept")
    with pytest.raises(ForeignFiles, match="mine.txt, which the tag stage did not write"):
        open_stage(link, tag_plan(), overwrite=True)
    assert (target / "mine.txt").read_text() == "kept" and (target / "tags-00000.parquet").exists()


def test_an_output_made_before_the_ledger_is_still_the_stages_own(tmp_path):
    out = tmp_path / "tags"
    finish_tags(out, tag_plan())
    meta = read_json(out / "meta.json")
    del meta["owns"], meta["written"]  # as an older version wrote it
    write_json_atomic(out / "meta.json", meta)
    (out / "windows.parquet").write_text("w")  # a name of the stage's layout
    assert open_stage(out, tag_plan()).complete
    finish_tags(out, tag_plan(window=32))
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tags-00000.parquet"]


def test_a_run_with_overwrite_keeps_the_users_files_in_stage_folders(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run_dir = tmp_path / "run"
    done = run_subprocess("run", "--config", cfg, "--stage", "tokenizer", "tokenize")
    assert done.returncode == 0, done.stderr
    users = {"tags/important.txt": "a", "report/draft.md": "b", "tokens/val/hand.txt": "c"}
    for rel, text in users.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    before = tree(run_dir)
    done = run_subprocess("run", "--config", cfg, "--overwrite")
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"arslice run: error: {cfg}: run_dir {run_dir} holds {run_dir / 'report/draft.md'} "
        "(and 2 more), which this project did not write; nothing was written."
    ), done.stderr
    assert tree(run_dir) == before  # every file as it was, the stores included


# ---- 2. one writer per output ------------------------------------------------------------------


def start_stopped_when(argv, ready, timeout: float = 120.0) -> subprocess.Popen:
    """Start `arslice ARGV` and stop it (SIGSTOP) as soon as `ready()` holds, mid-write."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        arslice_argv(*argv), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, "the first writer never started writing"
        time.sleep(0.002)
    proc.send_signal(signal.SIGSTOP)
    wait_stopped(proc.pid)
    return proc


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Wait until every thread of `pid` is stopped: kill() returns before a thread running on
    another core has stopped, and a writer thread's next file would land after the snapshot."""
    deadline = time.time() + timeout
    while True:
        states = set()
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.add(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that has just exited
        if states <= {"T", "t"}:
            return
        assert time.time() < deadline, f"pid {pid} did not stop: thread states {states}"
        time.sleep(0.002)


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


@pytest.fixture
def own_run(tiny_run, tmp_path) -> dict:  # noqa: F811  (a copy to change)
    run = tmp_path / "copy" / "run"
    shutil.copytree(tiny_run["run"], run)
    return {**tiny_run, "run": run}


def eval_argv(run: Path, model: Path, *extra) -> list[str]:
    return ["eval", "--model", f"native:{model}", "--tags", run / "tags",
            "--out", run / "losses/attention", "--device", "cpu", "--batch-size", "4",
            "--chunk-windows", "1", *extra]  # fmt: skip


def test_a_second_eval_into_the_same_losses_is_refused_and_the_first_completes(own_run):
    run, model = own_run["run"], own_run["model"]
    out = run / "losses/attention"
    shutil.rmtree(out)
    first = start_stopped_when(eval_argv(run, model), lambda: any(out.glob("losses-*.parquet")))
    try:
        in_flight = tree(out)
        second = run_subprocess(*eval_argv(run, model, "--overwrite"))
        assert second.returncode == 2
        assert second.stderr == (
            f"arslice eval: error: {out}: another arslice (pid {first.pid}) is writing it; this "
            "one does not wait: rerun when that one has finished, or choose another output\n"
        )
        assert tree(out) == in_flight  # nothing of the first writer's swept or replaced
    finally:
        done = finished(first)
    assert done.returncode == 0, done.stderr
    assert not (out / ".arslice.lock").exists()
    assert cli("verify", "--run", run) == 0
    # and its rerun is a skip of a complete output, which it is
    assert "is complete" in run_subprocess(*eval_argv(run, model)).stdout


def test_two_identical_counts_one_writes_the_other_is_refused(own_run, tmp_path):
    run = own_run["run"]
    out = tmp_path / "counts"
    argv = ["count", "--tokens", run / "tokens/train", "--out", out, "--workers", "1",
            "--shard-tokens", "2000"]  # fmt: skip
    first = start_stopped_when(argv, lambda: any((out / ".work/partials").glob("*.bin")))
    try:
        second = run_subprocess(*argv)
        assert second.returncode == 2 and f"(pid {first.pid}) is writing it" in second.stderr
    finally:
        done = finished(first)
    assert done.returncode == 0, done.stderr
    assert (out / "bigrams.parquet").read_bytes() == (run / "counts/bigrams.parquet").read_bytes()


def test_a_killed_writer_leaves_no_lock_behind(own_run):
    run = own_run["run"]
    out = run / "tags"
    shutil.rmtree(out)
    first = start_stopped_when(tag_argv(run, out), lambda: (out / ".plan.json").exists())
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert (out / ".arslice.lock").read_text() == f"{first.pid}\n"  # its file, not its lock
    assert cli(*tag_argv(run, out)) == 0
    assert cli("verify", "--run", run) == 0


def test_the_holder_is_named_and_the_lock_is_free_once_it_lets_go(own_run):
    run = own_run["run"]
    before = tree(run / "tags")
    with output_lock(run / "tags"):  # held by this process; the stage runs in another
        done = run_subprocess(*tag_argv(run, run / "tags", "--overwrite"))
        assert done.returncode == 2 and f"(pid {os.getpid()}) is writing it" in done.stderr
    assert tree(run / "tags") == before
    assert run_subprocess(*tag_argv(run, run / "tags", "--overwrite")).returncode == 0
    assert cli("verify", "--run", run) == 0


# ---- 3. `arslice run` writes nothing before its checks pass ----------------------------------


def test_a_run_into_a_folder_of_the_users_changes_nothing_there(tmp_path, capsys):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "config.toml").write_text("# my own experiment settings\nlr = 3e-4\n")
    (mine / "data.csv").write_text("a,b\n1,2\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path).replace(f"{tmp_path}/run", str(mine)))
    before = tree(mine)
    message = (
        f"arslice run: error: {cfg}: run_dir {mine} holds {mine / 'config.toml'} (and 1 more), "
        "which this project did not write; nothing was written."
    )
    for flags in (("--dry-run",), (), ("--overwrite",), ("--make-rules",)):
        capsys.readouterr()
        assert cli("run", "--config", cfg, *flags) == 2
        err = capsys.readouterr().err
        assert err.startswith(message), err
        assert tree(mine) == before  # config.toml byte-identical, no .settings/, no tokenizer
        assert sorted(p.name for p in mine.iterdir()) == ["config.toml", "data.csv"]


@pytest.mark.parametrize("run_dir", ["/", "~"])
def test_the_root_or_the_home_folder_is_refused_as_a_run_dir(tmp_path, capsys, run_dir):
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path).replace(f"{tmp_path}/run", run_dir))
    assert cli("run", "--config", cfg, "--dry-run") == 2
    shown = os.path.expanduser(run_dir)
    assert f"run_dir {shown} holds {Path(shown) / sorted(os.listdir(shown))[0]}" in (
        capsys.readouterr().err
    )


def test_a_run_of_its_own_folder_still_passes_its_checks(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    assert cli("run", "--config", cfg, "--stage", "tokenizer") == 0
    assert (tmp_path / "run/config.toml").read_text().startswith("# Resolved from")
    assert cli("run", "--config", cfg, "--dry-run") == 0
    # the resolved config.toml it wrote is its own, and may be run again
    assert cli("run", "--config", tmp_path / "run/config.toml", "--stage", "tokenizer") == 0


# ---- 6. dry runs check inputs ------------------------------------------------------------------


def test_dry_runs_refuse_missing_inputs_naming_each(tmp_path, capsys):
    gone = tmp_path / "gone"
    cases = {
        ("tag", "--tokens", gone / "val", "--counts", gone / "counts", "--out", tmp_path / "t"):
            [f"--tokens {gone / 'val'}", f"--counts {gone / 'counts'}"],
        ("eval", "--model", f"native:{gone / 'model'}", "--tags", gone / "tags",
         "--out", tmp_path / "l"): [f"--tags {gone / 'tags'}", f"--model {gone / 'model'}"],
        ("count", "--tokens", gone / "a", gone / "b", "--out", tmp_path / "c"):
            [f"--tokens {gone / 'a'}", f"--tokens {gone / 'b'}"],
    }  # fmt: skip
    for argv, named in cases.items():
        capsys.readouterr()
        assert cli(*argv, "--dry-run") == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith("(nothing was run)\n"), err
        for what in named:
            assert f"{what}: no such file or directory" in err, (what, err)
    assert not any(tmp_path.iterdir())


def test_a_run_dry_run_lists_every_missing_input_at_once(tmp_path, capsys):
    gone = tmp_path / "gone"
    cfg = tmp_path / "c.toml"
    text = small_pipeline_config(
        tmp_path,
        tokenize=f'source = ["{gone / "corpus"}"]',
        tokenizer=f'source = ["{gone / "corpus"}"]',
        tag=f'counts = "{gone / "counts"}"',
    )
    cfg.write_text(text + f'\n[eval.models.ext]\nmodel = "native:{gone / "ckpt"}"\n')
    assert cli("run", "--config", cfg, "--dry-run") == 2
    err = capsys.readouterr().err
    assert f"{cfg}: 6 problems, found before anything ran:" in err, err
    for line in (
        f"[tokenizer]: source {gone / 'corpus'}: no such file or directory",
        f"[tokenize.train]: source {gone / 'corpus'}: no such file or directory",
        f"[tokenize.val]: source {gone / 'corpus'}: no such file or directory",
        f"[tag]: --counts {gone / 'counts'}: no such file or directory",
        f"[eval.models.ext]: --model {gone / 'ckpt'}: no such file or directory",
        f"[probe] ext: --model {gone / 'ckpt'}: no such file or directory",  # (it probes it too)
    ):
        assert line in err, (line, err)
    assert not (tmp_path / "run").exists()
