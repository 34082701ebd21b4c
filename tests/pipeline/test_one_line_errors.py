"""One line, never a traceback: read-only run folders and mounts, a full disk while training, a
part of the wrong schema, hostile values (a window or a batch beyond any memory, NaN, an empty
glob, a bootstrap that would run for years, more workers than CPUs), config files that are not
UTF-8 text, dry runs over missing inputs, and the messages that named the wrong thing.

Each case gave a traceback, ran silently, or said something untrue before its fix; each test
asserts the line a user now reads and that nothing was written."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.executor import LocalExecutor, default_workers
from tests import REPO
from tests.conftest import small_pipeline_config
from tests.pipeline.test_bad_input import small_disk  # noqa: F401  (a fixture)
from tests.reliability import (  # noqa: F401  (tiny_run is a fixture)
    WINDOW,
    arslice_argv,
    cli,
    final_files,
    run_subprocess,
    tiny_run,
    tmpfs,
)


def refused(capsys, *argv) -> str:
    """The one line `arslice ARGV` printed, with exit status 2 and no traceback."""
    capsys.readouterr()
    rc = cli(*map(str, argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def tag_argv(run: Path, out: Path, *extra) -> list:
    return ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", out,
            "--window", WINDOW, "--workers", "1", "--threshold", "4", *extra]  # fmt: skip


# ---- read-only run folders and mounts ----------------------------------------------------------


@pytest.fixture
def read_only(tmp_path):
    """`make(source)`: a copy of the folder `source` on a read-only tmpfs (what a read-only
    mount or an archived run is; root may mount one here, and it stops root's writes too,
    which `chmod` does not)."""
    mount = tmp_path / "ro"
    with tmpfs(mount, "64m") as remount:

        def make(*sources: Path) -> list[Path]:
            for source in sources:
                shutil.copytree(source, mount / source.name)
            remount("ro")
            return [mount / source.name for source in sources]

        yield make


def test_every_command_on_a_read_only_run_says_so_in_one_line(tiny_run, read_only, capsys):  # noqa: F811
    """report, tag, eval and `run` on a read-only mount ended in PermissionError / OSError
    tracebacks; a complete output there is still skipped, as a rerun of it is."""
    run, model = read_only(tiny_run["run"], tiny_run["model"])
    ro = f"({run} is on a read-only file system)"
    err = refused(capsys, "report", "--run", run, "--bootstrap", "0", "--passages", "0")
    assert err == (
        f"arslice report: error: {run / 'results.duckdb'} (missing): cannot be written {ro}; "
        "copy the run to a writable disk and use it there"
    )
    err = refused(capsys, *tag_argv(run, run / "tags2"))
    assert err == (
        f"arslice tag: error: {run / 'tags2'}: cannot be written {ro}; choose an output on a "
        "writable disk"
    )
    err = refused(capsys, "eval", "--model", f"native:{model}", "--tags", run / "tags",
                  "--out", run / "losses/other", "--device", "cpu")  # fmt: skip
    assert err.startswith(f"arslice eval: error: {run / 'losses/other'}: cannot be written (")
    config = run.parent.parent / "ro.toml"
    config.write_text(f'run_dir = "{run}"\n[tag]\nwindow = {WINDOW}\nthreshold = 4\n')
    err = refused(capsys, "run", "--config", config, "--stage", "tag")
    assert err == (
        f"arslice run: error: {config}: run_dir {run}: cannot be written {ro}; point run_dir "
        "elsewhere"
    )
    capsys.readouterr()
    assert cli(*tag_argv(run, run / "tags")) == 0  # complete: skipped, nothing to write
    assert "is complete" in capsys.readouterr().out


def test_query_and_open_run_on_a_moved_read_only_run(tiny_run, tmp_path, read_only, capsys):  # noqa: F811
    """A run reported where it was made, then moved onto a read-only disk: its results.duckdb
    names the old paths, so `query` and `open_run` must rebuild it, and cannot."""
    from ar_slicing import open_run

    made = tmp_path / "made" / "run"
    shutil.copytree(tiny_run["run"], made)
    assert cli("report", "--run", made, "--bootstrap", "0", "--passages", "0") == 0
    (run,) = read_only(made)
    line = (
        f"{run / 'results.duckdb'} (out of date with the run's files: a moved run?): cannot be "
        f"written ({run} is on a read-only file system); copy the run to a writable disk and "
        "use it there"
    )
    assert refused(capsys, "query", "slice_perplexity", "--run", run) == (
        f"arslice query: error: {line}"
    )
    with pytest.raises(ArSliceError) as err:
        open_run(run).table1()
    assert str(err.value) == line


def test_a_folder_this_user_may_not_write_is_refused_in_one_line(tiny_run, tmp_path, capsys):  # noqa: F811
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod does not stop root's writes (the read-only mount does)")
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run"], run)
    run.chmod(0o555)
    try:
        err = refused(capsys, *tag_argv(run, run / "tags2"))
    finally:
        run.chmod(0o755)
    assert f"{run / 'tags2'}: cannot be written ({run} is not writable by this user)" in err


# ---- a full disk while training ----------------------------------------------------------------


def train_argv(tokens: Path, out: Path) -> list:
    return ["train", "--arch", "attention", "--tokens", tokens, "--d-model", "64",
            "--n-layers", "2", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
            "--checkpoint-every", "2", "--warmup-steps", "1", "--eval-every", "0",
            "--device", "cpu", "--no-progress", "--out", out]  # fmt: skip


def test_a_full_disk_while_training_then_rerun(tiny_run, small_disk, tmp_path):  # noqa: F811
    """safetensors reported the full disk as its own SafetensorError (a traceback)."""
    mount, grow = small_disk
    tokens = tiny_run["run"] / "tokens/train"
    reference = tmp_path / "reference"
    assert cli(*train_argv(tokens, reference)) == 0
    out = mount / "model"
    done = run_subprocess(*train_argv(tokens, out))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "arslice train: error: the disk is full ([Errno 28] No space left on device" in (
        done.stderr
    )
    assert "rerun the same command" in done.stderr
    assert not (out / "meta.json").exists() and not final_files(out)
    grow()
    done = run_subprocess(*train_argv(tokens, out))
    assert done.returncode == 0, done.stderr
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


# ---- parts of the wrong schema -----------------------------------------------------------------


@pytest.mark.parametrize(
    "part", ["losses/attention/losses-00000.parquet", "tags/tags-00000.parquet"]
)
def test_verify_names_a_part_of_the_wrong_schema(tiny_run, tmp_path, capsys, part):  # noqa: F811
    """A losses part with other columns: ArrowInvalid "No match for FieldRef.Name(window_id)"."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run"], run)
    pq.write_table(pa.table({"a": [1, 2, 3]}), run / part)
    capsys.readouterr()
    assert cli("verify", "--run", run) == 2
    err = capsys.readouterr().err  # (verify lists every failed check, one a line)
    assert "Traceback" not in err and "1 check(s) failed:" in err, err
    stage, folder = (
        ("eval", run / "losses/attention") if "losses" in part else ("tag", run / "tags")
    )
    assert f"{run / part}: not a part its stage writes (no column window_id among a); rerun " in err
    assert f"`arslice {stage} ... --overwrite --out {folder}` to rewrite the folder" in err


