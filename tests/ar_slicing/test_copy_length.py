"""Copy lengths and span counts (docs/copy-length.md): `match_len` against an O(L^2) reference,
restricted n-gram counts against a plain counter and EleutherAI's `tokengrams`, the tag stage's
`span_train_count` against counts made by hand, and the worked example."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.counts.ngrams import (
    NgramTable,
    SpanCountTask,
    count_span_task,
    span_lengths,
)
from ar_slicing.algorithms.tags import tag_windows
from ar_slicing.data.store import write_token_store
from ar_slicing.errors import ArSliceError
from pipeline.count import count_stores
from pipeline.tag import TagConfig, run_tag
from tests.ar_slicing.test_tags import (
    core_rows,
    dict_lookup,
    doc_table,
    naive_match_len,
    read_tags,
    write_counts,
)
from tests.pipeline.test_report import text_run  # noqa: F401  (a fixture)

FP = "c" * 64
SLOW_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def store_at(path, documents, *, vocab_size=10, eos=0, subsets=None, fingerprint=FP):
    info = {"name": "test", "fingerprint": fingerprint, "vocab_size": vocab_size, "eos_id": eos}
    return write_token_store(path, documents, tokenizer_info=info, subsets=subsets)


def stream_of(documents, eos):
    stream, doc_of = [], []
    for d, doc in enumerate(documents):
        for t in [*doc, eos]:
            stream.append(t)
            doc_of.append(d)
    return stream, doc_of


def naive_ngram_counts(stream, n, row=None) -> Counter:
    """Every n-gram of the stream (inside one row of `row` tokens, with a row unit)."""
    out = Counter()
    for t in range(n - 1, len(stream)):
        if row and (t - n + 1) // row != t // row:
            continue
        out[tuple(stream[t - n + 1 : t + 1])] += 1
    return out


# ---- match_len: the worked example and the reference ----------------------------------------------


def test_design_example(engine):
    """docs/copy-length.md: L = 8, stream 1 2 3 4 1 2 3 9 2; pos 5 copies 1 span, pos 6 two."""
    documents = [[1, 2, 3, 4, 1, 2, 3, 9]]  # + EOS 2
    stream = np.array([1, 2, 3, 4, 1, 2, 3, 9, 2])
    columns = tag_windows(
        stream,
        0,
        8,
        docs=doc_table(documents, [None]),
        lookup=dict_lookup({(1, 2): 7}),
        threshold=1250,
        vocab_size=10,
    )
    assert columns["match_len"].tolist() == [0, 0, 0, 0, 1, 2, 0, 0]
    assert columns["is_repeat"].tolist() == [m > 0 for m in [0, 0, 0, 0, 1, 2, 0, 0]]
    # span order 1: every span count is the bigram's
    assert columns["span_train_count"].tolist() == [0, 0, 0, 0, 7, 0, 0, 0]


@st.composite
def copying_documents(draw, vocab=4):
    """Documents made of random tokens and of copies of earlier stretches of the stream (so
    long copies, broken copies and many candidates of one bigram all occur)."""
    stream: list[int] = []
    documents = []
    for _ in range(draw(st.integers(1, 4))):
        doc: list[int] = []
        for _ in range(draw(st.integers(0, 6))):
            if stream and draw(st.booleans()):
                a = draw(st.integers(0, len(stream) - 1))
                b = draw(st.integers(a + 1, min(len(stream), a + 20)))
                piece = stream[a:b]
            else:
                piece = draw(st.lists(st.integers(1, vocab - 1), min_size=1, max_size=6))
            doc += piece
            stream += piece
        documents.append(doc)
        stream.append(0)
    return documents


@SLOW_SETTINGS
@given(
    documents=copying_documents(),
    window=st.integers(1, 40),
    reset=st.booleans(),
    batch_windows=st.integers(1, 3),
)
def test_match_len_matches_the_quadratic_reference(documents, window, reset, batch_windows, engine):
    stream, doc_of = stream_of(documents, 0)
    if len(stream) < 2:
        return
    expected = naive_match_len(stream, doc_of, window, reset)
    subsets = [None] * len(documents)
    rows = core_rows(documents, subsets, 0, window, {}, 0, reset, batch_windows, 4)
    assert [r["match_len"] for r in rows] == expected
    assert [r["is_repeat"] for r in rows] == [m > 0 for m in expected]


def test_a_copied_passage_counts_up_and_a_window_boundary_cuts_it(engine):
    passage = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    documents = [[*passage, 7, *passage]]
    rows = core_rows(documents, [None], 0, 64, {}, 0, False, 1, 10)
    # the copy's first token (3) repeats only as a unigram: its bigram (7, 3) is new
    assert [r["match_len"] for r in rows][10:21] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    # windows of 16: the second starts at stream index 16, after which nothing repeats in it
    short = core_rows(documents, [None], 0, 16, {}, 0, False, 1, 10)
    assert [r["match_len"] for r in short][10:21] == [0, 1, 2, 3, 4, 5, 0, 0, 0, 0, 0]


def test_reset_keeps_copies_inside_the_document(engine):
    # the second document repeats the first: a copy without the reset, nothing with it
    documents = [[1, 2, 3, 4], [1, 2, 3, 4]]
    plain = core_rows(documents, [None, None], 0, 16, {}, 0, False, 1, 10)
    reset = core_rows(documents, [None, None], 0, 16, {}, 0, True, 1, 10)
    assert [r["match_len"] for r in plain][4:9] == [0, 1, 2, 3, 4]
    assert [r["match_len"] for r in reset] == [0] * 9


# ---- restricted n-gram counts ----------------------------------------------------------------------


@st.composite
def ngram_cases(draw):
    vocab = draw(st.sampled_from([3, 6, 70_000]))
    token = st.integers(0, vocab - 1)
    train = draw(st.lists(token, min_size=1, max_size=300))
    val = draw(st.lists(token, min_size=1, max_size=80))
    K = draw(st.integers(2, 5))
    ends = draw(st.lists(st.integers(0, len(val) - 1), max_size=40))
    row = draw(st.sampled_from([None, 3, 7]))
    shard = draw(st.sampled_from([1, 5, 1 << 20]))
    return vocab, train, val, K, ends, row, shard


def _needed(val, K, ends) -> dict[tuple, None]:
    """The n-grams of orders 3..K+1 ending at each end (the suffix-closed set), in a dict."""
    return {
        tuple(val[t - n + 1 : t + 1]): None for t in ends for n in range(3, K + 2) if t >= n - 1
    }


@SLOW_SETTINGS
@given(case=ngram_cases())
def test_ngram_counts_match_a_plain_counter(case, engine, tmp_path_factory):
    vocab, train, val, K, ends, row, shard = case
    val_arr = np.array(val, np.uint16 if vocab <= 1 << 16 else np.uint32)
    ends = np.array([t for t in ends if t >= 2], np.int64)
    lengths = np.minimum(ends + 1, K + 1)
    table = NgramTable.empty(K, 4)
    table.add(val_arr, ends, lengths)
    rows_before = table.add(val_arr, ends, lengths)  # adding again adds nothing
    table.shrink()  # as the stage does before counting: the rows stay where they are
    assert (table.add(val_arr, ends, lengths) == rows_before).all()
    needed = _needed(val, K, ends.tolist())
    assert table.n_rows == len(needed)
    rows = {tuple(int(x) for x in r if x >= 0) for r in table.grams[: table.n_rows]}
    assert rows == set(needed)

    tmp = tmp_path_factory.mktemp("ngrams")
    # the training stream as two stores: n-grams across them count, as bigrams do
    cut = len(train) // 2
    stores = [
        store_at(tmp / "a", [train[:cut]], vocab_size=vocab, eos=train[0]),
        store_at(tmp / "b", [train[cut:]], vocab_size=vocab, eos=train[-1]),
    ]
    stream = [int(t) for s in stores for t in s.tokens]
    paths = tuple(str(s.path) for s in stores)
    counts = sum(
        count_span_task(SpanCountTask(paths, a, min(a + 50, len(stream)), row, K, shard), table)
        for a in range(0, len(stream), 50)
    )
    table.counts = counts
    naive = {n: naive_ngram_counts(stream, n, row) for n in range(3, K + 2)}
    for r, gram in enumerate(table.grams[: table.n_rows]):
        gram = tuple(int(x) for x in gram if x >= 0)
        assert counts[r] == naive[len(gram)][gram], gram
    # span counts of a batch whose targets copy those n-grams: target t - 1 ends at val[t]
    match_len = np.zeros(len(val) - 1, np.int32)
    match_len[ends - 1] = lengths - 1
    train_count = np.arange(len(val) - 1, dtype=np.int64) + 100
    got = table.span_counts(val_arr, match_len, train_count)
    for k in range(len(val) - 1):
        m = int(match_len[k])
        want = naive[m + 1][tuple(val[k + 1 - m : k + 2])] if m else 0
        assert got[k] == want, k
    # a one-bigram copy reads the bigram count; a span the table lacks reads -1, never another's
    if len(val) >= 4:
        match_len[:] = 0
        match_len[0] = 1
        absent = tuple(val[1:4]) not in needed
        match_len[2] = 2 if absent else 0
        got = table.span_counts(val_arr, match_len, train_count)
        assert got[0] == 100
        assert got[2] == (-1 if absent else 0)


def test_span_count_tasks_stay_under_the_uint32_counts_they_return(tmp_path):
    """A task's counts are uint32: no task covers 2**32 positions, however few the workers,
    and the tasks cover the stream once, in order."""
    from types import SimpleNamespace

    from ar_slicing.algorithms.counts.ngrams import TASK_POSITIONS, span_count_tasks

    stores = [SimpleNamespace(path=tmp_path / name, n_tokens=n) for name, n in
              [("a", 5 << 30), ("b", 7 << 30)]]  # fmt: skip
    for groups in (1, 2, 16):
        tasks = span_count_tasks(stores, None, 4, groups)
        assert all(t.stop - t.start <= TASK_POSITIONS for t in tasks)
        assert tasks[0].start == 0 and tasks[-1].stop == 12 << 30
        assert all(a.stop == b.start for a, b in zip(tasks, tasks[1:]))


@pytest.mark.parametrize("vocab", [65536, 70000])  # uint16 and uint32 files
def test_store_read_is_slice_from_the_file(tmp_path, vocab):
    """The training pass reads shards from the file; they are the store's tokens."""
    tokens = np.arange(1, 1000, dtype=np.int64) * 7919 % vocab
    store = store_at(tmp_path / "s", [tokens.tolist()], vocab_size=vocab)
    n = store.n_tokens
    for a, b in [(0, n), (0, 1), (5, 17), (n - 3, n), (n - 3, n + 10), (10, 10), (20, 10)]:
        got = store.read(a, b)
        assert got.dtype == store.dtype
        assert got.tolist() == store.slice(a, b).tolist(), (a, b)


