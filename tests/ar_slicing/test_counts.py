"""The count stage against a naive reference: `Counter(pairwise(stream))` over the concatenation."""

from __future__ import annotations

import tempfile
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.counts import BigramCounts, parse_unit
from ar_slicing.data.store import write_token_store
from ar_slicing.errors import ArSliceError, BadInput, TokenizerMismatch
from ar_slicing.machinery.executor import LocalExecutor
from ar_slicing.machinery.io import read_json, stable_meta
from pipeline.count import count_stores

FP = "a" * 64


def store_at(path, documents, *, vocab_size, eos=0, fingerprint=FP):
    info = {"name": "test", "fingerprint": fingerprint, "vocab_size": vocab_size, "eos_id": eos}
    return write_token_store(path, documents, tokenizer_info=info)


def stream_of(stores) -> list[int]:
    return [int(t) for s in stores for t in s.tokens]


def naive_counts(stream: list[int], row: int | None) -> Counter:
    """Pair i = (S[i], S[i+1]); row:N keeps it only when i and i+1 share a row of N tokens."""
    return Counter(
        pair for i, pair in enumerate(pairwise(stream)) if row is None or (i + 1) % row != 0
    )


def read_bigrams(out) -> dict:
    with open(Path(out) / "bigrams.parquet", "rb") as f:
        table = pq.read_table(f)
    prev, nxt, count = (table.column(c).to_pylist() for c in ("prev", "next", "count"))
    return {(p, n): c for p, n, c in zip(prev, nxt, count)}


def check_output(out, stream, row):
    expected = naive_counts(stream, row)
    with open(Path(out) / "bigrams.parquet", "rb") as f:
        table = pq.read_table(f)
    assert [str(t) for t in table.schema.types] == ["int32", "int32", "int64"]
    keys = list(zip(table.column("prev").to_pylist(), table.column("next").to_pylist()))
    assert keys == sorted(expected), (
        "bigrams.parquet must be sorted by (prev, next), one row per pair"
    )
    assert read_bigrams(out) == dict(expected)
    meta = read_json(Path(out) / "meta.json")
    assert meta["total_pairs"] == sum(expected.values()) == sum(table.column("count").to_pylist())
    assert meta["distinct_bigrams"] == len(expected)
    assert not (Path(out) / ".work").exists()
    return meta


# ---- property tests against the naive reference -----------------------------------------------


@st.composite
def corpora(draw):
    """1-3 stores of random documents, uint16 or uint32 (vocabulary above 65536), a unit, a shard size."""
    wide = draw(st.booleans())
    vocab = (
        draw(st.sampled_from([70_000, 1 << 18])) if wide else draw(st.sampled_from([3, 50, 65_536]))
    )
    token = st.integers(0, vocab - 1)
    n_stores = draw(st.integers(1, 3))
    stores = [
        draw(st.lists(st.lists(token, max_size=30), min_size=1, max_size=6))
        for _ in range(n_stores)
    ]
    unit = draw(st.sampled_from(["stream", "row:2", "row:3", "row:7", "row:64"]))
    shard_tokens = draw(st.sampled_from([2, 3, 5, 17, 1 << 20]))
    return vocab, stores, unit, shard_tokens


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=corpora())
def test_counts_equal_counter_of_pairwise_stream(engine, case):
    vocab, documents_per_store, unit, shard_tokens = case
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        stores = [
            store_at(tmp / f"s{i}", docs, vocab_size=vocab, eos=vocab - 1)
            for i, docs in enumerate(documents_per_store)
        ]
        expected_dtype = "uint16" if vocab <= 1 << 16 else "uint32"
        assert all(s.dtype.name == expected_dtype for s in stores)
        if sum(s.n_tokens for s in stores) < 2:  # no pair at all: refused, nothing written
            with pytest.raises(BadInput, match="no bigram to count"):
                count_stores([s.path for s in stores], tmp / "counts", workers=1, progress=False)
            assert not (tmp / "counts").exists()
            return
        count_stores(
            [s.path for s in stores],
            tmp / "counts",
            unit=unit,
            shard_tokens=shard_tokens,
            workers=1,
            progress=False,
        )
        stream = stream_of(stores)
        meta = check_output(tmp / "counts", stream, parse_unit(unit))
        assert meta["unit"] == unit and meta["fingerprint"] == FP
        assert [s["n_tokens"] for s in meta["sources"]] == [s.n_tokens for s in stores]
        counts = BigramCounts.open(tmp / "counts")
        expected = naive_counts(stream, parse_unit(unit))
        pairs = list(expected) + [(vocab - 1, vocab - 1), (0, 1), (1, 0)]
        prev = np.array([p for p, _ in pairs], dtype=np.int64)
        nxt = np.array([n for _, n in pairs], dtype=np.int64)
        assert counts.lookup(prev, nxt).tolist() == [expected.get(p, 0) for p in pairs]


