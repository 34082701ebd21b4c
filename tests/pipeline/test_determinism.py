"""Determinism: two runs of the stages on the same inputs write byte-identical files (token
stores, Parquet of counts, tags and CPU losses) and the same meta.json apart from timings."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest

from ar_slicing.machinery.io import VOLATILE_META_KEYS, stable_meta
from tests.reliability import (  # noqa: F401  (tiny_run is a fixture)
    REPO,
    arslice_argv,
    cli,
    final_files,
    run_commands,
    tiny_run,
)


def meta_apart_from_timings(path, drop_config=()) -> dict:
    """stable_meta of `path`.

    Timings are dropped at every depth (a stage records its inputs' meta, timings included).
    `git_hash` is dropped too: the checkout may gain commits between the two runs, which changes
    the provenance but not the output.
    """
    drop = {"git_hash", *VOLATILE_META_KEYS}

    def without_git_hash(value):
        if isinstance(value, dict):
            return {k: without_git_hash(v) for k, v in value.items() if k not in drop}
        return value

    meta = stable_meta(json.loads(path.read_text()))
    for key in drop_config:
        meta.get("config", {}).pop(key, None)
    return without_git_hash(meta)


def assert_identical_runs(a, b, drop_config=()) -> None:
    files_a, files_b = final_files(a), final_files(b)
    assert set(files_a) == set(files_b)
    parquet = [rel for rel in files_a if rel.endswith(".parquet")]
    # every stage's tables are there: a store's docs, counts, windows, tags, losses
    for expected in ("tokens/val/docs.parquet", "counts/bigrams.parquet", "tags/windows.parquet"):
        assert expected in parquet
    assert any(rel.startswith("tags/tags-") for rel in parquet)
    assert any(rel.startswith("losses/attention/losses-") for rel in parquet)
    for rel in files_a:
        if rel.endswith("meta.json"):
            assert meta_apart_from_timings(files_a[rel], drop_config) == meta_apart_from_timings(
                files_b[rel], drop_config
            ), rel
        else:
            assert files_a[rel].read_bytes() == files_b[rel].read_bytes(), f"{rel} differs"


def rerun_in_place(shared_run, tmp_path):
    """Move the shared run aside (to compare with) so that it can be made again where it was:
    stages record where their inputs are, so a rerun means the same paths."""
    run = shared_run["run"]
    first = tmp_path / "first"
    shutil.move(run, first)
    return first, run


def inputs_of(shared_run, tokenizer_path):
    return shared_run["src_train"], shared_run["src_val"], tokenizer_path, shared_run["model"]


def test_a_second_run_in_this_process_writes_the_same_bytes(
    tiny_run,  # noqa: F811
    tmp_path,
    bpe_tokenizer_path,
):
    first, run = rerun_in_place(tiny_run, tmp_path)
    for argv in run_commands(run, *inputs_of(tiny_run, bpe_tokenizer_path)):
        assert cli(*argv) == 0
    assert_identical_runs(first, run)


@pytest.mark.slow
def test_fresh_processes_with_other_hash_seeds_and_workers_write_the_same_bytes(
    tiny_run,  # noqa: F811
    tmp_path,
    bpe_tokenizer_path,
):
    """The same commands in new processes, another PYTHONHASHSEED and two workers per stage."""
    first, run = rerun_in_place(tiny_run, tmp_path)
    argvs = run_commands(run, *inputs_of(tiny_run, bpe_tokenizer_path))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": str(random.randrange(1, 1000))}
    for argv in argvs:
        if "--workers" in argv:
            argv[argv.index("--workers") + 1] = "2"
        done = subprocess.run(
            arslice_argv(*argv), cwd=REPO, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    assert_identical_runs(first, run, drop_config=("workers",))
