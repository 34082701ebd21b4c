"""Restricted counts (`--only-bigrams-of`): the full counts filtered to the evaluated stores'
bigrams, and tags from them byte-identical to tags from the full counts."""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.data.store import write_token_store
from ar_slicing.errors import ArSliceError, TokenizerMismatch
from ar_slicing.machinery.io import read_json
from pipeline.count import count_stores

FP = "a" * 64


def store_at(path, documents, *, vocab_size, eos=0, fingerprint=FP, subsets=None):
    info = {"name": "test", "fingerprint": fingerprint, "vocab_size": vocab_size, "eos_id": eos}
    return write_token_store(path, documents, tokenizer_info=info, subsets=subsets)


def rows_of(out) -> list[tuple[int, int, int]]:
    with open(Path(out) / "bigrams.parquet", "rb") as f:
        t = pq.read_table(f)
    return list(zip(*(t.column(c).to_pylist() for c in ("prev", "next", "count"))))


def pairs_of(store) -> set[tuple[int, int]]:
    tokens = [int(t) for t in store.tokens]
    return set(zip(tokens, tokens[1:]))


@st.composite
def cases(draw):
    """Training stores, evaluated stores (sharing ids with them), unit, shard size, workers."""
    vocab = draw(st.sampled_from([5, 60, 65_536, 70_000]))
    token = st.integers(0, vocab - 1)
    docs = st.lists(st.lists(token, max_size=40), min_size=1, max_size=6)
    # the training stream has at least one pair (a count refuses fewer)
    train = [draw(st.lists(st.lists(token, min_size=1, max_size=40), min_size=1, max_size=6))]
    train += [draw(docs) for _ in range(draw(st.integers(0, 2)))]
    evaluated = [draw(docs) for _ in range(draw(st.integers(1, 2)))]
    unit = draw(st.sampled_from(["stream", "row:2", "row:5", "row:64"]))
    return (
        vocab,
        train,
        evaluated,
        unit,
        draw(st.sampled_from([2, 7, 1 << 20])),
        draw(st.sampled_from([1, 2, 3])),
    )


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cases())
def test_restricted_counts_equal_full_counts_filtered(engine, case):
    vocab, train_docs, eval_docs, unit, shard_tokens, groups = case
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train = [store_at(tmp / f"t{i}", d, vocab_size=vocab) for i, d in enumerate(train_docs)]
        evaluated = [store_at(tmp / f"e{i}", d, vocab_size=vocab) for i, d in enumerate(eval_docs)]
        kw = dict(unit=unit, shard_tokens=shard_tokens, progress=False)
        full = count_stores([s.path for s in train], tmp / "full", **kw)
        meta = count_stores(
            [s.path for s in train],
            tmp / "only",
            workers=groups,
            only_bigrams_of=[s.path for s in evaluated],
            **kw,
        )
        wanted = set().union(*(pairs_of(s) for s in evaluated))
        expected = [r for r in rows_of(tmp / "full") if (r[0], r[1]) in wanted]
        assert rows_of(tmp / "only") == expected
        assert meta["total_pairs"] == sum(c for _, _, c in expected)
        assert meta["distinct_bigrams"] == len(expected)
        assert meta["evaluated_bigrams"] == len(wanted)
        assert meta["evaluated_bigrams_unseen"] == len(wanted) - len(expected)
        assert meta["stream_pairs"] == full["total_pairs"]
        assert [e["tokens_sha256"] for e in meta["only_bigrams_of"]] == [
            hashlib.sha256((s.path / "tokens.bin").read_bytes()).hexdigest() for s in evaluated
        ]
        assert not (tmp / "only" / ".work").exists()


def zipf_docs(rng, n_docs, vocab, copy=True):
    """Documents of Zipf ids that quote earlier spans of themselves (so windows repeat)."""
    docs = []
    for _ in range(n_docs):
        doc = (rng.zipf(1.2, size=int(rng.integers(20, 600))) % (vocab - 1)).tolist()
        if copy and len(doc) > 40:
            start = int(rng.integers(20, len(doc) - 10))
            doc[start : start + 10] = doc[start - 20 : start - 10]
        docs.append(doc)
    return docs


@pytest.mark.parametrize("vocab", [4001, 70_001])  # region table or hash table lookups
def test_tags_from_restricted_and_full_counts_are_byte_identical(tmp_path, engine, vocab):
    from pipeline.tag import TagConfig, run_tag

    rng = np.random.default_rng(7)
    train = store_at(tmp_path / "train", zipf_docs(rng, 200, vocab), vocab_size=vocab)
    subsets = [["Github", "ArXiv", None][i % 3] for i in range(40)]
    val = store_at(tmp_path / "val", zipf_docs(rng, 40, vocab), vocab_size=vocab, subsets=subsets)
    count_stores([train.path], tmp_path / "full", shard_tokens=3000, progress=False)
    count_stores(
        [train.path],
        tmp_path / "only",
        shard_tokens=3000,
        workers=2,
        only_bigrams_of=[val.path],
        progress=False,
    )
    metas = {}
    for name in ("full", "only"):
        cfg = TagConfig(
            tokens=str(val.path),
            counts=str(tmp_path / name),
            out=str(tmp_path / f"tags-{name}"),
            window=128,
            threshold=3,
            workers=1,
            part_tokens=2000,
        )
        metas[name] = run_tag(cfg)
    parts = sorted(p.name for p in (tmp_path / "tags-full").glob("*.parquet"))
    assert len(parts) > 3
    for name in parts:
        full = (tmp_path / "tags-full" / name).read_bytes()
        assert full == (tmp_path / "tags-only" / name).read_bytes(), name
    hits = metas["full"]["counts"]["ar_hits"]
    assert 0 < hits < metas["full"]["counts"]["repeats"]  # the threshold splits the repeats
    assert metas["only"]["counts"] == metas["full"]["counts"]


