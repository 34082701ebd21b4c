"""Fault injection: SIGKILL each long stage (tokenize, count, tag, eval, train) at several points of
a real run in a subprocess, then rerun the same command.

At the moment of the kill, every file under a final output name must already be exactly the file an
uninterrupted run writes (unfinished work lives only under hidden or `.tmp` names). After the rerun,
the output directory must equal the uninterrupted run's: the same files, byte for byte, and the same
meta.json apart from timings and resume counters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ar_slicing.machinery.io import VOLATILE_META_KEYS, stable_meta
from tests.reliability import WINDOW, cli, copy_sources, final_files, kill_when, save_tiny_native

# meta.json keys that describe how the work was done, not what was produced.
# The checkout's git_hash may change while the suite runs (work goes on in it); timings are dropped
# at every depth (a stage records its inputs' meta, timings included).
RESUME_KEYS = re.compile(
    r"resum|reused|already|skipped|computed|input_tokens_read|^git_hash$|^("
    + "|".join(VOLATILE_META_KEYS)
    + ")$"
)


@dataclass
class Stage:
    name: str
    argv: list  # without --out
    progress_glob: str  # files under OUT whose number tells how far the run got
    slow: bool

    def progress(self, out: Path) -> int:
        if self.name == "train":  # the checkpoints saved so far
            steps = [0]
            for state in out.glob(".train-state/step-*/state.json"):
                try:
                    steps.append(int(json.loads(state.read_text())["step"]))
                except (OSError, ValueError, KeyError):
                    pass
            return max(steps)
        return sum(1 for _ in out.glob(self.progress_glob)) if out.exists() else 0


@pytest.fixture(scope="module")
def world(tmp_path_factory, bpe_tokenizer_path):
    """Inputs of every stage and, per stage, the output of an uninterrupted run."""
    root = tmp_path_factory.mktemp("faults")
    tok = str(bpe_tokenizer_path)
    src = copy_sources(root / "src", 40)  # the tokenize stage's own input
    train_src = copy_sources(root / "train-src", 12)
    val_src = copy_sources(root / "val-src", 2, skip=40)
    train, val = root / "train", root / "val"
    assert cli("tokenize", "--source", val_src, "--glob", "*.py", "--tokenizer", tok,
               "--workers", "1", "--out", val) == 0  # fmt: skip
    model = save_tiny_native(root / "model", bpe_tokenizer_path)
    stages = {
        "tokenize": Stage(
            "tokenize",
            [
                "tokenize",
                "--source",
                src,
                "--glob",
                "*.py",
                "--tokenizer",
                tok,
                "--workers",
                "1",
                "--shard-docs",
                "1",
            ],  # fmt: skip
            ".parts/*/*.docs.parquet",
            slow=True,
        ),
        "count": Stage(
            "count",
            ["count", "--tokens", train, "--workers", "1", "--shard-tokens", "4096"],
            ".work/*/*.bin",
            slow=False,
        ),
        "tag": Stage(
            "tag",
            [
                "tag",
                "--tokens",
                val,
                "--counts",
                root / "counts",
                "--window",
                WINDOW,
                "--workers",
                "1",
                "--part-tokens",
                str(8 * WINDOW),
            ],  # fmt: skip
            "tags-*.parquet",
            slow=False,
        ),
        "eval": Stage(
            "eval",
            [
                "eval",
                "--model",
                f"native:{model}",
                "--tags",
                root / "tags",
                "--device",
                "cpu",
                "--batch-size",
                "8",
                "--chunk-windows",
                "4",
            ],  # fmt: skip
            "losses-*.parquet",
            slow=True,
        ),
        "train": Stage(
            "train",
            [
                "train",
                "--arch",
                "attention",
                "--tokens",
                train,
                "--val-tokens",
                val,
                "--d-model",
                "32",
                "--n-layers",
                "2",
                "--mixer-options",
                "num_heads=2",
                "--seq-len",
                "64",
                "--batch-size",
                "4",
                "--steps",
                "24",
                "--warmup-steps",
                "2",
                "--eval-every",
                "12",
                "--eval-batches",
                "1",
                "--checkpoint-every",
                "3",
                "--device",
                "cpu",
                "--no-progress",
            ],  # fmt: skip
            "",
            slow=True,
        ),
    }
    refs = {"tokenize": root / "tokenized", "count": root / "counts", "tag": root / "tags",
            "eval": root / "losses", "train": root / "trained"}  # fmt: skip
    inputs = {"count": [train], "tag": [val, root / "counts"], "eval": [root / "tags"],
              "train": [train]}  # fmt: skip

    def reference(name: str) -> Path:
        """The output of an uninterrupted run of stage `name` (made on first use)."""
        for d in inputs.get(name, []):
            if d == train and not (train / "meta.json").exists():
                assert cli("tokenize", "--source", train_src, "--glob", "*.py", "--tokenizer",
                           tok, "--workers", "1", "--out", train) == 0  # fmt: skip
            elif d == root / "counts":
                reference("count")
            elif d == root / "tags":
                reference("tag")
        if not (refs[name] / "meta.json").exists():
            assert cli(*stages[name].argv, "--out", refs[name]) == 0
        return refs[name]

    return {"stages": stages, "reference": reference}


def units_of_work(stage: Stage, ref: Path) -> int:
    """How far a complete run gets, in the units `stage.progress` counts."""
    meta = json.loads((ref / "meta.json").read_text())
    if stage.name == "tokenize":
        return int(meta["n_docs"])  # one document per shard
    if stage.name == "count":  # map partials (about tokens / shard_tokens) and reduced ranges
        return -(-int(meta["total_pairs"]) // 4096)
    if stage.name == "train":
        return 24
    return len(list(ref.glob(stage.progress_glob)))


def comparable_meta(out: Path) -> dict:
    """meta.json without timings, resume counters, git_hash and the output's own path."""
    text = (out / "meta.json").read_text().replace(str(out), "OUT")

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if not RESUME_KEYS.search(k)}
        return value

    return strip(stable_meta(json.loads(text)))