# ---- hostile values ----------------------------------------------------------------------------


def limited(gib: int):
    """A subprocess's preexec_fn: at most `gib` GiB of address space (what a smaller machine,
    or a batch system's limit, leaves a stage)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))

    return limit


def test_a_window_longer_than_the_store_allocates_nothing_of_its_length(tiny_run, tmp_path):  # noqa: F811
    """--window 2000000000 allocated an 8 GB position ramp and a hash table for half a billion
    n-grams (MemoryError, or five minutes for 11k tokens): a window longer than the store holds
    the store, and tags it exactly as one window of the store's length."""
    run = tiny_run["run"]
    n_tokens = json.loads((run / "tokens/val/meta.json").read_text())["n_tokens"]
    whole = tmp_path / "whole"
    argv = ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--workers", "1"]
    assert cli(*argv, "--window", n_tokens, "--out", whole) == 0
    huge = tmp_path / "huge"
    done = run_subprocess(
        *argv, "--window", "2000000000", "--out", huge, preexec_fn=limited(4), timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert (huge / "tags-00000.parquet").read_bytes() == (whole / "tags-00000.parquet").read_bytes()


def test_a_window_whose_batches_exceed_memory_is_refused_with_the_estimate():
    """The check the tag stage makes before any work, under a 3 GiB address-space limit, for a
    store of a billion tokens tagged in one window."""
    code = (
        "from pipeline.tag import TagConfig, _require_memory\n"
        "_require_memory(TagConfig(tokens='t', counts='c', out='o', window=2_000_000_000, "
        "workers=2), 10**9)\n"
    )
    done = subprocess.run(
        [arslice_argv()[0], "-c", code], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=limited(3),
    )  # fmt: skip
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ar_slicing.errors.ArSliceError: --window 2000000000: tagging 2 batch(es) of "
        "999,999,999 targets at once needs about "
    ), last
    assert last.endswith(
        "GiB of memory, more than this process's address-space limit of 3.0 GiB; use a shorter "
        "--window (the paper's is 2048) or fewer --workers"
    ), last


