"""The ledger of parts under the stage plan: a part is done when the ledger records it and its
files are there whole; the ledger survives a kill; ownership follows what it records."""

from __future__ import annotations

import json
import shutil

import pytest

from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.ledger import Ledger
from ar_slicing.machinery.ownership import ForeignFiles
from ar_slicing.machinery.plan import PlanMismatch, StagePlan, open_stage
from tests.reliability import as_killed, cli, tiny_run  # noqa: F401  (a fixture)


def tag_plan(**scope) -> StagePlan:
    return StagePlan("tag", {"window": 8}, {"counts": "c" * 64}, scope=scope)


def write_part(out, index: int, payload: bytes = b"rows", stage=None) -> object:
    """A part's file, which `stage` expects first (as a stage does before it writes one);
    without `stage`, a file that no stage expected."""
    path = out / f"tags-{index:05d}.parquet"
    if stage is not None:
        stage.expect([path])
    path.write_bytes(payload)
    return path


def test_a_recorded_part_is_done_until_its_file_is_cut_short(tmp_path):
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with pytest.raises(KeyboardInterrupt), stage.running():
        stage.record("part 0", [write_part(out, 0, b"0123456789", stage)], rows=10)
        write_part(out, 1, stage=stage)  # written, killed before the driver recorded it
        raise KeyboardInterrupt
    again = open_stage(out, tag_plan())
    with again.running():
        assert again.done("part 0") == {"rows": 10}  # the facts it was recorded with
        assert again.done("part 1") is None  # in place, but never recorded
        (out / "tags-00000.parquet").write_bytes(b"01234")  # cut short
        assert again.done("part 0") is None
        (out / "tags-00000.parquet").unlink()
        assert again.done("part 0") is None
        assert [again.done(f"part {i}") for i in range(3)] == [None, None, None]