def test_tag_refuses_restricted_counts_of_another_store(tmp_path):
    from pipeline.tag import TagConfig, run_tag

    rng = np.random.default_rng(3)
    train = store_at(tmp_path / "train", zipf_docs(rng, 50, 500), vocab_size=500)
    val = store_at(tmp_path / "val", zipf_docs(rng, 10, 500), vocab_size=500)
    other = store_at(tmp_path / "other", zipf_docs(rng, 10, 500), vocab_size=500)
    count_stores([train.path], tmp_path / "c", only_bigrams_of=[val.path], progress=False)
    with pytest.raises(ArSliceError) as e:
        run_tag(
            TagConfig(tokens=str(other.path), counts=str(tmp_path / "c"), out=str(tmp_path / "t"))
        )
    message = str(e.value)
    assert str(other.path) in message and str(val.path.resolve()) in message
    assert "--only-bigrams-of" in message
    assert not (tmp_path / "t" / "meta.json").exists()
    # the same store re-created with other tokens is refused too, though its path is the same
    count_stores([train.path], tmp_path / "c2", only_bigrams_of=[other.path], progress=False)
    store_at(tmp_path / "other", zipf_docs(rng, 10, 500), vocab_size=500)
    with pytest.raises(ArSliceError, match="not one of them"):
        run_tag(
            TagConfig(tokens=str(other.path), counts=str(tmp_path / "c2"), out=str(tmp_path / "t"))
        )


def test_evaluated_store_of_another_tokenizer_is_refused(tmp_path):
    train = store_at(tmp_path / "train", [[1, 2, 3]], vocab_size=10)
    val = store_at(tmp_path / "val", [[1, 2]], vocab_size=10, fingerprint="b" * 64)
    with pytest.raises(TokenizerMismatch):
        count_stores([train.path], tmp_path / "c", only_bigrams_of=[val.path], progress=False)


def test_cli_and_pipeline_config_restrict_to_the_run_store(tmp_path, capsys):
    from pipeline.cli import main
    from pipeline.runner.config_file import load_pipeline_config
    from pipeline.runner.stages_run import Pipeline

    train = store_at(tmp_path / "run" / "tokens" / "train", [[1, 2, 3, 1, 2, 4]], vocab_size=10)
    val = store_at(tmp_path / "run" / "tokens" / "val", [[1, 2, 5]], vocab_size=10)
    out = tmp_path / "c"
    argv = ["count", "--tokens", str(train.path), "--only-bigrams-of", str(val.path)]
    assert main([*argv, "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    # val pairs (1,2) (2,5) (5,0): (1,2) seen twice in training, the others never
    assert "2 pairs, 1 distinct bigrams" in printed and "2 of their 3 never seen" in printed
    assert rows_of(out) == [(1, 2, 2)]
    config = tmp_path / "p.toml"
    config.write_text(f'run_dir = "{tmp_path / "run"}"\n[count]\nonly_bigrams_of = ["val"]\n')
    cfg = Pipeline(config, load_pipeline_config(config)).configs("count")["count"]
    assert cfg.only_bigrams_of == [str(val.path)] and cfg.tokens == [str(train.path)]
    meta = read_json(out / "meta.json")
    assert meta["only_bigrams_of"][0]["path"] == str(val.path.resolve())


def test_tag_workers_share_the_table_the_stage_built_once(tmp_path, monkeypatch):
    """The stage builds the counts' table once, before its workers fork; a worker that opened
    the counts again (a copy of the table per worker) fails here."""
    from ar_slicing.algorithms.counts import BigramCounts
    from pipeline.tag import TagConfig, run_tag

    rng = np.random.default_rng(5)
    train = store_at(tmp_path / "train", zipf_docs(rng, 100, 3000), vocab_size=3000)
    val = store_at(tmp_path / "val", zipf_docs(rng, 60, 3000), vocab_size=3000)
    count_stores([train.path], tmp_path / "c", only_bigrams_of=[val.path], progress=False)
    real_open = BigramCounts.open.__func__
    opened = []

    def open_once(cls, path):
        assert not opened, "the counts were opened again, by a worker"
        opened.append(path)
        return real_open(cls, path)

    monkeypatch.setattr(BigramCounts, "open", classmethod(open_once))
    cfg = TagConfig(
        tokens=str(val.path), counts=str(tmp_path / "c"), out=str(tmp_path / "t"), window=64
    )
    meta = run_tag(dataclasses.replace(cfg, workers=2, part_tokens=1000))
    assert meta["counts"]["parts"] > 4 and len(opened) == 1