def assert_final_files_are_finished(out: Path, ref: Path) -> None:
    """Whatever lies under a final name equals the uninterrupted run's file of that name."""
    ref_files = final_files(ref)
    for rel, path in final_files(out).items():
        assert rel in ref_files, f"{rel}: a final name the uninterrupted run does not write"
        if rel == "meta.json":
            # meta.json is written last: with it there, everything else must be in place
            assert set(final_files(out)) == set(ref_files)
            continue
        assert path.read_bytes() == ref_files[rel].read_bytes(), f"{rel} is partial or different"


def assert_same_outputs(out: Path, ref: Path) -> None:
    files, ref_files = final_files(out), final_files(ref)
    assert set(files) == set(ref_files)
    for rel in files:
        if rel != "meta.json":
            assert files[rel].read_bytes() == ref_files[rel].read_bytes(), rel
    assert comparable_meta(out) == comparable_meta(ref)
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")], "temporary files left"


# (stage, point): `point` is how far the run must get before the kill: "first" (one unit of
# progress), "middle" (half of them) or "end" (all of them: killed while finishing up).
POINTS = ("first", "middle", "end")
CASES = [
    pytest.param(
        stage,
        point,
        marks=[pytest.mark.slow] if (slow or point != "middle") else [],
        id=f"{stage}-{point}",
    )
    for stage, slow in (
        ("tokenize", True),
        ("count", False),
        ("tag", False),
        ("eval", True),
        ("train", True),
    )  # fmt: skip
    for point in POINTS
]


@pytest.mark.parametrize("stage_name,point", CASES)
def test_killed_stage_reruns_to_the_uninterrupted_output(world, tmp_path, stage_name, point):
    stage = world["stages"][stage_name]
    ref = world["reference"](stage_name)
    total = units_of_work(stage, ref)
    out = tmp_path / "out"
    target = {"first": 1, "middle": max(1, total // 2), "end": total}[point]

    killed, stderr = kill_when([*stage.argv, "--out", out], lambda: stage.progress(out) >= target)
    assert "Traceback" not in stderr, stderr
    if point != "end":
        assert killed, f"{stage_name} finished before reaching {target} units of progress"
        assert not (out / "meta.json").exists()
    assert_final_files_are_finished(out, ref)

    assert cli(*stage.argv, "--out", out) == 0
    assert_same_outputs(out, ref)


@pytest.mark.slow
def test_a_second_kill_during_the_resumed_run(world, tmp_path):
    """Kill, resume, kill again, resume: still the uninterrupted output (tag stage)."""
    stage, ref = world["stages"]["tag"], world["reference"]("tag")
    out = tmp_path / "out"
    total = units_of_work(stage, ref)
    for target in (max(1, total // 3), max(2, 2 * total // 3)):
        killed, stderr = kill_when(
            [*stage.argv, "--out", out], lambda t=target: stage.progress(out) >= t
        )
        assert killed, stderr
        assert_final_files_are_finished(out, ref)
    assert cli(*stage.argv, "--out", out) == 0
    assert_same_outputs(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("left", ["half-written", "not-recorded", "old-beside-new"])
def test_train_resumes_from_a_checkpoint_cut_short(world, tmp_path, left):
    """A kill while saving a checkpoint (`pipeline.train.state.checkpoint`: the new one written
    under a temporary name and renamed in, recorded in the ledger, then the one before removed)
    leaves one of these layouts; the rerun must resume from the checkpoint the ledger holds
    whole and finish with the same weights."""
    import shutil

    from ar_slicing.machinery.io import tmp_path_for
    from ar_slicing.machinery.ledger import Ledger

    stage, ref = world["stages"]["train"], world["reference"]("train")
    out = tmp_path / "out"
    killed, stderr = kill_when([*stage.argv, "--out", out], lambda: stage.progress(out) >= 6)
    assert killed, stderr
    state = out / ".train-state"
    recorded = max(e["facts"]["step"] for e in Ledger(out).parts.values())
    newest = state / f"step-{recorded:08d}"
    for (
        leftover
    ) in state.iterdir():  # whatever the kill itself left: the layouts below are the test
        if leftover != newest:
            shutil.rmtree(leftover)
    later = state / f"step-{recorded + 3:08d}"
    if left == "half-written":  # killed while writing the next one: a temporary folder
        shutil.copytree(newest, tmp_path_for(later))
        (tmp_path_for(later) / "state.json").unlink()
        step = recorded
    elif left == "not-recorded":  # killed after the next one was renamed in, before its record
        shutil.copytree(newest, later)
        step = recorded
    else:  # killed after recording the newest, before removing the one before it
        shutil.copytree(newest, state / f"step-{recorded - 3:08d}")
        step = recorded
    assert cli(*stage.argv, "--out", out) == 0
    assert_same_outputs(out, ref)
    assert not state.exists()
    # it resumed from the checkpoint the ledger holds rather than starting over
    assert json.loads((out / "meta.json").read_text())["counts"]["resumed_from_step"] == step