def test_a_torn_last_line_is_ignored_and_the_next_record_starts_a_line(tmp_path):
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with pytest.raises(KeyboardInterrupt), stage.running():
        stage.record("part 0", [write_part(out, 0, stage=stage)], rows=4)
        write_part(out, 1, stage=stage)
        raise KeyboardInterrupt
    ledger = out / ".ledger.jsonl"
    whole = ledger.read_text()
    record = json.dumps({"part": "part 1", "files": {"tags-00001.parquet": 4}, "facts": {}})
    ledger.write_text(whole + record[: len(record) // 2])  # a kill in the middle of a write
    again = open_stage(out, tag_plan())
    with again.running():
        assert again.done("part 0") == {"rows": 4} and again.done("part 1") is None
        again.record("part 1", [out / "tags-00001.parquet"], rows=4)
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [line["part"] for line in lines if "part" in line] == ["part 0", "part 1"]
    assert Ledger(out).done("part 1") == {"rows": 4}


def test_finishing_folds_the_ledger_into_meta_and_reopening_brings_it_back(tmp_path):
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with stage.running():
        stage.record("part 0", [write_part(out, 0, stage=stage)], rows=4)
        stage.expect([out / "windows.parquet"])
        (out / "windows.parquet").write_bytes(b"w")
        meta = stage.finish({"stage": "tag"})
    assert not (out / ".ledger.jsonl").exists() and not (out / ".plan.json").exists()
    assert meta["written"] == {"tags-00000.parquet": 4, "windows.parquet": 1}
    assert meta["ledger"] == {"part 0": {"files": {"tags-00000.parquet": 4}, "facts": {"rows": 4}}}
    as_killed(out)
    assert not (out / "meta.json").exists() and (out / ".plan.json").is_file()
    assert Ledger(out).done("part 0") == {"rows": 4}


def test_a_foreign_file_in_a_complete_output_is_refused_even_when_it_matches_the_layout(tmp_path):
    """`tags-*.parquet` is the tag stage's name, but a complete output owns exactly the files
    it recorded: a user's `tags-99999.parquet` dropped in is foreign, refused by name, and kept."""
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with stage.running():
        stage.record("part 0", [write_part(out, 0, stage=stage)], rows=4)
        stage.finish({"stage": "tag"})
    mine = write_part(out, 99999, b"a user's own table")
    for overwrite in (False, True):
        with pytest.raises(ForeignFiles, match="tags-99999.parquet, which the tag stage did not"):
            open_stage(out, tag_plan(), overwrite=overwrite)
    assert mine.read_bytes() == b"a user's own table" and (out / "tags-00000.parquet").exists()
    mine.unlink()
    assert open_stage(out, tag_plan()).complete


def test_in_an_unfinished_output_the_ledger_not_the_name_says_what_is_the_stages(tmp_path):
    """A worker may put a part in place before its driver records it: the files the stage
    expected are its own (kept, and removed by --overwrite), a file merely named like them that
    it never expected (a user's `tags-99999.parquet`, dropped in after a kill) is foreign,
    refused by name and never removed."""
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with pytest.raises(KeyboardInterrupt), stage.running():
        write_part(out, 7, stage=stage)  # expected and written, killed before its record
        raise KeyboardInterrupt
    mine = write_part(out, 99999, b"a user's own table")
    for overwrite in (False, True):
        with pytest.raises(ForeignFiles, match="tags-99999.parquet, which the tag stage did not"):
            open_stage(out, tag_plan(), overwrite=overwrite)
    assert mine.read_bytes() == b"a user's own table" and (out / "tags-00007.parquet").exists()
    mine.unlink()
    open_stage(out, tag_plan()).release()  # not refused
    with open_stage(out, tag_plan(), overwrite=True).running():
        assert not (out / "tags-00007.parquet").exists()


def test_an_unfinished_output_an_older_version_left_still_owns_its_layouts_names(tmp_path):
    """An older version's ledger never said what its stage expected, and its unfinished output
    owned the names of its layout: such a run, left by a kill, still resumes as its own."""
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan())
    with pytest.raises(KeyboardInterrupt), stage.running():
        stage.record("part 0", [write_part(out, 0, stage=stage)], rows=4)
        raise KeyboardInterrupt
    ledger = out / ".ledger.jsonl"  # as the older version wrote it: its records only
    ledger.write_text("".join(x for x in ledger.read_text().splitlines(True) if '"part"' in x))
    (out / "windows.parquet").write_bytes(b"w")  # put in place before the kill, unrecorded
    again = open_stage(out, tag_plan())
    with again.running():
        assert again.done("part 0") == {"rows": 4}
        again.expect([out / "windows.parquet"])  # (this version's stage writes it again)
        meta = again.finish({"stage": "tag"})
    assert meta["written"] == {"tags-00000.parquet": 4, "windows.parquet": 1}


def test_another_scope_reopens_a_complete_output_keeping_its_parts(tmp_path):
    out = tmp_path / "tags"
    stage = open_stage(out, tag_plan(cells=[1]))
    with stage.running():
        stage.record("part 1", [write_part(out, 1, stage=stage)], rows=4)
        first = stage.finish({"stage": "tag"})
    assert first["plan"]["scope"] == {"cells": [1]}
    assert open_stage(out, tag_plan(cells=[1])).complete
    grown = open_stage(out, tag_plan(cells=[1, 2]))  # more parts asked for: not refused
    assert not grown.complete
    with grown.running():
        assert not (out / "meta.json").exists()
        assert grown.done("part 1") == {"rows": 4} and grown.done("part 2") is None
        grown.record("part 2", [write_part(out, 2, stage=grown)], rows=4)
        meta = grown.finish({"stage": "tag"})
    assert sorted(meta["ledger"]) == ["part 1", "part 2"]
    other = StagePlan("tag", {"window": 16}, {"counts": "c" * 64}, scope={"cells": [1, 2]})
    with pytest.raises(PlanMismatch, match="settings.window: 8 -> 16") as err:
        open_stage(out, other)
    assert "scope." not in str(err.value) and "cells" not in str(err.value)


def test_a_plan_without_scope_keeps_the_digest_it_always_had():
    plan = StagePlan("tag", {"window": 8}, {"counts": "c"})
    assert plan.as_json() == {"stage": "tag", "settings": {"window": 8}, "inputs": {"counts": "c"}}


def test_the_tag_stage_redoes_only_a_part_cut_short(tiny_run, tmp_path):  # noqa: F811
    """Through the real stage: a killed run's part cut short after it was recorded is tagged
    again, the others are kept, and the output is the uninterrupted one."""
    run = tiny_run["run"]
    out = tmp_path / "tags"
    argv = ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", out,
            "--window", "64", "--workers", "1", "--threshold", "4", "--part-tokens", "256"]  # fmt: skip
    assert cli(*argv) == 0
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    first = as_killed(out)
    parts = first["parts"]
    assert len(parts) > 3
    cut = out / parts[1]
    cut.write_bytes(cut.read_bytes()[:-1])  # the same name, one byte short
    kept = {p: (out / p).stat().st_mtime_ns for p in parts if p != parts[1]}
    assert cli(*argv) == 0
    meta = read_json(out / "meta.json")
    assert meta["skipped"] == {"parts_already_complete": len(parts) - 1}
    assert {p: (out / p).stat().st_mtime_ns for p in kept} == kept
    for name in [*parts, "windows.parquet"]:
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert meta["written"] == read_json(reference / "meta.json")["written"]


def test_a_users_table_named_like_a_part_is_never_removed(tiny_run, tmp_path, capsys):  # noqa: F811
    """The tag stage's glob once owned any `tags-*.parquet`: `--overwrite` of a complete output
    removed a user's `tags-99999.parquet` with the stage's own parts."""
    run = tiny_run["run"]
    tags = tmp_path / "tags"
    shutil.copytree(run / "tags", tags)
    mine = tags / "tags-99999.parquet"
    mine.write_bytes(b"a table of my own")
    argv = ["tag", "--tokens", run / "tokens/val", "--counts", run / "counts", "--out", tags,
            "--window", "64", "--workers", "1", "--threshold", "4"]  # fmt: skip
    for flags in ((), ("--overwrite",)):
        capsys.readouterr()
        assert cli(*argv, *flags) == 2
        assert f"holds {mine}, which the tag stage did not write" in capsys.readouterr().err
    assert mine.read_bytes() == b"a table of my own"