def test_worked_example_and_row_unit(tmp_path):
    # stream 5 6 7 | 5 6 0 (EOS 0 after each document): pairs (5,6)x2 (6,7) (7,0) (0,5) (6,0)
    store = store_at(tmp_path / "s", [[5, 6, 7], [5, 6]], vocab_size=10, eos=0)
    assert stream_of([store]) == [5, 6, 7, 0, 5, 6, 0]
    count_stores([store.path], tmp_path / "c", progress=False)
    assert read_bigrams(tmp_path / "c") == {(0, 5): 1, (5, 6): 2, (6, 0): 1, (6, 7): 1, (7, 0): 1}
    # rows of 3 tokens: [5 6 7] [0 5 6] [0]: the pairs (7,0) and (6,0) straddle rows
    count_stores([store.path], tmp_path / "r", unit="row:3", progress=False)
    assert read_bigrams(tmp_path / "r") == {(0, 5): 1, (5, 6): 2, (6, 7): 1}


# ---- shards, workers, several stores ---------------------------------------------------------


def test_many_shards_and_workers_equal_single_pass(tmp_path, engine):
    rng = np.random.default_rng(0)
    # Zipf-like ids so some pairs repeat across shards and some occur once
    docs = [(rng.zipf(1.3, size=rng.integers(1, 400)) % 3000).tolist() for _ in range(60)]
    store = store_at(tmp_path / "s", docs, vocab_size=3001, eos=3000)
    single = count_stores([store.path], tmp_path / "one", shard_tokens=1 << 30, progress=False)
    sharded = count_stores(
        [store.path], tmp_path / "many", shard_tokens=97, workers=2, progress=False
    )
    assert sharded["counts"]["shards"] > 50 and single["counts"]["shards"] == 1
    assert read_bigrams(tmp_path / "many") == read_bigrams(tmp_path / "one")
    check_output(tmp_path / "many", stream_of([store]), None)
    for name in ("total_pairs", "distinct_bigrams", "fingerprint"):
        assert sharded[name] == single[name]


def test_many_reduce_ranges_and_batches_equal_one(tmp_path, engine, monkeypatch):
    """Reduce ranges of a few hundred entries: many Parquet parts joined into bigrams.parquet,
    each range merged from its partials in several batches."""
    import ar_slicing.algorithms.counts.reduce as reduce_module

    rng = np.random.default_rng(1)
    docs = [(rng.zipf(1.2, size=rng.integers(1, 300)) % 4000).tolist() for _ in range(80)]
    store = store_at(tmp_path / "s", docs, vocab_size=4001, eos=4000)
    whole = count_stores([store.path], tmp_path / "one", shard_tokens=500, progress=False)
    assert whole["counts"]["reduce_ranges"] == 1
    monkeypatch.setattr(reduce_module, "REDUCE_RANGE_ENTRIES", 300)
    split = count_stores(
        [store.path], tmp_path / "many", shard_tokens=500, workers=2, progress=False
    )
    assert split["counts"]["reduce_ranges"] > 10
    check_output(tmp_path / "many", stream_of([store]), None)
    assert read_bigrams(tmp_path / "many") == read_bigrams(tmp_path / "one")
    meta = pq.read_metadata(tmp_path / "many" / "bigrams.parquet")
    assert meta.num_row_groups >= split["counts"]["reduce_ranges"] - 1  # empty parts add none
    assert set(meta.metadata) == {b"ARROW:schema"}


