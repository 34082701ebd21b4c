"""What a user owns is never taken, moved or deleted: a stage's files are the ones its ledger
records or expects, file by file, never a file merely named like them; a model's name from a
config is a plain folder name; nothing is written through a link among a stage's own names; a
kill after meta.json leaves nothing for ever; `report` checks report/ before any write.

Each test is a way a user's file was adopted, removed or written through, and fails on the
code before that was fixed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import STAGE_FILES, STAGE_WORK
from ar_slicing.machinery.ownership import ForeignFiles, layout_folders
from ar_slicing.machinery.plan import StagePlan, open_stage
from tests.ar_slicing.test_ownership_and_locks import own_run, tree  # noqa: F401  (a fixture)
from tests.conftest import small_pipeline_config
from tests.reliability import (  # noqa: F401  (tiny_run is a fixture)
    WINDOW,
    as_killed,
    cli,
    kill_when,
    run_subprocess,
    tiny_run,
)


def tag_argv(run: Path, out: Path, *extra) -> list:
    return ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", out,
            "--window", WINDOW, "--workers", "1", "--threshold", "4", "--part-tokens", "256",
            *extra]  # fmt: skip


def eval_argv(run: Path, model: Path, out: Path, *extra) -> list:
    return ["eval", "--model", f"native:{model}", "--tags", run / "tags", "--out", out,
            "--device", "cpu", "--batch-size", "16", "--chunk-windows", "16", *extra]  # fmt: skip


def kept(folder: Path) -> dict[str, bytes]:
    """`tree(folder)` without the lock file (the pid a killed writer left in it, which is no
    one's data: the next writer takes the lock and removes it when done)."""
    return {rel: data for rel, data in tree(folder).items() if not rel.endswith(".arslice.lock")}


def refused_naming(capsys, argv, path: Path, *words: str) -> str:
    """Run `arslice ARGV`: refused (status 2) in one line naming `path` and `words`."""
    capsys.readouterr()
    assert cli(*argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def drop_records(out: Path) -> int:
    """Forget every part the ledger of the unfinished `out` records, keeping what it expects:
    the files are in place under their final names, unrecorded, as a kill between a part's
    rename and its record leaves them. Returns how many records were dropped."""
    ledger = out / ".ledger.jsonl"
    lines = ledger.read_text().splitlines(keepends=True)
    kept = [line for line in lines if "part" not in json.loads(line)]
    ledger.write_text("".join(kept))
    return len(lines) - len(kept)


# ---- a file named like the stage's own, in an unfinished output ---------------------------------


def test_a_users_part_in_an_unfinished_tags_output_is_never_adopted(own_run, tmp_path, capsys):  # noqa: F811
    """`tags-99999.parquet` (a real table of the user's) dropped into tags a kill left
    unfinished was adopted by the resume (listed in meta.json `written`) and removed by
    --overwrite: the name matched the layout's `tags-*.parquet`."""
    run = own_run["run"]
    out = tmp_path / "tags"
    killed, stderr = kill_when(tag_argv(run, out), lambda: any(out.glob("tags-*.parquet")))
    assert killed and not (out / "meta.json").exists(), stderr
    mine = out / "tags-99999.parquet"
    shutil.copyfile(run / "tags/tags-00000.parquet", mine)
    before = kept(out)
    for flags in ((), ("--overwrite",)):
        refused_naming(
            capsys,
            tag_argv(run, out, *flags),
            mine,
            "which the tag stage did not write (named like its tags-*.parquet, but not among "
            "the files its ledger records)",
            "Nothing was changed",
        )
        assert kept(out) == before  # the user's table and the stage's parts as they were
    moved = tmp_path / "mine.parquet"
    mine.rename(moved)
    assert cli(*tag_argv(run, out)) == 0
    assert "tags-99999.parquet" not in read_json(out / "meta.json")["written"]
    assert (
        not mine.exists() and moved.read_bytes() == (run / "tags/tags-00000.parquet").read_bytes()
    )


def test_a_users_losses_part_in_an_unfinished_evaluation_is_refused(own_run, capsys):  # noqa: F811
    run, model = own_run["run"], own_run["model"]
    out = run / "losses/attention"
    as_killed(out)  # every chunk recorded, meta.json not yet written
    mine = out / "losses-99999.parquet"
    shutil.copyfile(out / "losses-00000.parquet", mine)
    before = kept(out)
    for flags in ((), ("--overwrite",)):
        refused_naming(capsys, eval_argv(run, model, out, *flags), mine, "losses-*.parquet")
        assert kept(out) == before
    mine.unlink()
    assert cli(*eval_argv(run, model, out)) == 0
    assert sorted(read_json(out / "meta.json")["written"]) == sorted(
        p.name for p in out.glob("losses-*.parquet")
    )


def test_parts_in_place_but_never_recorded_are_the_stages_own(own_run, tmp_path):  # noqa: F811
    """The kill window between a part's rename into place and its record: the stage expected
    the part (its ledger says so before any part is written), so the resume takes the file as
    its own and rewrites it; the output is the uninterrupted one."""
    run = own_run["run"]
    reference = tmp_path / "reference"
    assert cli(*tag_argv(run, reference)) == 0
    out = tmp_path / "tags"
    killed, stderr = kill_when(tag_argv(run, out), lambda: len(list(out.glob("tags-*"))) >= 2)
    assert killed, stderr
    assert drop_records(out) >= 1
    unrecorded = sorted(p.name for p in out.glob("tags-*.parquet"))
    assert unrecorded  # under final names, and no record of them
    assert cli(*tag_argv(run, out)) == 0
    assert read_json(out / "meta.json")["written"] == read_json(reference / "meta.json")["written"]
    for name in read_json(reference / "meta.json")["written"]:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


# ---- model names are plain folder names --------------------------------------------------------


@pytest.mark.parametrize(
    "table,name,shown",
    [
        ("eval", "../../../escaped", '"../../../escaped"'),
        ("eval", "/tmp/abs-model", '"/tmp/abs-model"'),
        ("train", "../x", '"../x"'),
        ("train", "a/b", '"a/b"'),
        ("eval", "..", '".."'),
        ("eval", "", '""'),
        ("train", ".hidden", '".hidden"'),
        ("eval", "pythia@step5", '"pythia@step5"'),
        ("train", "tab\tname", '"tab\\tname"'),
    ],
)
def test_a_model_name_that_is_not_a_plain_folder_name_is_refused(
    tmp_path, capsys, table, name, shown
):
    """`[eval.models."../../../escaped"]` wrote losses outside run_dir (status 0)."""
    cfg = tmp_path / "c.toml"
    model = {"eval": 'model = "native:{}"'.format(tmp_path / "m"), "train": 'arch = "attention"'}
    key = json.dumps(name)
    cfg.write_text(small_pipeline_config(tmp_path) + f"\n[{table}.models.{key}]\n{model[table]}\n")
    capsys.readouterr()
    assert cli("run", "--config", cfg, "--stage", "tokenizer") == 2
    err = capsys.readouterr().err
    assert err == (
        f"arslice run: error: {cfg} [{table}.models.{shown}]: a model's name must be a plain "
        "folder name (it names models/<name> and losses/<name>): letters, digits, '.', '_' and "
        "'-', starting with a letter or digit, at most 128 characters\n"
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # nothing written anywhere


# ---- nothing is written through a link -----------------------------------------------------------


def test_a_count_whose_work_folder_is_a_link_writes_nothing_there(own_run, tmp_path, capsys):  # noqa: F811
    """`.work` replaced by a link: the count wrote its partials into the link's target."""
    run = own_run["run"]
    out = tmp_path / "counts"
    argv = ["count", "--tokens", run / "tokens/train", "--out", out, "--workers", "1",
            "--shard-tokens", "2000"]  # fmt: skip
    killed, stderr = kill_when(argv, lambda: any(out.glob(".work/partials/*.bin")))
    assert killed, stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(out / ".work")
    (out / ".work").symlink_to(elsewhere)
    before = kept(out)
    for flags in ((), ("--overwrite",)):
        refused_naming(
            capsys,
            [*argv, *flags],
            out / ".work",
            f"a link (to {elsewhere}) where the count stage keeps its own files",
        )
        assert not any(elsewhere.iterdir()) and kept(out) == before
    (out / ".work").unlink()
    (out / ".work").write_text("not a folder")
    refused_naming(capsys, argv, out / ".work", "a file where the count stage keeps its own")
    (out / ".work").unlink()
    assert cli(*argv) == 0
    assert (out / "bigrams.parquet").read_bytes() == (run / "counts/bigrams.parquet").read_bytes()


@pytest.mark.parametrize(
    "stage,folder",
    [(stage, folder) for stage in STAGE_FILES for folder in layout_folders(stage)],
)
def test_every_folder_a_stage_keeps_as_a_link_or_a_file_is_refused(tmp_path, stage, folder):
    """The one check every stage's output goes through (`StageDir`), for each folder a stage
    keeps inside its output (`.parts`, `.work`, `.train-state`, `checkpoints`, `cells`)."""
    assert set(STAGE_WORK.values()) <= {f for s in STAGE_FILES for f in layout_folders(s)}
    plan = StagePlan(stage, {"x": 1}, {})
    out = tmp_path / "out"
    stage_dir = open_stage(out, plan)
    with pytest.raises(KeyboardInterrupt), stage_dir.running():  # killed with a file in it
        stage_dir.expect([out / folder / "a"])
        (out / folder).mkdir(parents=True)
        (out / folder / "a").write_text("work")
        raise KeyboardInterrupt
    elsewhere = tmp_path / "elsewhere"
    (out / folder).rename(elsewhere)
    (out / folder).symlink_to(elsewhere)
    with pytest.raises(ForeignFiles, match=f"holds {out / folder}, a link \\(to {elsewhere}\\)"):
        open_stage(out, plan)
    (out / folder).unlink()
    (out / folder).write_text("x")
    with pytest.raises(ForeignFiles, match=f"holds {out / folder}, a file where the {stage}"):
        open_stage(out, plan, overwrite=True)
    assert (out / folder).read_text() == "x" and (elsewhere / "a").read_text() == "work"


# ---- a kill just after meta.json -----------------------------------------------------------------


def count_argv(tiny: dict, out: Path) -> list:
    return ["count", "--tokens", tiny["run"] / "tokens/train", "--out", out, "--workers", "1",
            "--shard-tokens", "2000"]  # fmt: skip


def tokenize_argv(tiny: dict, out: Path) -> list:
    return ["tokenize", "--source", tiny["src_train"], "--glob", "*.py", "--tokenizer",
            tiny["run"] / "tokens/train/tokenizer.json", "--workers", "1", "--shard-docs", "1",
            "--out", out]  # fmt: skip


def train_argv(tiny: dict, out: Path) -> list:
    return ["train", "--arch", "attention", "--tokens", tiny["run"] / "tokens/train",
            "--d-model", "16", "--n-layers", "1", "--seq-len", "32", "--batch-size", "4",
            "--steps", "12", "--warmup-steps", "1", "--eval-every", "0", "--checkpoint-every", "2",
            "--device", "cpu", "--no-progress", "--out", out]  # fmt: skip


# (the stage's command, the folder of its unfinished work, files whose first one says the
# killed run got far enough)
LEFT_BY_A_KILL = {
    "count": (count_argv, ".work", "*.bin"),
    "tokenize": (tokenize_argv, ".parts", "*.parquet"),
    "train": (train_argv, ".train-state", "*.safetensors"),
    "tag": (lambda tiny, out: tag_argv(tiny["run"], out), None, "tags-*.parquet"),
}


@pytest.mark.parametrize("stage", LEFT_BY_A_KILL)
def test_the_scratch_a_kill_after_meta_json_left_is_removed_by_the_rerun(tiny_run, tmp_path, stage):  # noqa: F811
    """A kill between meta.json and the stage dropping its plan, ledger and folder of
    unfinished work (`StageDir.finish`) left them for ever: the rerun said "complete" and kept
    them (count's `.work` 42 MB beside a 304 KB output). Made deterministically: the state a kill
    mid-run leaves (the same stage's own scratch), put back beside the finished output."""
    argv_of, scratch, progress = LEFT_BY_A_KILL[stage]
    out = tmp_path / "out"
    argv = argv_of(tiny_run, out)
    ledger = out / ".ledger.jsonl"
    killed, stderr = kill_when(argv, lambda: ledger.is_file() and any(out.glob(f"**/{progress}")))
    assert killed, stderr
    left = tmp_path / "left"
    left.mkdir()
    names = [".plan.json", ".ledger.jsonl", *([scratch] if scratch else [])]
    for name in names:  # the running stage's own, as a kill left them
        if (out / name).is_dir():
            shutil.copytree(out / name, left / name)
        else:
            shutil.copyfile(out / name, left / name)
    assert cli(*argv) == 0
    finished = kept(out)
    for name in names:  # and as a kill after meta.json leaves them, beside the finished output
        (left / name).rename(out / name)
    done = run_subprocess(*argv)
    assert done.returncode == 0, done.stderr
    shown = ", ".join(n + ("/" if n == scratch else "") for n in names)
    assert f"{out}: removed {shown}, left by a run killed after it wrote meta.json" in done.stderr
    assert kept(out) == finished  # the output as it was, only the leftovers gone


# ---- report checks report/ before it writes anything ------------------------------------------


def test_report_refuses_a_foreign_file_before_it_rebuilds_results_duckdb(own_run, capsys):  # noqa: F811
    """`report` rewrote results.duckdb, then refused report/draft.md, saying "Nothing was
    changed"."""
    run = own_run["run"]
    argv = ["report", "--run", run, "--bootstrap", "0", "--passages", "0"]
    assert cli(*argv) == 0
    results = run / "results.duckdb"
    results.unlink()  # out of date: a report would rebuild it first
    (run / "report/draft.md").write_text("my notes\n")
    before = kept(run)
    refused_naming(capsys, argv, run / "report/draft.md", "Nothing was changed")
    assert kept(run) == before and not results.exists()


@pytest.mark.parametrize("reopened", [False, True])
def test_an_output_named_by_a_relative_path_owns_what_it_expected(tmp_path, monkeypatch, reopened):
    """A run_dir written relative to the working directory (the README's `runs/demo`): the
    files a stage said it would write are its own in meta.json's `written`, not missed (which
    made the next stage refuse them as a user's), also after the output is reopened."""
    monkeypatch.chdir(tmp_path)
    plan = StagePlan("tokenize", {"x": 1}, {})
    out = Path("runs/demo/tokens/train")
    stage_dir = open_stage(out, plan)
    with stage_dir.running():
        stage_dir.expect(out / name for name in ("tokens.bin", "docs.parquet"))
        (out / "tokens.bin").write_bytes(b"1234")
        (out / "docs.parquet").write_bytes(b"12")
        meta = stage_dir.finish({"stage": "tokenize"})
    assert meta["written"] == {"docs.parquet": 2, "tokens.bin": 4}
    if reopened:
        stage_dir = open_stage(out, plan)
        stage_dir.reopen()
        with stage_dir.running():
            meta = stage_dir.finish({"stage": "tokenize"})
        assert meta["written"] == {"docs.parquet": 2, "tokens.bin": 4}