def test_a_training_batch_beyond_memory_is_refused_with_the_estimate(tiny_run, tmp_path):  # noqa: F811
    """A batch of a billion rows ended in MemoryError after allocating GBs (here under a 4 GiB
    limit, so that a failure of this test cannot take the machine's memory)."""
    out = tmp_path / "model"
    done = run_subprocess("train", "--arch", "attention", "--tokens", tiny_run["run"] / "tokens/train",
                          "--batch-size", "1000000000", "--out", out, preexec_fn=limited(4))  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    err = done.stderr.strip()
    assert err.startswith(
        "arslice train: error: --batch-size 1000000000 of --seq-len 256: one training step needs "
        "about "
    ), err
    assert "PiB of memory, more than " in err and err.endswith("; lower --batch-size or --seq-len")
    assert not out.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_learning_rate_must_be_a_finite_positive_number(tiny_run, tmp_path, capsys, value):  # noqa: F811
    """`lr = nan` passed "must be positive" (every comparison with NaN is false)."""
    tokens = tiny_run["run"] / "tokens/train"
    err = refused(capsys, "train", "--arch", "attention", "--tokens", tokens, f"--lr={value}",
                  "--out", tmp_path / "m")  # fmt: skip
    assert err == f"arslice train: error: --lr {float(value)}: must be a finite number"
    err = refused(capsys, "train", "--arch", "attention", "--tokens", tokens, "--lr", "0",
                  "--out", tmp_path / "m")  # fmt: skip
    assert err == "arslice train: error: --lr 0.0: must be a finite positive number, such as 3e-4"
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path, train=f"lr = {value}"))
    err = refused(capsys, "run", "--config", cfg, "--dry-run")
    assert f"{cfg} [train.models.attention]: `lr = {float(value)}`: must be a finite number" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "m").exists()


