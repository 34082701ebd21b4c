"""ar_slicing.machinery.plan: one rule for every stage's output, and the atomic writes it relies on."""

from __future__ import annotations

import os

import pytest

from ar_slicing.machinery.io import atomic_dir, read_json, sweep_temporaries, write_json_atomic
from ar_slicing.machinery.ownership import ForeignFiles
from ar_slicing.machinery.plan import (
    PlanMismatch,
    StagePlan,
    differences,
    open_stage,
    recorded_plan,
    redoing_changed,
)

PART = "tags-00000.parquet"  # a file the tag stage writes (ar_slicing.machinery.layout.STAGE_FILES)


def plan(**settings) -> StagePlan:
    return StagePlan(
        "tag", settings={"window": 8, "threshold": 2, **settings}, inputs={"counts": "c" * 64}
    )


def finish(out, p: StagePlan, payload: str = "data") -> dict:
    stage = open_stage(out, p)
    with stage.running():
        stage.expect([out / PART])  # (what a stage says before it writes a file)
        (out / PART).write_text(payload)
        return stage.finish({"stage": "tag"})


def test_same_plan_skips_and_touches_the_meta_only(tmp_path):
    out = tmp_path / "tags"
    meta = finish(out, plan())
    assert meta["plan"]["settings"]["threshold"] == 2 and not (out / ".plan.json").exists()
    before = (out / "meta.json").read_bytes()
    os.utime(out / "meta.json", ns=(1, 1))
    stage = open_stage(out, plan())
    assert stage.complete and stage.skip() == read_json(out / "meta.json")
    assert (out / "meta.json").read_bytes() == before
    assert (out / "meta.json").stat().st_mtime_ns > 1  # make sees it up to date


def test_another_plan_is_refused_naming_every_field_and_touching_nothing(tmp_path):
    out = tmp_path / "tags"
    finish(out, plan())
    with pytest.raises(PlanMismatch) as err:
        open_stage(out, StagePlan("tag", {"window": 16, "threshold": 2}, {"counts": "d" * 64}))
    text = str(err.value)
    assert (
        "settings.window: 8 -> 16" in text
        and "inputs.counts: cccccccccccc… -> dddddddddddd…" in text
    )
    assert "threshold" not in text and "--overwrite" in text
    assert (out / PART).read_text() == "data"


def test_overwrite_redoes_even_the_same_plan(tmp_path):
    out = tmp_path / "tags"
    finish(out, plan())
    stage = open_stage(out, plan(), overwrite=True)
    assert not stage.complete
    with stage.running():
        assert not (out / PART).exists()  # cleared before the stage writes again
        stage.finish({})


def test_unfinished_run_resumes_under_its_plan_only(tmp_path):
    out = tmp_path / "tags"
    stage = open_stage(out, plan())
    with pytest.raises(KeyboardInterrupt):
        with stage.running():
            stage.expect([out / PART])
            (out / PART).write_text("done")
            raise KeyboardInterrupt
    assert (out / ".plan.json").is_file() and (out / PART).is_file()  # work kept
    again = open_stage(out, plan())
    assert not again.complete
    with again.running():
        assert (out / PART).read_text() == "done"  # resumed, not cleared
    with pytest.raises(PlanMismatch, match="unfinished run(?s:.*)settings.threshold: 2 -> 3"):
        open_stage(out, plan(threshold=3))


def test_an_early_failure_leaves_no_directory(tmp_path):
    out = tmp_path / "new"
    stage = open_stage(out, plan())
    with pytest.raises(ValueError):
        with stage.running():
            raise ValueError("bad input found before any work")
    assert not out.exists()


