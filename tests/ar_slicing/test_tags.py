"""AR tags against a naive reference: the docs/design.md example, property tests, edge cases, the stage."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.counts import BigramCounts
from ar_slicing.algorithms.tags import TAG_COLUMNS, DocTable, tag_windows
from ar_slicing.data.store import write_token_store
from ar_slicing.errors import ArSliceError, BadInput, TokenizerMismatch
from ar_slicing.machinery.io import build_meta, read_json, stable_meta, write_meta
from pipeline.count import store_record
from pipeline.tag import TagConfig, run_tag
from tests.reliability import as_killed

FP = "f" * 64


# ---- the reference, written plainly --------------------------------------------------------------


def naive_match_len(stream, doc_of, window, reset_at_doc_boundary) -> list[int]:
    """match_len of every target (index i - 1 for stream index i), in O(L^2) per window, straight
    from docs/copy-length.md: the largest m >= 1 with some earlier j such that S[j-m..j] equals
    S[i-m..i] and neither starts before the window (with the reset: before the token ahead of
    i's document)."""
    starts = {}
    for k, d in enumerate(doc_of):
        starts.setdefault(d, k)
    out = []
    for i in range(1, len(stream)):
        lo = (i - 1) // window * window
        if reset_at_doc_boundary:
            lo = max(lo, starts[doc_of[i]] - 1)
        best = 0
        for j in range(lo + 1, i):
            m = 0
            while j - m - 1 >= lo and stream[j - m - 1 : j + 1] == stream[i - m - 1 : i + 1]:
                m += 1
            best = max(best, m)
        out.append(best)
    return out


def naive_tags(
    documents,
    subsets,
    eos,
    window,
    counts,
    threshold,
    reset_at_doc_boundary,
    span_order=1,
    train_stream=(),
):
    """One dict per target, straight from docs/design.md: scan the earlier targets of each window.
    `span_train_count` counts the (min(match_len, span_order) + 1)-gram ending at the target in
    `train_stream` (the bigram's count from `counts` for order 2)."""
    stream, doc_of = [], []
    for d, doc in enumerate(documents):
        for t in [*doc, eos]:
            stream.append(t)
            doc_of.append(d)
    match_len = naive_match_len(stream, doc_of, window, reset_at_doc_boundary)
    grams = Counter(
        tuple(train_stream[t - n + 1 : t + 1])
        for n in range(3, span_order + 2)
        for t in range(n - 1, len(train_stream))
    )
    rows = []
    for i in range(1, len(stream)):
        w = (i - 1) // window
        pos = i - w * window
        bigram = (stream[i - 1], stream[i])
        prev_pos = None
        for j in range(w * window + 1, i):
            if (stream[j - 1], stream[j]) == bigram:
                if reset_at_doc_boundary and doc_of[j] != doc_of[i]:
                    continue
                prev_pos = j - w * window
        count = counts.get(bigram, 0)
        rows.append(
            {
                "window_id": w,
                "pos": pos,
                "doc_id": doc_of[i],
                "token": stream[i],
                "prev": stream[i - 1],
                "train_count": count,
                "prev_pos": prev_pos,
                "is_repeat": prev_pos is not None,
                "is_ar_hit": prev_pos is not None and count <= threshold,
                "subset": subsets[doc_of[i]],
                "match_len": match_len[i - 1],
                "span_train_count": None
                if prev_pos is None
                else count
                if min(match_len[i - 1], span_order) == 1
                else grams[tuple(stream[i - min(match_len[i - 1], span_order) : i + 1])],
            }
        )
    return rows


# ---- real inputs: a token store and a counts directory on disk ----------------------------------


def write_counts(out_dir, pairs: Counter, fingerprint=FP, sources=()):
    """A counts directory as the count stage lays it out (bigrams.parquet sorted, meta.json);
    `sources`: the training stores it names (their span n-grams are counted by the tag stage)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    items = sorted(pairs.items())
    table = pa.table(
        {
            "prev": pa.array([p for (p, _), _ in items], pa.int32()),
            "next": pa.array([n for (_, n), _ in items], pa.int32()),
            "count": pa.array([c for _, c in items], pa.int64()),
        }
    )
    pq.write_table(table, out_dir / "bigrams.parquet")
    total = sum(pairs.values())
    meta = build_meta(
        "count",
        config={},
        inputs={},
        counts={"pairs": total},
        wall_time_s=0.0,
        fingerprint=fingerprint,
        total_pairs=total,
        distinct_bigrams=len(items),
        unit="stream",
        sources=[store_record(s) for s in sources],
    )
    write_meta(out_dir, meta)
    return out_dir


def make_store(path, documents, *, vocab_size, eos, subsets=None, fingerprint=FP):
    info = {"name": "test", "fingerprint": fingerprint, "vocab_size": vocab_size, "eos_id": eos}
    return write_token_store(path, documents, tokenizer_info=info, subsets=subsets)


def read_tags(out_dir) -> list[dict]:
    parts = sorted(Path(out_dir).glob("tags-*.parquet"))
    if not parts:
        return []
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    return table.to_pylist()


def doc_table(documents, subsets):
    lengths = np.array([len(d) + 1 for d in documents], dtype=np.int64)
    names = tuple(sorted({s for s in subsets if s is not None}))
    return DocTable(
        offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64),
        doc_ids=np.arange(len(documents), dtype=np.int64),
        subset_code=np.array([names.index(s) if s is not None else -1 for s in subsets], np.int32),
        subset_names=names,
    )


def dict_lookup(counts):
    def lookup(prev, nxt):
        return np.array([counts.get((int(p), int(n)), 0) for p, n in zip(prev, nxt)], np.int64)

    return lookup


def counts_table(counts) -> BigramCounts:
    """The table the stage looks counts up in, made from a dict {(prev, next): count}."""
    items = sorted(counts.items())
    columns = [np.array(c, np.int64).reshape(-1) for c in zip(*[(p, n, c) for (p, n), c in items])]
    return BigramCounts(*(columns or [np.zeros(0, np.int64)] * 3), meta={})


def core_rows(
    documents,
    subsets,
    eos,
    window,
    counts,
    threshold,
    reset,
    batch_windows,
    vocab_size,
    lookup="dict",
):
    """tag_windows over the stream in batches of `batch_windows`, as rows like naive_tags'.

    `lookup`: "dict" looks counts up through a plain function, "table" through the `BigramCounts`
    table the stage uses (which the compiled pass probes itself).
    """
    stream = np.array([t for doc in documents for t in [*doc, eos]], dtype=np.int64)
    docs = doc_table(documents, subsets)
    lookup = dict_lookup(counts) if lookup == "dict" else counts_table(counts)
    n_win = -(-(len(stream) - 1) // window) if len(stream) >= 2 else 0
    rows = []
    for w in range(0, n_win, batch_windows):
        end = min(w + batch_windows, n_win)
        cols = tag_windows(
            stream[w * window : min(end * window + 1, len(stream))],
            w,
            window,
            docs=docs,
            lookup=lookup,
            threshold=threshold,
            vocab_size=vocab_size,
            reset_at_doc_boundary=reset,
        )
        for k in range(len(cols["pos"])):
            row = {name: cols[name][k].item() for name in TAG_COLUMNS}
            row["prev_pos"] = row["prev_pos"] or None
            if not row["is_repeat"]:
                row["span_train_count"] = None
            code = row["subset"]
            row["subset"] = docs.subset_names[code] if code >= 0 else None
            rows.append(row)
    return rows


# ---- the docs/design.md worked example -------------------------------------------------------------------

EXAMPLE = [5, 6, 7, 8, 5, 6, 9, 5]  # + EOS 6 gives the stream 5 6 7 8 5 6 9 5 6


@pytest.mark.parametrize("count, hits", [(10, [5, 8]), (3000, [])])
def test_design_example_through_the_stage(tmp_path, count, hits):
    store = make_store(tmp_path / "val", [EXAMPLE], vocab_size=10, eos=6)
    counts = write_counts(tmp_path / "counts", Counter({(5, 6): count, (6, 7): 1}))
    run_tag(
        TagConfig(
            tokens=str(store.path),
            counts=str(counts),
            out=str(tmp_path / "tags"),
            window=8,
            workers=1,
            span_order=1,  # hand-made counts: no training store to count spans in
        )
    )
    rows = read_tags(tmp_path / "tags")
    assert [r["pos"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["token"] for r in rows] == [6, 7, 8, 5, 6, 9, 5, 6]
    assert [r["prev"] for r in rows] == [5, 6, 7, 8, 5, 6, 9, 5]
    assert [r["pos"] for r in rows if r["is_repeat"]] == [5, 8]
    assert [r["prev_pos"] for r in rows] == [None, None, None, None, 1, None, None, 5]
    assert [r["train_count"] for r in rows] == [count, 1, 0, 0, count, 0, 0, count]
    assert [r["pos"] for r in rows if r["is_ar_hit"]] == hits
    meta = read_json(tmp_path / "tags" / "meta.json")
    assert meta["counts"]["tokens"] == 8
    assert meta["counts"]["repeats"] == 2
    assert meta["counts"]["ar_hits"] == len(hits)


def test_threshold_is_inclusive_and_unseen_bigrams_qualify():
    docs = [[5, 6, 7, 8, 5, 6, 9, 5]]
    for count, hit in [(1250, True), (1251, False), (0, True)]:
        rows = core_rows(docs, [None], 6, 8, {(5, 6): count}, 1250, False, 1, 10)
        assert [r["is_ar_hit"] for r in rows if r["is_repeat"]] == [hit, hit]


# ---- property tests against the reference -------------------------------------------------------------

documents_st = st.lists(st.lists(st.integers(1, 4), max_size=12), min_size=1, max_size=8)


@st.composite
def cases(draw, max_vocab=5):
    documents = draw(documents_st)
    subsets = draw(
        st.lists(
            st.sampled_from(["Pile-CC", "Github", None]),
            min_size=len(documents),
            max_size=len(documents),
        )
    )
    window = draw(st.integers(1, 12))
    bigrams = [(p, n) for p in range(max_vocab) for n in range(max_vocab)]
    counts = draw(st.dictionaries(st.sampled_from(bigrams), st.integers(0, 30), max_size=12))
    threshold = draw(st.integers(0, 30))
    reset = draw(st.booleans())
    return documents, subsets, window, counts, threshold, reset


@pytest.mark.parametrize("lookup", ["dict", "table"])
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases(), batch_windows=st.integers(1, 4))
def test_core_matches_naive_reference(case, batch_windows, lookup, engine):
    documents, subsets, window, counts, threshold, reset = case
    expected = naive_tags(documents, subsets, 0, window, counts, threshold, reset)
    got = core_rows(
        documents, subsets, 0, window, counts, threshold, reset, batch_windows, 5, lookup
    )
    assert got == expected


@pytest.mark.parametrize(
    "vocab_size",
    [
        2**20,  # above 16 bits: one sort of packed (bigram, index) keys
        2**31,  # too large to pack beside the index: the batch's own ids are ranked first
    ],
)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_core_with_large_vocabularies(vocab_size, case, engine):
    documents, subsets, window, counts, threshold, reset = case
    top = vocab_size - 1
    documents = [[top - t for t in doc] for doc in documents]
    counts = {(top - p, top - n): c for (p, n), c in counts.items()}
    expected = naive_tags(documents, subsets, 0, window, counts, threshold, reset)
    for lookup in ("dict", "table"):
        got = core_rows(
            documents, subsets, 0, window, counts, threshold, reset, 2, vocab_size, lookup
        )
        assert got == expected


@pytest.mark.parametrize("top", [2**16 - 1, 2**16])  # 16-bit ids (per-prev regions) or wider
@pytest.mark.parametrize("shuffled", [False, True])  # as the count stage writes it, or not sorted
def test_counts_table_read_in_row_groups(tmp_path, engine, top, shuffled):
    rng = np.random.default_rng(5)
    pairs = Counter()
    for p, n, c in zip(rng.integers(0, 40, 300), rng.integers(0, 40, 300), rng.integers(1, 9, 300)):
        pairs[(int(p), int(n))] += int(c)
    pairs[(top, top)] = 3 << 20
    pairs[(7, top)] = 1
    out = write_counts(tmp_path / "counts", pairs)
    table = pq.read_table(out / "bigrams.parquet")
    if shuffled:
        table = table.take(rng.permutation(table.num_rows))
    pq.write_table(table, out / "bigrams.parquet", row_group_size=7)  # prevs straddle groups
    assert pq.ParquetFile(out / "bigrams.parquet").num_row_groups > 10
    counts = BigramCounts.open(out)
    assert (len(counts), counts.total_pairs) == (len(pairs), sum(pairs.values()))
    queries = [*pairs, (top, 0), (0, top), (41, 3), (3, 41), (-1, 2), (2, 1 << 40)]
    prev, nxt = (np.array(q, np.int64) for q in zip(*queries))
    assert counts.lookup(prev, nxt).tolist() == [pairs.get(q, 0) for q in queries]


def test_reused_column_buffers_give_the_same_columns():
    from ar_slicing.algorithms.tags import column_buffers

    rng = np.random.default_rng(3)
    documents = [list(rng.integers(1, 6, size=int(k))) for k in rng.integers(0, 40, size=12)]
    stream = np.array([t for doc in documents for t in [*doc, 0]], np.int64)
    docs = doc_table(documents, [None] * len(documents))
    counts = counts_table({(1, 2): 3, (2, 0): 9})
    out = column_buffers(64)
    for window, first, n_windows in [(8, 0, 8), (5, 3, 4), (8, 2, 3), (3, 1, 21)]:
        args = (stream[first * window : (first + n_windows) * window + 1], first, window)
        kwargs = dict(docs=docs, lookup=counts, threshold=5, vocab_size=6)
        fresh = tag_windows(*args, **kwargs)
        reused = tag_windows(*args, **kwargs, out=out)
        for name in TAG_COLUMNS:
            assert np.array_equal(fresh[name], reused[name]), (window, name)


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(BadInput, match="token id 12 .* outside the vocabulary of 10"):
        core_rows([[1, 12, 3]], [None], 0, 4, {}, 5, False, 1, 10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), part_tokens=st.integers(1, 40))
def test_stage_output_matches_naive_reference(case, part_tokens):
    documents, subsets, window, counts, threshold, reset = case
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = make_store(tmp / "val", documents, vocab_size=5, eos=0, subsets=subsets)
        write_counts(tmp / "counts", Counter(counts))
        cfg = TagConfig(
            tokens=str(store.path),
            counts=str(tmp / "counts"),
            out=str(tmp / "tags"),
            window=window,
            threshold=threshold,
            reset_at_doc_boundary=reset,
            workers=1,
            part_tokens=part_tokens,
            span_order=1,
        )
        if store.n_tokens < 2:  # no target at all: refused, and no output directory is left
            with pytest.raises(ArSliceError, match="nothing to tag"):
                run_tag(cfg)
            assert not (tmp / "tags").exists()
            return
        meta = run_tag(cfg)
        expected = naive_tags(documents, subsets, 0, window, counts, threshold, reset)
        assert read_tags(tmp / "tags") == expected
        windows = pq.read_table(tmp / "tags" / "windows.parquet").to_pylist()
        per_window = Counter(r["window_id"] for r in expected)
        assert windows == [
            {"window_id": w, "start": w * window, "n_targets": per_window[w]}
            for w in sorted(per_window)
        ]
        assert meta["counts"]["tokens"] == len(expected)
        assert meta["counts"]["repeats"] == sum(r["is_repeat"] for r in expected)
        assert meta["counts"]["ar_hits"] == sum(r["is_ar_hit"] for r in expected)
        for s in meta["counts"]["by_subset"]:
            mine = [r for r in expected if r["subset"] == s["subset"]]
            assert (s["tokens"], s["repeats"], s["ar_hits"]) == (
                len(mine),
                sum(r["is_repeat"] for r in mine),
                sum(r["is_ar_hit"] for r in mine),
            )


# ---- edge cases, spelled out -------------------------------------------------------------------------


def check_against_naive(documents, window, reset=False, subsets=None, counts=None, threshold=2):
    subsets = subsets or [None] * len(documents)
    counts = counts or {}
    expected = naive_tags(documents, subsets, 0, window, counts, threshold, reset)
    assert core_rows(documents, subsets, 0, window, counts, threshold, reset, 3, 10) == expected
    return expected


def test_last_partial_window_keeps_its_targets_and_finds_repeats():
    # 11 tokens + EOS = 12 stream tokens = 11 targets: windows of 4, 4 and a last one of 3
    rows = check_against_naive([[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9]], 4)
    assert [r["pos"] for r in rows if r["window_id"] == 2] == [1, 2, 3]
    assert [r["token"] for r in rows if r["window_id"] == 2] == [9, 9, 0]
    assert [r["prev_pos"] for r in rows if r["window_id"] == 2] == [None, 1, None]


def test_window_of_one_has_no_repeats():
    rows = check_against_naive([[1, 1, 1, 1], [1, 1]], 1)
    assert not any(r["is_repeat"] for r in rows)
    assert [r["window_id"] for r in rows] == list(range(len(rows)))


def test_window_of_two_repeats_only_inside_the_pair():
    rows = check_against_naive([[1, 1, 1, 1, 1]], 2)
    # stream 1 1 1 1 1 0: windows of targets (1, 1) | (1, 1) | (0): pos 2 repeats pos 1
    assert [r["prev_pos"] for r in rows] == [None, 1, None, 1, None]


def test_stream_shorter_than_one_window():
    rows = check_against_naive([[3, 4, 3, 4]], 2048)
    assert [r["prev_pos"] for r in rows] == [None, None, 1, None]


def test_eos_at_window_boundaries_is_a_target_and_a_context_token():
    # stream 1 2 3 0 1 2 3 0 1 2 3 0 with L = 3: window 0 ends on an EOS target, window 1 reads
    # that EOS as context (its first bigram is EOS -> 1), window 2 starts with an EOS target
    docs = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    for reset in (False, True):
        rows = check_against_naive(docs, 3, reset=reset)
        by_window = [[r["token"] for r in rows if r["window_id"] == w] for w in range(4)]
        assert by_window == [[2, 3, 0], [1, 2, 3], [0, 1, 2], [3, 0]]
        assert [r["doc_id"] for r in rows] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def test_reset_at_doc_boundary_ignores_occurrences_in_earlier_documents():
    docs = [[7, 8], [7, 8]]  # stream 7 8 0 7 8 0: (7, 8) again at pos 4, (8, 0) at pos 5
    plain = check_against_naive(docs, 8)
    reset = check_against_naive(docs, 8, reset=True)
    assert [r["prev_pos"] for r in plain] == [None, None, None, 1, 2]
    assert [r["prev_pos"] for r in reset] == [None, None, None, None, None]


def test_streams_of_one_and_two_tokens(tmp_path):
    write_counts(tmp_path / "counts", Counter({(5, 0): 7}))
    # one empty document: the stream is just its EOS, no target: refused, not an empty result
    store = make_store(tmp_path / "one", [[]], vocab_size=10, eos=0)
    cfg = TagConfig(
        tokens=str(store.path), counts=str(tmp_path / "counts"), out=str(tmp_path / "t1"), workers=1
    )
    with pytest.raises(ArSliceError, match=r"1 token\(s\), so nothing to tag"):
        run_tag(cfg)
    assert not (tmp_path / "t1").exists()
    # two tokens: one window with one target
    store = make_store(tmp_path / "two", [[5]], vocab_size=10, eos=0)
    out = tmp_path / "tags-two"
    cfg = TagConfig(
        tokens=str(store.path),
        counts=str(tmp_path / "counts"),
        out=str(out),
        workers=1,
        span_order=1,
    )
    meta = run_tag(cfg)
    assert meta["counts"]["tokens"] == 1 == len(read_tags(out))
    assert pq.read_table(out / "windows.parquet").num_rows == 1
    assert read_tags(out)[0]["train_count"] == 7


# ---- the stage: real text, files, mismatch, resume, workers, CLI ------------------------------------


@pytest.fixture(scope="module")
def real_text_run(tmp_path_factory, bpe_tokenizer, stdlib_texts):
    """Stdlib sources tokenized by the trained BPE: 30 for training counts, 10 for validation."""
    from ar_slicing.data.tokenizer import describe

    info = describe(bpe_tokenizer, "bpe-1024")
    train = [bpe_tokenizer.encode(t).ids for t in stdlib_texts[:30]]
    val = [bpe_tokenizer.encode(t).ids[:3000] for t in stdlib_texts[30:40]]
    subsets = ["code" if k % 3 else "docs" for k in range(len(val))]
    tmp_path = tmp_path_factory.mktemp("real-text")
    store = write_token_store(tmp_path / "val", val, tokenizer_info=info, subsets=subsets)
    train_store = write_token_store(tmp_path / "train", train, tokenizer_info=info)
    train_stream = [t for doc in train for t in [*doc, info["eos_id"]]]
    pairs = Counter(zip(train_stream, train_stream[1:]))
    write_counts(tmp_path / "counts", pairs, info["fingerprint"], sources=[train_store])
    return store, tmp_path / "counts", val, subsets, pairs, info, train_stream


def in_small_parts(store, counts_dir, out, **settings) -> TagConfig:
    """The real text tagged in windows of 256 and parts of 2048 tokens (many parts), one worker."""
    settings = {"window": 256, "workers": 1, "part_tokens": 2048, **settings}
    return TagConfig(tokens=str(store.path), counts=str(counts_dir), out=str(out), **settings)


def test_real_text_matches_reference_and_is_plausible(tmp_path, real_text_run):
    store, counts_dir, val, subsets, pairs, info, train_stream = real_text_run
    out = tmp_path / "tags"
    meta = run_tag(
        TagConfig(
            tokens=str(store.path),
            counts=str(counts_dir),
            out=str(out),
            window=512,
            threshold=50,  # 30 training files: frequent bigrams are seen hundreds of times
            workers=1,
            part_tokens=4096,
        )
    )
    expected = naive_tags(val, subsets, info["eos_id"], 512, pairs, 50, False, 4, train_stream)
    assert max(r["match_len"] for r in expected) > 4  # spans of every order were counted
    assert read_tags(out) == expected
    repeats = meta["counts"]["repeats"] / meta["counts"]["tokens"]
    assert 0.05 < repeats < 0.9  # source code repeats itself, but not everywhere
    assert 0 < meta["counts"]["ar_hits"] < meta["counts"]["repeats"]
    assert meta["tokens"] == str(store.path.resolve())
    assert meta["counts_dir"] == str(counts_dir.resolve())
    assert meta["fingerprint"] == info["fingerprint"]
    assert (meta["window"], meta["threshold"], meta["reset_at_doc_boundary"]) == (512, 50, False)
    assert {s["subset"] for s in meta["counts"]["by_subset"]} == {"code", "docs"}
    schema = pq.read_schema(out / "tags-00000.parquet")
    assert [(f.name, str(f.type)) for f in schema] == [
        ("window_id", "int32"),
        ("pos", "int32"),
        ("doc_id", "int64"),
        ("token", "int32"),
        ("prev", "int32"),
        ("train_count", "int64"),
        ("prev_pos", "int32"),
        ("is_repeat", "bool"),
        ("is_ar_hit", "bool"),
        ("subset", "string"),
        ("match_len", "int32"),
        ("span_train_count", "int64"),
    ]
    assert meta["span_order"] == 4 and meta["span_counts"]["unit"] == "stream"
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert files == sorted(["meta.json", "windows.parquet", *meta["parts"]])


def test_two_workers_write_the_same_files_as_one(tmp_path, real_text_run):
    store, counts_dir, *_ = real_text_run
    metas = []
    for workers in (1, 2):
        cfg = in_small_parts(store, counts_dir, tmp_path / f"w{workers}", workers=workers)
        metas.append(run_tag(cfg))
    parts = metas[0]["parts"]
    assert len(parts) > 2
    for name in [*parts, "windows.parquet"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    drop = ("config", "created_at", "wall_time_s", "throughput")
    assert {k: v for k, v in metas[0].items() if k not in drop} == {
        k: v for k, v in metas[1].items() if k not in drop
    }


def test_store_and_counts_of_different_tokenizers_are_refused(tmp_path):
    store = make_store(tmp_path / "val", [[1, 2, 3]], vocab_size=10, eos=0, fingerprint="a" * 64)
    write_counts(tmp_path / "counts", Counter({(1, 2): 3}), fingerprint="b" * 64)
    with pytest.raises(TokenizerMismatch) as err:
        run_tag(
            TagConfig(
                tokens=str(store.path),
                counts=str(tmp_path / "counts"),
                out=str(tmp_path / "tags"),
                workers=1,
            )
        )
    message = str(err.value)
    assert str(store.path) in message and str(tmp_path / "counts") in message
    assert "aaaaaaaaaaaa" in message and "bbbbbbbbbbbb" in message
    assert not (tmp_path / "tags").exists()


def test_resume_after_interruption_gives_identical_output(tmp_path, real_text_run):
    store, counts_dir, *_ = real_text_run
    out = tmp_path / "tags"
    cfg = in_small_parts(store, counts_dir, out)
    first = run_tag(cfg)
    saved = tmp_path / "saved"
    shutil.copytree(out, saved)
    # what a kill leaves behind: the run's plan and ledger but no meta.json, some parts missing,
    # one half-written temporary part
    as_killed(out)
    parts = first["parts"]
    (out / parts[1]).unlink()
    (out / parts[-1]).unlink()
    (out / f".{parts[1]}.12345.tmp").write_bytes(b"PAR1 half a file")
    pq.write_table(pq.read_table(out / parts[2]).slice(0, 10), out / parts[2])  # wrong length
    again = run_tag(cfg)
    assert again["skipped"] == {"parts_already_complete": len(parts) - 3}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in saved.iterdir())
    for name in [*parts, "windows.parquet"]:
        assert (out / name).read_bytes() == (saved / name).read_bytes()
    keep = ("skipped",)
    assert {k: v for k, v in stable_meta(again).items() if k not in keep} == {
        k: v for k, v in stable_meta(first).items() if k not in keep
    }
    # a complete directory is skipped, and --overwrite redoes it
    assert run_tag(cfg)["created_at"] == again["created_at"]
    redone = run_tag(TagConfig(**{**cfg.__dict__, "overwrite": True}))
    assert redone["skipped"] == {"parts_already_complete": 0}


def test_changed_settings_on_a_complete_output_are_refused(tmp_path, real_text_run):
    """A finished tag directory is not "complete" for another threshold: refused, naming it."""
    store, counts_dir, *_ = real_text_run
    out = tmp_path / "tags"
    cfg = TagConfig(tokens=str(store.path), counts=str(counts_dir), out=str(out), workers=1)
    run_tag(TagConfig(**{**cfg.__dict__, "threshold": 8}))
    with pytest.raises(ArSliceError, match="settings.threshold: 8 -> 100(?s:.*)--overwrite"):
        run_tag(TagConfig(**{**cfg.__dict__, "threshold": 100}))
    assert read_json(out / "meta.json")["threshold"] == 8
    meta = run_tag(TagConfig(**{**cfg.__dict__, "threshold": 100, "overwrite": True}))
    assert meta["threshold"] == 100 and meta["plan"]["settings"]["threshold"] == 100


def test_unfinished_run_with_other_parameters_is_not_mixed_in(tmp_path, real_text_run):
    store, counts_dir, *_ = real_text_run
    out = tmp_path / "tags"
    cfg = in_small_parts(store, counts_dir, out)
    run_tag(cfg)
    as_killed(out)  # its plan and ledger, no meta.json
    other = TagConfig(**{**cfg.__dict__, "threshold": 5})
    with pytest.raises(ArSliceError, match="unfinished run(?s:.*)settings.threshold: 1250 -> 5"):
        run_tag(other)
    meta = run_tag(TagConfig(**{**other.__dict__, "overwrite": True}))
    assert meta["threshold"] == 5 and meta["skipped"] == {"parts_already_complete": 0}
    assert all(r["train_count"] <= 5 for r in read_tags(out) if r["is_ar_hit"])


def test_cli_prints_a_summary_and_refuses_mismatches_without_traceback(tmp_path):
    store = make_store(tmp_path / "val", [EXAMPLE], vocab_size=10, eos=6)
    write_counts(tmp_path / "counts", Counter({(5, 6): 10}))
    arslice = [sys.executable, "-m", "pipeline.cli", "tag"]
    ok = subprocess.run(
        [
            *arslice,
            "--tokens",
            str(store.path),
            "--counts",
            str(tmp_path / "counts"),
            "--out",
            str(tmp_path / "tags"),
            "--window",
            "8",
            "--workers",
            "1",
            "--span-order",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert (
        "8 tokens" in ok.stdout and "25.00% repeats" in ok.stdout and "25.00% AR hits" in ok.stdout
    )
    write_counts(tmp_path / "other", Counter({(5, 6): 10}), fingerprint="0" * 64)
    bad = subprocess.run(
        [
            *arslice,
            "--tokens",
            str(store.path),
            "--counts",
            str(tmp_path / "other"),
            "--out",
            str(tmp_path / "t2"),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "tokenizer mismatch" in bad.stderr and "Traceback" not in bad.stderr


def test_counts_made_by_the_count_stage_are_used_as_written(tmp_path, real_text_run):
    from pipeline.count import count_stores

    store, _, val, subsets, _, info, _ = real_text_run
    # count the validation store itself: every bigram of the stream is then seen in "training"
    count_stores([store.path], tmp_path / "counts", workers=1, progress=False)
    stream = [t for doc in val for t in [*doc, info["eos_id"]]]
    pairs = Counter(zip(stream, stream[1:]))
    cfg = TagConfig(
        tokens=str(store.path),
        counts=str(tmp_path / "counts"),
        out=str(tmp_path / "tags"),
        window=300,
        threshold=3,
        reset_at_doc_boundary=True,
        workers=1,
    )
    run_tag(cfg)
    rows = read_tags(tmp_path / "tags")
    assert rows == naive_tags(val, subsets, info["eos_id"], 300, pairs, 3, True, 4, stream)
    assert all(r["train_count"] >= 1 for r in rows)