def test_ngram_counts_match_tokengrams(tmp_path, bpe_tokenizer, stdlib_texts, engine):
    """Counts of real-text n-grams equal those of EleutherAI's suffix-array counter."""
    import tokengrams

    train = [t for text in stdlib_texts[:6] for t in [*bpe_tokenizer.encode(text).ids, 0]]
    val = [t for text in stdlib_texts[36:38] for t in [*bpe_tokenizer.encode(text).ids[:2000], 0]]
    store = store_at(tmp_path / "train", [train[:-1]], vocab_size=1024)
    K = 4
    val_arr = np.array(val, np.uint16)
    ends = np.arange(2, len(val), dtype=np.int64)
    table = NgramTable.empty(K, 1 << 10)
    table.add(val_arr, ends, np.minimum(ends + 1, K + 1))
    task = SpanCountTask((str(store.path),), 0, store.n_tokens, None, K, 1 << 12)
    counts = count_span_task(task, table)
    index = tokengrams.InMemoryIndex(np.array(train, np.uint16).tolist(), 1024)
    grams = [[int(x) for x in r if x >= 0] for r in table.grams[: table.n_rows]]
    assert counts.tolist() == [index.count(g) for g in grams]
    assert counts.sum() > 0 and (counts == 0).any()  # some seen in training, some new


