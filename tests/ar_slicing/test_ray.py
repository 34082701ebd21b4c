"""The stages on Ray: tokenize, count and eval with `--executor ray` write what the local executor
writes, also when a task's worker process dies mid-way and Ray retries it.

One local cluster (`ray.init(num_cpus=2)`) serves the whole module: starting Ray takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ar_slicing.data.store import write_token_store
from ar_slicing.data.tokenizer import describe
from ar_slicing.errors import BadInput
from pipeline.count import CountConfig, run_count
from pipeline.eval import EvalConfig, run_eval
from pipeline.tag import TagConfig, run_tag
from pipeline.tokenize import TokenizeConfig, run_tokenize
from tests.tiny_models import save_native_lm

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

L = 32  # tag window of the eval test


@pytest.fixture(scope="module")
def cluster():
    # Ray's workers cannot import this test module: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def killing_first_attempt(fn, marker: Path):
    """`fn`, except that the first call anywhere (the cluster's processes share `marker`'s
    directory) does the work and then kills its own process before returning, as a node lost
    mid-task would. Defined inside a function, so Ray ships it by value to its workers."""

    def run(task):
        result = fn(task)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return result
        os.close(fd)
        os._exit(1)

    return run


class KillingExecutor:
    """A RayExecutor whose task functions (and actor states) die once, mid-way."""

    def __init__(self, inner, marker_dir: Path):
        self.inner = inner
        self.marker_dir = marker_dir
        self.workers = inner.workers
        self.cluster_gpus = inner.cluster_gpus

    def map_unordered(self, fn, tasks):
        marker = self.marker_dir / f"{fn.__name__}.killed"
        yield from self.inner.map_unordered(killing_first_attempt(fn, marker), tasks)

    def map_actors(self, make_state, tasks, **kw):
        marker = self.marker_dir / "actor.killed"

        def make_killing_state():
            return killing_first_attempt(make_state(), marker)

        yield from self.inner.map_actors(make_killing_state, tasks, **kw)


def same_bytes(a: Path, b: Path, names) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ---- tokenize ---------------------------------------------------------------------------------


def test_tokenize_on_ray_equals_local(cluster, stdlib_texts, bpe_tokenizer_path, tmp_path):
    source = tmp_path / "corpus.jsonl"
    with open(source, "w") as f:
        for i, text in enumerate(stdlib_texts[:24]):
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": f"set{i % 3}"}}) + "\n")
    common = dict(
        source=[str(source)], tokenizer=str(bpe_tokenizer_path), shard_docs=3, shard_mb=0.05
    )
    local = run_tokenize(TokenizeConfig(out=str(tmp_path / "local"), workers=2, **common))
    on_ray = run_tokenize(TokenizeConfig(out=str(tmp_path / "ray"), executor="ray", **common))
    assert on_ray["shards"] == local["shards"] >= 8
    same_bytes(
        tmp_path / "local", tmp_path / "ray", ["tokens.bin", "docs.parquet", "tokenizer.json"]
    )


def test_tokenize_retries_a_killed_task(
    cluster, stdlib_texts, bpe_tokenizer_path, tmp_path, monkeypatch
):
    """The real stage with a task that dies after writing its shard: retried, same store."""
    from ar_slicing.machinery.ray_executor import RayExecutor

    source = tmp_path / "texts"
    source.mkdir()
    for i, text in enumerate(stdlib_texts[:12]):
        (source / f"{i:02d}.txt").write_text(text)
    common = dict(
        source=[str(source)], tokenizer=str(bpe_tokenizer_path), shard_docs=2, shard_mb=1.0
    )
    run_tokenize(TokenizeConfig(out=str(tmp_path / "local"), workers=1, **common))
    killing = KillingExecutor(RayExecutor(), tmp_path)
    monkeypatch.setattr(
        "ar_slicing.machinery.executor.get_executor", lambda name, *a, **kw: killing
    )
    run_tokenize(TokenizeConfig(out=str(tmp_path / "ray"), executor="ray", **common))
    assert (tmp_path / "encode_shard.killed").exists()  # a worker did die
    same_bytes(tmp_path / "local", tmp_path / "ray", ["tokens.bin", "docs.parquet"])


def mixed_sources(root: Path, texts: list[str]) -> list[str]:
    """A directory (nested .txt files, an empty one, a Pile-style .jsonl.gz with a bad line) and a
    .jsonl file source after it."""
    import gzip

    corpus = root / "corpus"
    (corpus / "b").mkdir(parents=True)
    for i, text in enumerate(texts[:6]):
        (corpus / ("b" if i % 2 else "") / f"{i:02d}.txt").write_text(text)
    (corpus / "b" / "empty.txt").write_text("")
    with gzip.open(corpus / "b" / "pile.jsonl.gz", "wt") as f:
        for i, text in enumerate(texts[6:16]):
            f.write(json.dumps({"text": text, "meta": {"pile_set_name": f"set{i % 3}"}}) + "\n")
            if i == 4:
                f.write("{not json\n")
    single = root / "single.jsonl"
    single.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[16:22]))
    return [str(corpus), str(single)]


def test_tokenize_by_file_on_ray_equals_the_default(
    cluster, stdlib_texts, bpe_tokenizer_path, tmp_path, monkeypatch
):
    """--shard-by-file (tasks read their own files) keeps the same documents and tokens as the
    driver-read default, with the same read stats; on Ray and locally it writes the same bytes,
    also when a task dies mid-way."""
    from ar_slicing.machinery.ray_executor import RayExecutor

    common = dict(
        source=mixed_sources(tmp_path, stdlib_texts),
        tokenizer=str(bpe_tokenizer_path),
        glob="**/*",
        on_bad_record="skip",
        split_fraction=0.3,
        split_part="train",
        shard_docs=2,
    )

    def tokenize(name, **kw):
        run_tokenize(TokenizeConfig(out=str(tmp_path / name), **common, **kw))
        return json.loads((tmp_path / name / "meta.json").read_text())

    default = tokenize("default", workers=2)
    tokenize("by-file-local", workers=2, shard_by_file=True)
    by_file_ray = tokenize("by-file-ray", executor="ray", shard_by_file=True)
    killing = KillingExecutor(RayExecutor(), tmp_path)
    monkeypatch.setattr(
        "ar_slicing.machinery.executor.get_executor", lambda name, *a, **kw: killing
    )
    tokenize("by-file-killed", executor="ray", shard_by_file=True)
    assert (tmp_path / "encode_file.killed").exists()

    assert by_file_ray["counts"]["shards"] == 9  # 8 files of the directory, then the .jsonl
    for name in ("by-file-local", "by-file-ray", "by-file-killed"):
        same_bytes(tmp_path / "default", tmp_path / name, ["tokens.bin", "tokenizer.json"])
        assert pq.read_table(tmp_path / name / "docs.parquet").equals(
            pq.read_table(tmp_path / "default" / "docs.parquet")
        )
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        for key in ("documents", "bytes", "bad_records", "empty", "other_split_part", "tokens"):
            assert meta["counts"][key] == default["counts"][key], key
        assert meta["bad_record_examples"] == default["bad_record_examples"]
    assert default["counts"]["bad_records"] == 1 and default["counts"]["other_split_part"] > 0
    same_bytes(tmp_path / "by-file-local", tmp_path / "by-file-ray", ["docs.parquet"])
    same_bytes(tmp_path / "by-file-local", tmp_path / "by-file-killed", ["docs.parquet"])


def test_tokenize_by_file_refuses_max_docs(tmp_path, bpe_tokenizer_path):
    from ar_slicing.errors import ArSliceError

    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ArSliceError, match="--max-docs.*--shard-by-file"):
        run_tokenize(
            TokenizeConfig(
                source=[str(tmp_path / "a.txt")],
                tokenizer=str(bpe_tokenizer_path),
                out=str(tmp_path / "out"),
                max_docs=3,
                shard_by_file=True,
            )
        )


# ---- count ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_stores(tmp_path_factory, bpe_tokenizer, stdlib_texts):
    """Two real training stores (counted together, so the pair across them counts too)."""
    root = tmp_path_factory.mktemp("train")
    info = describe(bpe_tokenizer, "bpe")
    docs = [bpe_tokenizer.encode(t).ids for t in stdlib_texts[:30]]
    return [
        write_token_store(root / "a", docs[:18], tokenizer_info=info).path,
        write_token_store(root / "b", docs[18:], tokenizer_info=info).path,
    ]


def test_count_on_ray_equals_local_through_the_cli(cluster, train_stores, tmp_path):
    from pipeline.cli import main

    tokens = [str(p) for p in train_stores]
    common = ["--tokens", *tokens, "--shard-tokens", "20000", "--workers", "2"]
    assert main(["count", *common, "--out", str(tmp_path / "local")]) == 0
    assert main(["count", *common, "--out", str(tmp_path / "ray"), "--executor", "ray"]) == 0
    same_bytes(tmp_path / "local", tmp_path / "ray", ["bigrams.parquet"])
    local = json.loads((tmp_path / "local" / "meta.json").read_text())
    on_ray = json.loads((tmp_path / "ray" / "meta.json").read_text())
    assert on_ray["counts"]["shards"] == local["counts"]["shards"] >= 5
    for key in ("total_pairs", "distinct_bigrams", "fingerprint", "unit"):
        assert on_ray[key] == local[key]
    assert on_ray["config"]["executor"] == "ray"


def test_relative_paths_mean_the_drivers_working_directory(
    cluster, train_stores, tmp_path, monkeypatch
):
    """Ray's workers started in another directory: relative --tokens/--out still resolve."""
    from pipeline.cli import main

    for i, store in enumerate(train_stores):
        shutil.copytree(store, tmp_path / f"train{i}")
    monkeypatch.chdir(tmp_path)
    common = ["--tokens", "train0", "train1", "--shard-tokens", "20000", "--workers", "2"]
    assert main(["count", *common, "--out", "local"]) == 0
    assert main(["count", *common, "--out", "ray", "--executor", "ray"]) == 0
    same_bytes(tmp_path / "local", tmp_path / "ray", ["bigrams.parquet"])