def test_an_empty_glob_is_refused_naming_it(tiny_run, tmp_path, capsys):  # noqa: F811
    """`glob = ""`: ValueError "Unacceptable pattern" from pathlib."""
    line = (
        "glob '': empty, not a pattern of files inside a source folder; give one such as "
        "'*.txt' or '**/*.jsonl.zst'"
    )
    err = refused(capsys, "tokenize", "--source", tiny_run["src_val"], "--glob", "",
                  "--tokenizer", tiny_run["run"] / "tokens/train/tokenizer.json",
                  "--out", tmp_path / "store")  # fmt: skip
    assert err == f"arslice tokenize: error: {line}"
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path, tokenize='glob = ""'))
    err = refused(capsys, "run", "--config", cfg)
    assert f"{cfg} [tokenize.train]: {line}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_a_bootstrap_that_would_run_for_years_is_refused_with_the_estimate(tiny_run, tmp_path):  # noqa: F811
    """`--bootstrap 1e12` was accepted (and ran out of memory, here within a 4 GiB limit)."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run"], run)
    done = run_subprocess("report", "--run", run, "--bootstrap", "1000000000000",
                          preexec_fn=limited(4), timeout=300)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    err = done.stderr.strip()
    assert err.startswith(
        "arslice report: error: --bootstrap 1000000000000: resampling 175 windows of 1 model(s) "
        "would take about "
    ), err
    assert err.endswith(
        "here, more than the 24.0 h a run may take; lower --bootstrap (1000 resamples give 95% "
        "intervals to two digits)"
    ), err
    assert sorted(p.name for p in run.iterdir()) == ["counts", "losses", "tags", "tokens"]


def _pid(_task) -> int:
    return os.getpid()


def test_workers_are_capped_at_the_cpus_and_at_the_tasks(tiny_run, tmp_path, caplog):  # noqa: F811
    """`--workers 24` started 24 processes for one part."""
    cpus = default_workers()
    executor = LocalExecutor(cpus + 22)
    assert executor.workers == cpus
    assert f"--workers {cpus + 22}: this machine has {cpus} CPU(s); running {cpus} worker" in (
        caplog.text
    )
    for n_tasks in (1, 3):
        if cpus == 1:
            break  # (one CPU: every task runs here, with no process of its own)
        started = []
        for _task, _pid_of in LocalExecutor(cpus + 22).map_unordered(_pid, range(n_tasks)):
            started.append(len(multiprocessing.active_children()))
        assert max(started) <= min(n_tasks, cpus), (n_tasks, started)
    out = tmp_path / "store"
    done = run_subprocess("tokenize", "--source", tiny_run["src_val"], "--glob", "*.py",
                          "--tokenizer", tiny_run["run"] / "tokens/train/tokenizer.json",
                          "--workers", "64", "--out", out)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"--workers 64: this machine has {cpus} CPU(s); running {cpus} worker" in done.stderr


# ---- config files that are not UTF-8 text --------------------------------------------------------


@pytest.mark.parametrize(
    "encode,said",
    [
        (lambda t: t.encode("utf-16"), "UTF-16 text; save it as UTF-8"),
        (lambda t: t.encode("latin-1"), "not UTF-8 text (byte 0xe9 at line 1, column 4); save it"),
        (lambda t: Path("/bin/ls").read_bytes(), "a binary file (it holds NUL bytes), not text"),
    ],
    ids=["utf-16", "latin-1", "bin-ls"],
)
def test_a_config_file_that_is_not_utf8_text_is_named(tmp_path, capsys, encode, said):
    """UnicodeDecodeError tracebacks (`--config /bin/ls` too)."""
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(encode("# résumé\n" + small_pipeline_config(tmp_path)))
    err = refused(capsys, "run", "--config", cfg, "--dry-run")
    assert err.startswith(f"arslice run: error: pipeline config {cfg}: {said}"), err


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """A UTF-8 byte-order mark (Windows editors write one) was "Invalid statement"."""
    text = small_pipeline_config(tmp_path)
    plain, marked = tmp_path / "plain.toml", tmp_path / "marked.toml"
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    shown = []
    for cfg in (plain, marked):
        capsys.readouterr()
        assert cli("run", "--config", cfg, "--dry-run") == 0
        shown.append(capsys.readouterr().out)
    assert shown[0] == shown[1] and "TrainConfig" in shown[0]


def test_a_binary_config_json_in_a_model_folder_is_named(tiny_run, tmp_path, capsys):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_run["model"], model)
    (model / "config.json").write_bytes(Path("/bin/ls").read_bytes()[:4096])
    err = refused(capsys, "eval", "--model", f"native:{model}", "--tags", tiny_run["run"] / "tags",
                  "--out", tmp_path / "losses", "--device", "cpu")  # fmt: skip
    assert err == (
        f"arslice eval: error: JSON file {model / 'config.json'}: a binary file (it holds NUL "
        "bytes), not text"
    )


# ---- dry runs refuse missing inputs ----------------------------------------------------------------


def dry_runs(root: Path, tiny: dict) -> dict:
    gone = root / "gone"
    tags = tiny["run"] / "tags"
    return {
        "report": (["report", "--run", gone], f"--run {gone}: no such file or directory"),
        "verify": (["verify", "--run", gone], f"--run {gone}: no such file or directory"),
        "query": (["query", "slice_perplexity", "--run", gone],
                  f"--run {gone}: no such file or directory"),
        "train": (["train", "--arch", "attention", "--tokens", gone / "t", "--out", root / "m"],
                  f"--tokens {gone / 't'}: no such file or directory"),
        "tokenize": (["tokenize", "--source", tiny["src_val"], "--glob", "*.py", "--tokenizer",
                      gone / "tokenizer.json", "--out", root / "s"],
                     f"--tokenizer {gone / 'tokenizer.json'}: no such file or directory"),
        "eval": (["eval", "--model", f"native:{tiny['model']}", "--tags",
                  tags / "tags-00000.parquet", "--out", root / "l"],
                 f"--tags {tags / 'tags-00000.parquet'}: a file, not a folder; give the tags "
                 "folder"),
        "mqar": (["mqar", "--out", root / "a-file"],
                 f"--out {root / 'a-file'}: a file, not a folder; choose another output"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "command", ["report", "verify", "query", "train", "tokenize", "eval", "mqar"]
)
def test_a_dry_run_refuses_what_the_run_would(tiny_run, tmp_path, capsys, command):  # noqa: F811
    """These exited 0 on inputs a run then refused."""
    (tmp_path / "a-file").write_text("mine\n")
    argv, line = dry_runs(tmp_path, tiny_run)[command]
    err = refused(capsys, *argv, "--dry-run")
    assert err == f"arslice {command}: error: {line} (nothing was run)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# ---- messages that named the wrong thing -----------------------------------------------------------


def test_a_tags_part_given_as_the_tags_says_it_is_a_file(tiny_run, tmp_path, capsys):  # noqa: F811
    """It said "no such directory" of a file that is there."""
    part = tiny_run["run"] / "tags/tags-00000.parquet"
    err = refused(capsys, "eval", "--model", f"native:{tiny_run['model']}", "--tags", part,
                  "--out", tmp_path / "l", "--device", "cpu")  # fmt: skip
    assert err == (
        f"arslice eval: error: --tags {part}: a file, not a folder; give the tags folder "
        f"({part.parent}?)"
    )


@pytest.mark.parametrize(
    "value,said",
    [("0", '--batch-size 0: must be a positive integer or "auto"'),
     ("1.5", '`batch_size = 1.5` must be a positive integer or "auto"'),
     ('"many"', '--batch-size many: must be a positive integer or "auto"')],
)  # fmt: skip
def test_an_eval_batch_size_names_the_values_it_takes(tmp_path, capsys, value, said):
    """`[eval] batch_size = 0` said "must be a string"."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(small_pipeline_config(tmp_path, eval=f"batch_size = {value}"))
    capsys.readouterr()
    assert cli("run", "--config", cfg, "--dry-run") == 2
    err = capsys.readouterr().err  # (a line for each model's table it was found in)
    assert "Traceback" not in err
    assert f"{cfg} [eval.models.attention]: {said}\n" in err, err
    cfg.write_text(small_pipeline_config(tmp_path, eval="batch_size = 8"))
    capsys.readouterr()
    assert cli("run", "--config", cfg, "--dry-run") == 0  # an integer is taken as it is
    assert '"batch_size": "8"' in capsys.readouterr().out