# ---- the tag stage ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_stores(tmp_path_factory, bpe_tokenizer, stdlib_texts):
    """Stdlib sources: two training stores counted by the count stage, one validation store."""
    from ar_slicing.data.tokenizer import describe

    info = describe(bpe_tokenizer, "bpe-1024")
    tmp = tmp_path_factory.mktemp("copy-length")
    train = [[bpe_tokenizer.encode(t).ids for t in stdlib_texts[k : k + 10]] for k in (0, 10)]
    stores = [
        write_token_store(tmp / f"train{k}", d, tokenizer_info=info) for k, d in enumerate(train)
    ]
    val = [bpe_tokenizer.encode(t).ids[:2500] for t in stdlib_texts[30:36]]
    store = write_token_store(tmp / "val", val, tokenizer_info=info)
    return tmp, stores, store, val, info


def _train_stream(stores) -> list[int]:
    return [int(t) for s in stores for t in s.tokens]


@pytest.mark.parametrize("unit, reset", [("stream", False), ("row:1000", True)])
def test_stage_span_counts_match_counts_by_hand(tmp_path, text_stores, unit, reset):
    tmp, stores, store, val, info = text_stores
    counts_dir = tmp_path / "counts"
    count_stores([s.path for s in stores], counts_dir, unit=unit, progress=False)
    K = 3
    meta = run_tag(
        TagConfig(
            tokens=str(store.path),
            counts=str(counts_dir),
            out=str(tmp_path / "tags"),
            window=512,
            span_order=K,
            reset_at_doc_boundary=reset,
            workers=2,
            part_tokens=2048,
        )
    )
    row = None if unit == "stream" else 1000
    train = _train_stream(stores)
    naive = {n: naive_ngram_counts(train, n, row) for n in range(2, K + 2)}
    stream, doc_of = stream_of(val, info["eos_id"])
    expected_len = naive_match_len(stream, doc_of, 512, reset)
    rows = read_tags(tmp_path / "tags")
    assert [r["match_len"] for r in rows] == expected_len
    expected_span = [
        naive[min(m, K) + 1][tuple(stream[i + 1 - min(m, K) : i + 2])] if m else None
        for i, m in enumerate(expected_len)
    ]
    assert [r["span_train_count"] for r in rows] == expected_span
    assert [r["span_train_count"] for r in rows if r["match_len"] == 1] == [
        r["train_count"] for r in rows if r["match_len"] == 1
    ]
    assert max(expected_len) > K  # copies longer than the span order occur in real code
    # meta.json: K, the training stores counted, how many n-grams per order and how many seen
    spans = meta["span_counts"]
    assert meta["span_order"] == K == spans["span_order"]
    assert [s["path"] for s in spans["training_stores"]] == [str(s.path.resolve()) for s in stores]
    assert spans["unit"] == unit
    needed = {}
    for i, m in enumerate(expected_len):
        for n in range(3, min(m, K) + 2):
            needed.setdefault(n, set()).add(tuple(stream[i + 2 - n : i + 2]))
    assert spans["by_order"] == {
        str(n): {
            "ngrams": len(needed.get(n, ())),
            "seen": sum(1 for g in needed.get(n, ()) if naive[n][g] > 0),
        }
        for n in range(3, K + 2)
    }
    schema = pq.read_schema(tmp_path / "tags" / "tags-00000.parquet")
    assert (str(schema.field("match_len").type), schema.field("match_len").nullable) == (
        "int32",
        False,
    )
    assert str(schema.field("span_train_count").type) == "int64"