def test_counts_of_255_and_more_in_a_shard(tmp_path, engine, monkeypatch):
    """Partials keep counts in one byte and escape the larger ones: repeated pairs in several
    `prev` buckets, counted in shards, ranges and merge batches that split the escapes."""
    import ar_slicing.algorithms.counts.reduce as reduce_module

    rng = np.random.default_rng(2)
    docs = []
    for prev in (0, 1, 100, 1000, 3000, 3999):
        docs.append([prev, 7] * int(rng.integers(250, 700)))  # (prev, 7) and (7, prev) repeat
        docs.append(rng.integers(0, 4000, size=300).tolist())
    docs.append([5] * 70_000)  # (5, 5) reaches 2**16 within one shard
    store = store_at(tmp_path / "s", docs, vocab_size=4001, eos=4000)
    stream = stream_of([store])
    monkeypatch.setattr(reduce_module, "REDUCE_RANGE_ENTRIES", 400)
    for shard_tokens in (1 << 20, 1500):
        out = tmp_path / f"c{shard_tokens}"
        meta = count_stores([store.path], out, shard_tokens=shard_tokens, workers=2, progress=False)
        check_output(out, stream, None)
        assert meta["counts"]["reduce_ranges"] > 3
    assert read_bigrams(tmp_path / "c1048576")[(5, 5)] == 69_999


def test_several_stores_equal_their_concatenation(tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 200, size=rng.integers(0, 50)).tolist() for _ in range(30)]
    whole = store_at(tmp_path / "whole", docs[:7] + [[]] + docs[7:], vocab_size=200)
    parts = [
        store_at(tmp_path / "p0", docs[:7], vocab_size=200),
        store_at(tmp_path / "p-eos", [[]], vocab_size=200),  # one empty document: just EOS
        store_at(tmp_path / "p1", docs[7:20], vocab_size=200),
        store_at(tmp_path / "p2", docs[20:], vocab_size=200),
    ]
    assert stream_of(parts) == stream_of([whole])
    for unit in ("stream", "row:11"):
        count_stores(
            [whole.path], tmp_path / f"whole-{unit}", unit=unit, shard_tokens=13, progress=False
        )
        count_stores(
            [p.path for p in parts],
            tmp_path / f"parts-{unit}",
            unit=unit,
            shard_tokens=13,
            progress=False,
        )
        assert read_bigrams(tmp_path / f"parts-{unit}") == read_bigrams(tmp_path / f"whole-{unit}")
    # the pair across a store boundary (EOS ending p-eos, first token of p1) is counted
    boundary = (0, next(d[0] for d in docs[7:] if d))
    assert read_bigrams(tmp_path / "parts-stream")[boundary] >= 1


def test_real_text_stream(tmp_path, stdlib_texts, bpe_tokenizer, bpe_tokenizer_path):
    from ar_slicing.data.tokenizer import describe

    info = describe(bpe_tokenizer, "stdlib-bpe", eos_token="<|endoftext|>")
    docs = [e.ids for e in bpe_tokenizer.encode_batch(stdlib_texts[:20])]
    store = write_token_store(tmp_path / "s", docs, tokenizer_info=info)
    meta = count_stores([store.path], tmp_path / "c", shard_tokens=5_000, workers=2, progress=False)
    check_output(tmp_path / "c", stream_of([store]), None)
    assert meta["fingerprint"] == info["fingerprint"]
    counts = BigramCounts.open(tmp_path / "c")
    assert counts.fingerprint == info["fingerprint"] and counts.total_pairs == store.n_tokens - 1
    # a real bigram of Python source: "def" followed by " __" is common in the stdlib
    (def_id,) = bpe_tokenizer.encode("def").ids[:1]
    expected = naive_counts(stream_of([store]), None)
    frequent = max((c, p) for p, c in expected.items() if p[0] == def_id)
    assert counts.lookup(np.array([def_id]), np.array([frequent[1][1]]))[0] == frequent[0] > 10


# ---- refusals and errors ---------------------------------------------------------------------


def test_refuses_stores_of_different_tokenizers(tmp_path):
    a = store_at(tmp_path / "a", [[1, 2]], vocab_size=10, fingerprint="1" * 64)
    b = store_at(tmp_path / "b", [[1, 2]], vocab_size=10, fingerprint="2" * 64)
    with pytest.raises(TokenizerMismatch) as e:
        count_stores([a.path, b.path], tmp_path / "c", progress=False)
    assert str(a.path) in str(e.value) and str(b.path) in str(e.value)
    assert "111111111111" in str(e.value) and "222222222222" in str(e.value)
    assert not (tmp_path / "c" / "meta.json").exists()