def test_count_retries_killed_map_and_reduce_tasks(cluster, train_stores, tmp_path):
    from ar_slicing.machinery.ray_executor import RayExecutor
    from pipeline.count import count_stores

    kw = dict(unit="row:101", shard_tokens=20000, progress=False)
    count_stores(train_stores, tmp_path / "local", workers=1, **kw)
    killing = KillingExecutor(RayExecutor(1), tmp_path)  # one worker: same reduce ranges as local
    count_stores(train_stores, tmp_path / "ray", make_executor=lambda: killing, **kw)
    assert (tmp_path / "count_shard.killed").exists()
    assert (tmp_path / "reduce_range.killed").exists()
    same_bytes(tmp_path / "local", tmp_path / "ray", ["bigrams.parquet"])


class FailingOnLastShard:
    """A RayExecutor whose map task for the last shard raises: a run that stops part-way."""

    def __init__(self, inner):
        self.inner = inner
        self.workers = inner.workers

    def map_unordered(self, fn, tasks):
        tasks = list(tasks)
        last = tasks[-1]

        def run(task):
            if task == last and fn.__name__ == "count_shard":
                raise BadInput(f"{task.out}: unreadable shard")
            return fn(task)

        yield from self.inner.map_unordered(run, tasks)


def test_count_rerun_on_ray_skips_finished_shards(cluster, train_stores, tmp_path):
    from ar_slicing.machinery.ray_executor import RayExecutor
    from pipeline.count import count_stores

    kw = dict(shard_tokens=10000, progress=False)
    local = count_stores(train_stores, tmp_path / "local", workers=1, **kw)
    n = local["counts"]["shards"]
    assert n >= 8
    with pytest.raises(BadInput, match="unreadable shard"):
        failing = FailingOnLastShard(RayExecutor(1))
        count_stores(train_stores, tmp_path / "ray", make_executor=lambda: failing, **kw)
    assert not (tmp_path / "ray" / "meta.json").exists()
    again = count_stores(train_stores, tmp_path / "ray", make_executor=lambda: RayExecutor(1), **kw)
    # the last shard was submitted after all but the 2 tasks in flight had finished
    assert again["counts"]["shards_resumed"] >= n - 3
    same_bytes(tmp_path / "local", tmp_path / "ray", ["bigrams.parquet"])


