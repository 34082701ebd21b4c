"""The one way a stage runs (`pipeline.stage.run_stage`) and does its parts (`run_parts`): a
skip in the one wording, checks that fail before the output is made leave nothing behind, a
partial output reopened when asked for more, and a rerun after a kill doing only the parts left."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from ar_slicing.machinery.io import read_json, write_json_atomic
from ar_slicing.machinery.ownership import lock_path
from ar_slicing.machinery.plan import PlanMismatch, StagePlan
from ar_slicing.machinery.plan.stage_parts import StageParts
from pipeline.config import SUMMARY_LOGGER
from pipeline.stage import Finished, Part, run_parts, run_stage


def plan(scale: int = 1) -> StagePlan:
    return StagePlan("toy", {"scale": scale}, {"tags": "t" * 64})


def make_parts(out, names=("a", "b", "c")) -> list[Part]:
    return [Part(name, (out / f"{name}.json",)) for name in names]


def toy_work(done: list[str], fail_at: str | None = None):
    """A stage's work: each part writes its file (a failure at `fail_at`, as a kill would),
    then meta.json with the parts' facts."""

    def do(part: Part) -> dict:
        if part.name == fail_at:
            raise KeyboardInterrupt
        write_json_atomic(part.files[0], {"part": part.name})
        done.append(part.name)
        return {"rows": len(done)}

    def work(stage, prepared):
        facts = run_parts(stage, make_parts(stage.out), do)
        return Finished({"stage": "toy", "facts": facts, "prepared": prepared})

    return work


def test_a_complete_output_is_skipped_in_the_one_wording(tmp_path, caplog):
    out = tmp_path / "toy"
    done: list[str] = []
    meta = run_stage("toy", out, plan(), toy_work(done), overwrite=False, prepare=lambda: 7)
    assert done == ["a", "b", "c"] and meta["prepared"] == 7
    prepared = []
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        again = run_stage(
            "toy model-x",
            out,
            plan(),
            toy_work(done),
            overwrite=False,
            prepare=lambda: prepared.append(1),
            detail=lambda meta: f"{len(meta['facts'])} parts",
            skipped=lambda meta: {"skipped": True, "facts": meta["facts"]},
        )
    assert again == {"skipped": True, "facts": meta["facts"]}
    assert done == ["a", "b", "c"] and prepared == []  # no work, and nothing prepared
    assert caplog.messages == [
        f"toy model-x: {out} is complete (3 parts); skipped (--overwrite to redo)"
    ]
    # other settings are refused, naming them; --overwrite redoes every part
    with pytest.raises(PlanMismatch, match=r"settings.scale: 1 -> 2"):
        run_stage("toy", out, plan(2), toy_work(done), overwrite=False)
    run_stage("toy", out, plan(2), toy_work(done), overwrite=True)
    assert done == ["a", "b", "c"] * 2


def test_a_quiet_skip_only_logs_the_same_line(tmp_path, caplog):
    out = tmp_path / "toy"
    run_stage("toy", out, plan(), toy_work([]), overwrite=False)
    with caplog.at_level(logging.DEBUG):
        run_stage("toy", out, plan(), toy_work([]), overwrite=False, quiet=True)
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    line = f"toy: {out} is complete; skipped (--overwrite to redo)"
    assert said == [("pipeline.stage", logging.DEBUG, line)]  # not the summary logger's


def test_checks_that_fail_before_the_work_leave_nothing_and_release_the_lock(tmp_path):
    out = tmp_path / "toy"

    def bad_model():
        raise ValueError("the model does not fit")

    with pytest.raises(ValueError, match="does not fit"):
        run_stage("toy", out, plan(), toy_work([]), overwrite=False, prepare=bad_model)
    assert not out.exists()
    # an unfinished output of the same plan: kept as it was, its lock released
    with pytest.raises(KeyboardInterrupt):
        run_stage("toy", out, plan(), toy_work([], fail_at="b"), overwrite=False)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="does not fit"):
        run_stage("toy", out, plan(), toy_work([]), overwrite=False, prepare=bad_model)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not lock_path(out).exists() or _unlocked(out)