@pytest.mark.parametrize("unit", ["rows:5", "row:1", "row:x", "doc", ""])
def test_bad_unit_is_refused(unit):
    with pytest.raises(BadInput, match="row:N"):
        parse_unit(unit)


def test_cli_runs_skips_and_reports_errors(tmp_path, capsys):
    from pipeline.cli import main

    store = store_at(tmp_path / "s", [[1, 2, 3, 1, 2]], vocab_size=10)
    out = tmp_path / "c"
    assert main(["count", "--tokens", str(store.path), "--out", str(out), "--workers", "1"]) == 0
    assert "5 pairs, 4 distinct bigrams" in capsys.readouterr().out  # (1,2)x2 (2,3) (3,1) (2,0)
    assert main(["count", "--tokens", str(store.path), "--out", str(out)]) == 0
    assert "is complete" in capsys.readouterr().out
    assert (
        main(["count", "--tokens", str(store.path), "--out", str(tmp_path / "d"), "--unit", "row"])
        == 2
    )
    assert "row:N" in capsys.readouterr().err
    assert main(["count", "--tokens", str(tmp_path / "nowhere"), "--out", str(tmp_path / "e")]) == 2
    assert "nowhere" in capsys.readouterr().err


# ---- lookup ----------------------------------------------------------------------------------


def write_counts_dir(tmp_path, pairs: dict, name="c"):
    """A counts directory written by the real stage from a store whose stream has these pairs."""
    stream = []
    for (p, n), c in pairs.items():
        stream += [p, n] * c
    vocab = max(max(p) for p in pairs) + 2
    store = store_at(tmp_path / f"{name}-store", [stream], vocab_size=vocab, eos=vocab - 1)
    count_stores([store.path], tmp_path / name, progress=False)
    return BigramCounts.open(tmp_path / name), naive_counts(stream_of([store]), None)


@pytest.mark.parametrize("wide", [False, True])
def test_lookup_matches_counts_including_unseen(tmp_path, wide, engine):
    rng = np.random.default_rng(2)
    base = 70_000 if wide else 0
    pairs = {
        (base + int(p), base + int(n)): int(c) for p, n, c in rng.integers(1, 60, size=(300, 3))
    }
    counts, expected = write_counts_dir(tmp_path, pairs)
    assert counts.shift == (32 if wide else 16)
    qp = rng.integers(base, base + 70, size=50_000)
    qn = rng.integers(base, base + 70, size=50_000)
    got = counts.lookup(qp, qn)
    assert got.dtype == np.int64
    want = np.array([expected.get((int(p), int(n)), 0) for p, n in zip(qp, qn)])
    np.testing.assert_array_equal(got, want)
    assert (got == 0).any() and (got > 0).any()
    # shapes are kept; ids outside the table's range (negative, huge) are simply unseen
    grid = counts.lookup(qp[:12].reshape(3, 4), qn[:12].reshape(3, 4))
    np.testing.assert_array_equal(grid, want[:12].reshape(3, 4))
    odd = counts.lookup(np.array([-1, base + 1, 1 << 40]), np.array([base + 1, -5, base + 1]))
    assert odd.tolist() == [0, 0, 0]
    assert len(counts) == len(expected) and counts.total_pairs == sum(expected.values())


def test_lookup_large_counts_and_empty_table(tmp_path, engine):
    import pyarrow as pa

    from tests.handmade import write_handmade_meta

    out = tmp_path / "big"
    out.mkdir()
    table = pa.table(
        {
            "prev": pa.array([1, 1, 7], pa.int32()),
            "next": pa.array([2, 3, 7], pa.int32()),
            "count": pa.array([5 << 33, 1, 3], pa.int64()),
        }
    )
    pq.write_table(table, out / "bigrams.parquet")
    write_handmade_meta(out, "count", fingerprint=FP)
    counts = BigramCounts.open(out)
    assert counts.lookup(np.array([1, 1, 7, 2]), np.array([2, 3, 7, 1])).tolist() == [
        5 << 33,
        1,
        3,
        0,
    ]

    # an empty table (restricted counts of bigrams never seen, say) looks everything up as 0
    (tmp_path / "empty").mkdir()
    pq.write_table(table.slice(0, 0), tmp_path / "empty" / "bigrams.parquet")
    write_handmade_meta(tmp_path / "empty", "count", fingerprint=FP)
    empty = BigramCounts.open(tmp_path / "empty")
    assert empty.lookup(np.arange(5), np.arange(5)).tolist() == [0] * 5
    # while counting a stream without one pair is refused, not an empty success
    store = store_at(tmp_path / "one", [[]], vocab_size=5)  # a stream of one token (EOS)
    with pytest.raises(BadInput, match="1 token\\(s\\), so no bigram to count"):
        count_stores([store.path], tmp_path / "none", progress=False)