def test_actors_build_their_state_once(cluster, tmp_path):
    """map_actors: one state per actor, built in the actor's process, serving many tasks."""
    from ar_slicing.machinery.ray_executor import RayExecutor

    def make_state():
        pid = os.getpid()
        (tmp_path / f"built-{pid}").touch()
        return lambda task: (task, pid)

    results = list(RayExecutor().map_actors(make_state, range(12), n_actors=2))
    assert sorted(task for task, _ in results) == list(range(12))
    assert all(value[0] == task for task, value in results)
    pids = {value[1] for _, value in results}
    assert pids <= {int(p.name.split("-")[1]) for p in tmp_path.glob("built-*")}
    assert len(list(tmp_path.glob("built-*"))) == 2 and len(pids) <= 2


def test_a_task_error_reaches_the_driver_as_itself(cluster, tmp_path):
    """A bad input fails the same way on every attempt: not retried, re-raised as BadInput."""
    from ar_slicing.machinery.ray_executor import RayExecutor

    calls = tmp_path / "calls"
    calls.mkdir()

    def bad(task):
        (calls / f"{task}-{os.getpid()}-{len(list(calls.iterdir()))}").touch()
        raise BadInput(f"shard {task}: broken")

    with pytest.raises(BadInput, match="shard 7: broken"):
        list(RayExecutor(1).map_unordered(bad, [7]))
    assert len(list(calls.iterdir())) == 1