def _unlocked(out) -> bool:
    """Whether another writer can take the output's lock now."""
    import fcntl

    with open(lock_path(out), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_a_rerun_after_a_kill_does_only_the_parts_left(tmp_path):
    out = tmp_path / "toy"
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_stage("toy", out, plan(), toy_work(done, fail_at="c"), overwrite=False)
    assert done == ["a", "b"] and not (out / "meta.json").exists()
    meta = run_stage("toy", out, plan(), toy_work(done), overwrite=False)
    assert done == ["a", "b", "c"]  # a and b were not done again
    # the facts of the parts done before the kill come back from the ledger
    assert meta["facts"] == {"a": {"rows": 1}, "b": {"rows": 2}, "c": {"rows": 3}}
    assert set(read_json(out / "meta.json")["written"]) == {"a.json", "b.json", "c.json"}


def test_a_complete_output_asked_for_more_is_reopened_its_parts_kept(tmp_path):
    out = tmp_path / "toy"
    done: list[str] = []

    def partial_work(stage, _):
        facts = run_parts(stage, make_parts(stage.out, ["a"]), lambda p: _write(p, done))
        return Finished({"partial": True, "facts": facts})

    run_stage("toy", out, plan(), partial_work, overwrite=False)
    more = lambda meta: bool(meta.get("partial"))  # noqa: E731
    meta = run_stage("toy", out, plan(), toy_work(done), overwrite=False, reopen_if=more)
    assert done == ["a", "b", "c"]  # part a kept from the partial output
    assert "partial" not in meta and sorted(meta["facts"]) == ["a", "b", "c"]


def _write(part: Part, done: list[str]) -> dict:
    write_json_atomic(part.files[0], {"part": part.name})
    done.append(part.name)
    return {"rows": len(done)}


def write_square(n: int, path: str, run: int) -> dict:
    """A worker's part (module level: worker processes import it): n² to `path`; n == 0 fails
    after the others are done, as a worker whose input is bad would."""
    if n == 0:
        time.sleep(1.0)
        raise ValueError("no part 0")
    write_json_atomic(Path(path), {"square": n * n})
    return {"square": n * n, "run": run, "pid": os.getpid()}


def square_task(task: tuple[int, str, int]) -> dict:
    return write_square(*task)


def test_parts_done_by_worker_processes_are_recorded_by_the_driver_and_resumed(tmp_path):
    from ar_slicing.machinery.executor import LocalExecutor

    out = tmp_path / "toy"

    def work(numbers, run, seen):
        def do(stage, _):
            paths = {n: stage.out / f"{n}.json" for n in numbers}
            parts = StageParts(
                stage, [Part(f"n{n}", (p,), (n, str(p), run)) for n, p in paths.items()]
            )
            seen.append(sorted(parts.facts))
            for part, facts in parts.run(square_task, LocalExecutor(2)):
                assert stage.done(part.name) == facts  # recorded before it is handed on
            return Finished({"facts": parts.in_order()})

        return do

    seen: list = []
    with pytest.raises(ValueError, match="no part 0"):
        run_stage("toy", out, plan(), work([1, 2, 3, 0], 1, seen), overwrite=False)
    assert not (out / "meta.json").exists()
    meta = run_stage("toy", out, plan(), work([1, 2, 3, 4], 2, seen), overwrite=False)
    assert seen == [[], ["n1", "n2", "n3"]]  # the parts done before the failure are kept
    facts = meta["facts"]
    assert list(facts) == ["n1", "n2", "n3", "n4"]  # in the parts' order
    assert [f["square"] for f in facts.values()] == [1, 4, 9, 16]
    assert [f["run"] for f in facts.values()] == [1, 1, 1, 2]  # only the part left is done
    assert os.getpid() not in {f["pid"] for f in facts.values()}  # by worker processes
    assert set(read_json(out / "meta.json")["written"]) == {"1.json", "2.json", "3.json", "4.json"}


def test_record_each_keeps_the_facts_asked_for(tmp_path):
    out = tmp_path / "toy"

    def run(stage, _):
        parts = StageParts(stage, make_parts(stage.out, ["a", "b"]))
        results = ((part, {"rows": 3, "seconds": 0.5}) for part in parts.todo)
        for part in parts.todo:
            write_json_atomic(part.files[0], {})
        passed = list(parts.record_each(results, lambda r: {"rows": r["rows"]}))
        assert [r for _, r in passed] == [{"rows": 3, "seconds": 0.5}] * 2  # yielded whole
        return Finished({"facts": parts.in_order()})

    meta = run_stage("toy", out, plan(), run, overwrite=False)
    assert meta["facts"] == {"a": {"rows": 3}, "b": {"rows": 3}}
    assert read_json(out / "meta.json")["ledger"]["a"]["facts"] == {"rows": 3}


def test_results_given_back_by_task_are_matched_to_their_parts_and_held_facts_kept(tmp_path):
    out = tmp_path / "toy"

    def first(stage, _):
        parts = StageParts(stage, make_parts(stage.out, ["a"]))
        write_json_atomic(parts.todo[0].files[0], {})
        parts.record_all([(parts.todo[0], {"rows": 1})])
        raise RuntimeError("killed after part a")

    with pytest.raises(RuntimeError):
        run_stage("toy", out, plan(), first, overwrite=False)

    def second(stage, _):
        # b and c have equal tasks: a part is found by its task object, not by its value
        names = ["a", "b", "c"]
        parts = StageParts(stage, [Part(n, (stage.out / f"{n}.json",), [n != "a"]) for n in names])
        assert parts.held(parts.all) == {"a": {"rows": 1}}
        assert [part.name for part in parts.todo] == ["b", "c"]
        given_back = [(part.task, {"rows": i}) for i, part in reversed(list(enumerate(parts.todo)))]
        for part in parts.todo:
            write_json_atomic(part.files[0], {})
        matched = [(part.name, r) for part, r in parts.of_tasks(given_back)]
        assert matched == [("c", {"rows": 1}), ("b", {"rows": 0})]
        parts.record_all(parts.of_tasks(given_back))
        return Finished({"facts": parts.in_order()})

    meta = run_stage("toy", out, plan(), second, overwrite=False)
    assert meta["facts"] == {"a": {"rows": 1}, "b": {"rows": 0}, "c": {"rows": 1}}


def test_the_runner_writes_meta_json_then_says_the_summary_and_returns_the_result(tmp_path, caplog):
    out = tmp_path / "toy"
    seen = []

    class Seeing(logging.Handler):  # meta.json is on disk when each line is said
        def emit(self, record):
            seen.append((record.getMessage(), (out / "meta.json").is_file()))

    def work(stage, _):
        run_parts(
            stage,
            make_parts(stage.out, ["a"]),
            lambda part: write_json_atomic(part.files[0], {}) or {},
        )
        assert not (out / "meta.json").exists()  # (the runner finishes, not the work)
        return Finished({"stage": "toy", "rows": 3}, ["toy: 3 rows", "  by subset"], {"rows": 3})

    handler = Seeing()
    logging.getLogger(SUMMARY_LOGGER).addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
            result = run_stage("toy", out, plan(), work, overwrite=False)
    finally:
        logging.getLogger(SUMMARY_LOGGER).removeHandler(handler)
    assert result == {"rows": 3}
    assert seen == [("toy: 3 rows", True), ("  by subset", True)]
    meta = read_json(out / "meta.json")
    assert meta["rows"] == 3 and meta["plan"]["stage"] == "toy" and "a" in meta["ledger"]
    # without a result, the caller gets the finished meta.json
    again = run_stage("toy", out, plan(2), lambda s, _: Finished({"rows": 4}), overwrite=True)
    assert again == read_json(out / "meta.json") and again["rows"] == 4


def test_work_that_does_not_end_with_finished_is_refused_and_writes_no_meta(tmp_path):
    out = tmp_path / "toy"
    with pytest.raises(TypeError, match="must end with a Finished"):
        run_stage("toy", out, plan(), lambda stage, _: {"rows": 1}, overwrite=False)
    assert not (out / "meta.json").exists()