def test_counts_without_training_stores_need_span_order_one(tmp_path):
    store = store_at(tmp_path / "val", [[1, 2, 3, 1, 2, 3]])
    counts = write_counts(tmp_path / "counts", Counter({(1, 2): 4}), fingerprint=FP)
    cfg = dict(tokens=str(store.path), counts=str(counts), out=str(tmp_path / "tags"), window=8)
    with pytest.raises(ArSliceError, match="name no training token stores.*--span-order 1"):
        run_tag(TagConfig(**cfg, workers=1))
    assert not (tmp_path / "tags" / "meta.json").exists()
    meta = run_tag(TagConfig(**cfg, workers=1, span_order=1))
    rows = read_tags(tmp_path / "tags")
    assert [r["match_len"] for r in rows] == [0, 0, 0, 1, 2, 0]
    assert [r["span_train_count"] for r in rows] == [None, None, None, 4, 0, None]
    assert meta["span_order"] == 1


def test_span_lengths_follow_the_definition():
    assert span_lengths(np.array([0, 1, 2, 4, 9]), 4).tolist() == [1, 2, 3, 5, 5]
    assert span_lengths(np.array([0, 1, 2, 4, 9]), 1).tolist() == [1, 2, 2, 2, 2]


def test_changed_training_store_is_refused(tmp_path, text_stores):
    tmp, stores, store, val, info = text_stores
    train = tmp_path / "train"
    write_token_store(train, val[:3], tokenizer_info=info)
    count_stores([train], tmp_path / "counts", progress=False)
    shutil.rmtree(train)  # the training store made again, from other text, after counting
    write_token_store(train, val[:2], tokenizer_info=info)
    cfg = TagConfig(
        tokens=str(store.path), counts=str(tmp_path / "counts"), out=str(tmp_path / "t"), workers=1
    )
    with pytest.raises(ArSliceError, match=r"made from .*train with [\d,]+ tokens, which now has"):
        run_tag(cfg)
    assert not (tmp_path / "t" / "meta.json").exists()