def test_a_directory_of_other_files_is_never_taken_over(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not the stage's")
    with pytest.raises(ForeignFiles, match="did not write"):
        open_stage(out, plan())
    with redoing_changed(), pytest.raises(ForeignFiles, match="did not write"):
        open_stage(out, plan())  # redoing what changed is not a licence to delete others' files
    assert (out / "notes.txt").exists()


def test_redoing_changed_redoes_a_changed_plan_and_still_skips_a_same_one(tmp_path):
    out = tmp_path / "tags"
    finish(out, plan())
    with redoing_changed():
        assert open_stage(out, plan()).complete
        stage = open_stage(out, plan(threshold=5))
        assert not stage.complete
    with pytest.raises(PlanMismatch):  # only inside the context
        open_stage(out, plan(threshold=5))


def test_follow_inputs_rebuilds_on_new_inputs_but_refuses_new_settings(tmp_path):
    out = tmp_path / "report"
    finish(out, plan())
    newer = StagePlan("tag", plan().settings, {"counts": "e" * 64})
    assert not open_stage(out, newer, follow_inputs=True).complete
    with pytest.raises(PlanMismatch, match="settings.threshold"):
        open_stage(out, plan(threshold=9), follow_inputs=True)


def test_an_output_without_a_recorded_plan_is_refused_as_older(tmp_path):
    out = tmp_path / "tags"
    out.mkdir()
    write_json_atomic(out / "meta.json", {"stage": "tag"})  # written before plans existed
    with pytest.raises(PlanMismatch, match="older version"):
        open_stage(out, plan())
    assert recorded_plan(out) == {}


def test_single_file_outputs_keep_their_meta_beside_them(tmp_path):
    out = tmp_path / "tokenizer.json"
    stage = open_stage(out, plan(), single_file=True)
    with stage.running():
        out.write_text("{}")
        stage.finish({})
    assert (tmp_path / "tokenizer.meta.json").is_file()
    assert open_stage(out, plan(), single_file=True).complete
    assert recorded_plan(out, single_file=True)["settings"]["window"] == 8
    with pytest.raises(PlanMismatch):
        open_stage(out, plan(window=4), single_file=True)
    out.unlink()  # the file gone: not complete, whatever its meta says
    assert not open_stage(out, plan(), single_file=True).complete


def test_differences_flatten_nested_fields():
    assert differences({"a": {"b": 1, "c": [1]}}, {"a": {"b": 2, "c": [1]}, "d": None}) == [
        "a.b: 1 -> 2",
        "d: (absent) -> null",
    ]


def test_atomic_dir_replaces_whole_and_a_kill_between_renames_is_undone(tmp_path):
    state = tmp_path / ".state"
    with atomic_dir(state) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(state) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("killed while writing")
    assert (state / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == [
        ".state"
    ]
    # a kill after the old directory was moved aside and before the new one was renamed in
    state.rename(tmp_path / "..state.old.tmp")
    (tmp_path / f"..state.{os.getpid()}.tmp").mkdir()
    assert sweep_temporaries(tmp_path) == 1
    assert (state / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".state"]


def test_sweep_removes_every_temporary_below_and_nothing_else(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".x.parquet.123.tmp").write_text("half")
    (tmp_path / "sub" / ".y.bin.9.tmp").write_text("half")
    (tmp_path / "keep.tmp").write_text("a user's file")  # not one of ours: no leading dot
    (tmp_path / "final.parquet").write_text("done")
    assert sweep_temporaries(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["final.parquet", "keep.tmp", "sub"]


def test_sweep_removes_what_duckdb_leaves_beside_a_temporary(tmp_path):
    """DuckDB writes `<db>.wal` and spills to `<db>.tmp/` beside a database being built under a
    temporary name: they are temporaries too. A user's `notes.tmp.wal` is not."""
    (tmp_path / ".results.duckdb.77.tmp.wal").write_text("log")
    (tmp_path / ".results.duckdb.77.tmp.tmp").mkdir()
    (tmp_path / ".results.duckdb.77.tmp.tmp" / "spill.block").write_text("spilled")
    (tmp_path / "notes.tmp.wal").write_text("a user's file")
    (tmp_path / ".config").write_text("a user's file")
    assert sweep_temporaries(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".config", "notes.tmp.wal"]