def test_open_refuses_incomplete_dir(tmp_path):
    with pytest.raises(BadInput, match="arslice count"):
        BigramCounts.open(tmp_path)


# ---- resuming and reruns ---------------------------------------------------------------------


class StopAfter(LocalExecutor):
    """The local executor, interrupted (as by Ctrl-C) after `n` map tasks have finished."""

    def __init__(self, n):
        super().__init__(1)
        self.n = n

    def map_unordered(self, fn, tasks):
        for i, item in enumerate(super().map_unordered(fn, tasks), start=1):
            yield item
            if i == self.n:
                raise KeyboardInterrupt


def test_resume_after_interrupted_run_reuses_finished_shards(tmp_path):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 500, size=300).tolist() for _ in range(10)]
    store = store_at(tmp_path / "s", docs, vocab_size=501, eos=500)
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        count_stores(
            [store.path], out, shard_tokens=200, make_executor=lambda: StopAfter(4), progress=False
        )
    partials = sorted((out / ".work" / "partials").iterdir())
    assert len(partials) == 4 and not (out / "meta.json").exists()
    meta = count_stores([store.path], out, shard_tokens=200, progress=False)
    assert meta["counts"]["shards_resumed"] == 4 and meta["counts"]["shards"] == 16
    check_output(out, stream_of([store]), None)
    fresh = count_stores([store.path], tmp_path / "fresh", shard_tokens=200, progress=False)
    assert read_bigrams(out) == read_bigrams(tmp_path / "fresh")
    assert stable_meta(meta)["distinct_bigrams"] == fresh["distinct_bigrams"]

    # a rerun with other settings is refused, naming them; --overwrite discards the partials
    out2 = tmp_path / "c2"
    with pytest.raises(KeyboardInterrupt):
        count_stores(
            [store.path], out2, shard_tokens=200, make_executor=lambda: StopAfter(3), progress=False
        )
    with pytest.raises(
        ArSliceError, match='shard_tokens: 200 -> 300(?s:.*)unit: "stream" -> "row:50"'
    ):
        count_stores([store.path], out2, shard_tokens=300, unit="row:50", progress=False)
    assert len(list((out2 / ".work" / "partials").iterdir())) == 3  # untouched by the refusal
    meta2 = count_stores(
        [store.path], out2, shard_tokens=300, unit="row:50", overwrite=True, progress=False
    )
    assert meta2["counts"]["shards_resumed"] == 0
    check_output(out2, stream_of([store]), 50)


def test_complete_output_is_skipped_unless_overwrite(tmp_path):
    store = store_at(tmp_path / "s", [[1, 2, 3]], vocab_size=5)
    out = tmp_path / "c"
    first = count_stores([store.path], out, progress=False)
    mtime = (out / "bigrams.parquet").stat().st_mtime_ns
    again = count_stores([store.path], out, progress=False)
    assert again == first and (out / "bigrams.parquet").stat().st_mtime_ns == mtime
    redo = count_stores([store.path], out, overwrite=True, progress=False)
    assert stable_meta(redo) == stable_meta(first)


def test_uint16_and_uint32_stores_counted_together(tmp_path, engine):
    # same tokenizer fingerprint, one store imported as uint32: keys must use the wide layout
    narrow = store_at(tmp_path / "n", [[1, 2, 3], [60_000, 2]], vocab_size=65_536, eos=0)
    wide = store_at(tmp_path / "w", [[2, 70_000, 2], [1, 2]], vocab_size=70_001, eos=0)
    assert (narrow.dtype.name, wide.dtype.name) == ("uint16", "uint32")
    count_stores([narrow.path, wide.path], tmp_path / "c", shard_tokens=3, progress=False)
    check_output(tmp_path / "c", stream_of([narrow, wide]), None)