# ---- eval -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory, bpe_tokenizer, bpe_tokenizer_path, stdlib_texts):
    """A validation store of real text, its tags (count and tag stages) and a tiny native model."""
    root = tmp_path_factory.mktemp("eval")
    info = describe(bpe_tokenizer, "bpe")
    docs = [bpe_tokenizer.encode(t).ids[:n] for t, n in zip(stdlib_texts[5:], [45, 5, 90, 64, 7])]
    store = write_token_store(root / "val", docs, tokenizer_info=info)
    run_count(CountConfig(tokens=[str(store.path)], out=str(root / "counts"), workers=1))
    run_tag(
        TagConfig(
            tokens=str(store.path), counts=str(root / "counts"), out=str(root / "tags"), window=L
        )
    )
    save_native_lm(
        root / "model",
        1024,
        tokenizer=bpe_tokenizer_path,
        d_model=64,
        num_heads=4,
        l_max=64,
        seed=2,
    )
    return {"tags": root / "tags", "model": f"native:{root / 'model'}"}


def eval_config(inputs, out: Path, **kw) -> EvalConfig:
    return EvalConfig(
        model=inputs["model"],
        tags=str(inputs["tags"]),
        out=str(out),
        device="cpu",
        batch_size="2",
        chunk_windows=2,
        **kw,
    )


def assert_same_losses(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("losses-*.parquet"))
    assert names and names == sorted(p.name for p in b.glob("losses-*.parquet"))
    for name in names:
        ta, tb = pq.read_table(a / name), pq.read_table(b / name)
        assert ta.schema.metadata == tb.schema.metadata  # the same plan (device, dtype, ...)
        for col in ("window_id", "pos"):
            assert ta.column(col).equals(tb.column(col))
        # value for value: the same batches through the same fp32 CPU kernels
        np.testing.assert_array_equal(ta.column("nll").to_numpy(), tb.column("nll").to_numpy())


def test_eval_on_ray_actors_equals_local(cluster, eval_inputs, tmp_path):
    local = run_eval(eval_config(eval_inputs, tmp_path / "local"))
    on_ray = run_eval(eval_config(eval_inputs, tmp_path / "ray", executor="ray"))
    assert on_ray["tokens"] == local["tokens"]
    assert_same_losses(tmp_path / "local", tmp_path / "ray")
    meta = json.loads((tmp_path / "ray" / "meta.json").read_text())
    assert meta["device"] == "cpu" and meta["counts"]["chunks_computed"] >= 4
    # a rerun finds the directory complete, as locally
    assert run_eval(eval_config(eval_inputs, tmp_path / "ray", executor="ray"))["skipped"]


def test_eval_actor_killed_mid_chunk_is_restarted(cluster, eval_inputs, tmp_path, monkeypatch):
    """The actor's process dies after writing its first chunk: Ray restarts it (the model is
    loaded again) and retries that chunk; the losses are still the local run's."""
    from ar_slicing.machinery.ray_executor import RayExecutor

    run_eval(eval_config(eval_inputs, tmp_path / "local"))
    killing = KillingExecutor(RayExecutor(), tmp_path)
    monkeypatch.setattr(
        "ar_slicing.machinery.executor.get_executor", lambda name, *a, **kw: killing
    )
    run_eval(eval_config(eval_inputs, tmp_path / "ray", executor="ray", ray_actors=1))
    assert (tmp_path / "actor.killed").exists()
    assert_same_losses(tmp_path / "local", tmp_path / "ray")


def test_partial_eval_on_ray_resumes_with_local(cluster, eval_inputs, tmp_path):
    """Chunks written by actors are resumed by a local run (and the other way round)."""
    run_eval(eval_config(eval_inputs, tmp_path / "whole"))
    out = tmp_path / "mixed"
    run_eval(eval_config(eval_inputs, out, executor="ray", max_windows=3))
    again = run_eval(eval_config(eval_inputs, out))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["counts"]["chunks_reused"] == 1 and again["tokens"] > 0
    assert_same_losses(tmp_path / "whole", out)
    shutil.rmtree(out)