# ---- the slices: query, API, report --------------------------------------------------------------


def _bucket(m: int) -> int:
    return 0 if m == 0 else min(m.bit_length(), 5)


def _by_hand(rows, losses, threshold=1250):
    cells: dict[tuple, list[float]] = {}
    for k, r in enumerate(rows):
        m = r["match_len"]
        span = None
        if m:
            c = r["span_train_count"]
            span = 0 if c == 0 else 1 if c <= threshold else 2
        for model, nll in losses.items():
            cells.setdefault((model, _bucket(m), span), []).append(float(nll[k]))
    return cells


def test_copy_length_query_and_api_by_hand(text_run):  # noqa: F811
    from ar_slicing import open_run
    from tests.queries.test_queries import run_sql

    run_dir, rows, losses = text_run
    assert max(r["match_len"] for r in rows) >= 16  # every bucket of the table is filled
    expected = _by_hand(rows, losses)
    got = run_sql(run_dir, "copy_length", {"by_window": False, "by_subset": False, "max_bucket": 5})
    assert {(r["model"], r["copy_bucket"], r["span_bucket"]) for r in got} == set(expected)
    for r in got:
        values = expected[(r["model"], r["copy_bucket"], r["span_bucket"])]
        assert r["n_tokens"] == len(values)
        assert r["mean_nll"] == pytest.approx(np.mean(values), rel=1e-9)
        assert (
            r["copy_label"]
            == {0: "none", 1: "1", 2: "2-3", 3: "4-7", 4: "8-15", 5: "16+"}[r["copy_bucket"]]
        )
        assert r["span_label"] == {None: None, 0: "0", 1: "1-1250", 2: ">1250"}[r["span_bucket"]]
    run = open_run(run_dir)
    table = run.copy_length(bootstrap=200, seed=3)
    assert table.height == len(got)
    for r in table.iter_rows(named=True):
        values = expected[(r["model"], r["copy_bucket"], r["span_bucket"])]
        assert r["ppl"] == pytest.approx(np.exp(np.mean(values)), rel=1e-9)
        assert r["ppl_lo"] <= r["ppl"] <= r["ppl_hi"]
    assert table.equals(run.copy_length(bootstrap=200, seed=3))  # seeded: reproducible
    merged = run.copy_length(bootstrap=0, spans="all")
    assert "ppl_lo" not in merged.columns
    for r in merged.iter_rows(named=True):
        values = [
            x
            for (m, b, _), xs in expected.items()
            if (m, b) == (r["model"], r["copy_bucket"])
            for x in xs
        ]
        assert r["n_tokens"] == len(values)
        assert r["mean_nll"] == pytest.approx(np.mean(values), rel=1e-9)
    with pytest.raises(ArSliceError, match="spans='both'"):
        run.copy_length(spans="both")


def test_report_shows_the_copy_length_table_and_figure(text_run):  # noqa: F811
    from pipeline.report import ReportConfig, run_report

    run_dir, rows, losses = text_run
    run_report(ReportConfig(run=str(run_dir), bootstrap=50))
    out = run_dir / "report"
    md = (out / "report.md").read_text()
    assert "## Copy length: perplexity by how long a span is copied" in md
    assert "## Copy length per subset" in md
    assert "![copy-length curve](copy_length.png)" in md
    html = (out / "report.html").read_text()
    assert 'class="copy_length"' in html and "copy-length curve" in html
    assert (out / "copy_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import csv

    with open(out / "copy_length.csv") as f:
        cells = list(csv.DictReader(f))
    expected = _by_hand(rows, losses)
    assert len(cells) == len(expected)
    for c in cells:
        span = None if c["span_bucket"] == "" else int(c["span_bucket"])
        values = expected[(c["model"], int(c["copy_bucket"]), span)]
        assert float(c["ppl"]) == pytest.approx(np.exp(np.mean(values)), rel=1e-6)
    # per subset: the attention row of Github's 16+ copies, by hand
    github = [k for k, r in enumerate(rows) if r["subset"] == "Github" and r["match_len"] >= 16]
    if github:
        want = f"{np.exp(np.mean([losses['attention'][k] for k in github])):.2f} n={len(github):,}"
        assert want in md
