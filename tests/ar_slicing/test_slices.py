"""The slices' declarations (ar_slicing/analysis/slices.py) against a naive reference: their SQL and the
Python sums agree with per-row Python predicates on random tags and losses, the training-count
bucket macros with the bucket definition on its edges, and a run's results.duckdb, queries and
`Run.slices()` follow from them.

A new slice is a declaration in ar_slicing/analysis/slices.py and its line in `NAIVE` below.
"""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.tags import tags_schema
from ar_slicing.analysis.metrics import point_estimates, recall_sums, window_sums
from ar_slicing.analysis.slices import (
    COUNT_BUCKET_MACROS,
    SLICE_NAMES,
    SLICES,
    TABLE1_SLICES,
    create_definitions,
)
from tests.queries.test_queries import QUOTED, TINY_AR, tiny_run  # noqa: F401  (a fixture)

# Each declared slice as a plain Python predicate of one tag row and the run's AR threshold,
# written from its definition (docs/design.md; docs/copy-length.md for the AR hits of order k).
NAIVE = {
    "all": lambda r, t: True,
    "ar": lambda r, t: r["is_ar_hit"],
    "other": lambda r, t: not r["is_ar_hit"],
    "ar2": lambda r, t: r["match_len"] >= 2 and r["span_train_count"] <= t,
}


def test_every_declared_slice_has_a_naive_reference():
    assert tuple(NAIVE) == SLICE_NAMES
    assert len(set(SLICE_NAMES)) == len(SLICE_NAMES)
    # Table 1 and the report show its slices; the AR share needs these two among them
    assert {"all", "ar"} <= {s.name for s in TABLE1_SLICES}


# ---- random tags and losses, in DuckDB ----------------------------------------------------------

MODELS = ("attention", QUOTED)
COUNTS = (0, 1, 2, 7, 8, 9, 10, 99, 100, 1249, 1250, 1251, 20_000)


@st.composite
def tag_rows(draw) -> list[dict]:
    """Tag rows of up to 4 windows, consistent as the tag stage writes them: a repeat has a copy
    length of 1 or more and a span count no larger than its bigram's; an AR hit is a repeat
    whose bigram count is at most the threshold (drawn with the rows, `threshold` of row 0)."""
    threshold = draw(st.sampled_from((0, 1, 8, 1250)))
    n = draw(st.integers(1, 40))
    rows, next_pos = [], {}
    for _ in range(n):
        w = draw(st.integers(0, 3))
        next_pos[w] = next_pos.get(w, 0) + 1
        count = draw(st.sampled_from(COUNTS))
        repeat = draw(st.booleans())
        match_len = draw(st.integers(1, 6)) if repeat else 0
        span = None
        if repeat:
            span = (
                count
                if match_len == 1
                else draw(st.sampled_from([c for c in COUNTS if c <= count]))
            )
        rows.append(
            {
                "window_id": w, "pos": next_pos[w], "doc_id": w, "token": 5, "prev": 6,
                "train_count": count, "prev_pos": 1 if repeat else None, "is_repeat": repeat,
                "is_ar_hit": repeat and count <= threshold,
                "subset": draw(st.sampled_from(("Github", "ArXiv", None))),
                "match_len": match_len, "span_train_count": span,
                "nll": [draw(st.floats(0.0, 20.0, allow_subnormal=False)) for _ in MODELS],
            }
        )  # fmt: skip
    rows[0]["threshold"] = threshold
    return rows


def connect_tables(rows: list[dict], threshold: int):
    """An in-memory DuckDB holding `rows` as results.duckdb's tables and views name them
    (`tags`, `token_losses`, `models`), with the slices' definitions."""
    con = duckdb.connect()
    schema = tags_schema()
    tags = pa.Table.from_pylist([{c: r[c] for c in schema.names} for r in rows], schema)
    losses = pa.table(
        {
            "model": [m for r in rows for m in MODELS],
            "window_id": pa.array([r["window_id"] for r in rows for _ in MODELS], pa.int32()),
            "pos": pa.array([r["pos"] for r in rows for _ in MODELS], pa.int32()),
            "nll": pa.array([x for r in rows for x in r["nll"]], pa.float32()),
        }
    )
    con.register("tag_rows", tags)
    con.register("loss_rows", losses)
    con.execute("CREATE TABLE tags AS SELECT * FROM tag_rows")
    con.execute(
        "CREATE VIEW token_losses AS SELECT l.model, t.*, l.nll FROM tags AS t "
        "JOIN loss_rows AS l ON l.window_id = t.window_id AND l.pos = t.pos"
    )
    con.execute("CREATE TABLE models AS SELECT unnest($m) AS model, 'x' AS architecture, "
                "7::BIGINT AS n_params", {"m": list(MODELS)})  # fmt: skip
    create_definitions(con, threshold)
    return con


def naive_sums(rows, threshold):
    """{(slice, window, model index): (tokens, [nll, ...])} straight from the rows."""
    out: dict = {}
    for r in rows:
        for name, holds in NAIVE.items():
            if holds(r, threshold):
                for j in range(len(MODELS)):
                    cell = out.setdefault((name, r["window_id"], j), [0, []])
                    cell[0] += 1
                    cell[1].append(float(np.float32(r["nll"][j])))  # (as stored: float32)
    return out


def records(con, sql: str) -> list[dict]:
    cur = con.execute(sql)
    return [dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tag_rows())
def test_sql_and_python_sums_of_every_slice_equal_a_naive_computation(rows):
    threshold = rows[0]["threshold"]
    naive = naive_sums(rows, threshold)
    con = connect_tables(rows, threshold)
    try:
        sums = window_sums(con)
        long = con.execute(
            "SELECT slice, model, count(*), fsum(nll::DOUBLE) FROM slice_token_losses GROUP BY ALL"
        ).fetchall()
        wide = records(con, "SELECT * FROM slice_perplexity ORDER BY model")
        gaps = records(con, f"SELECT * FROM gap_vs_reference('{MODELS[0]}') ORDER BY model")
    finally:
        con.close()
    # the per-window sums the bootstrap resamples
    assert sums.slices == SLICE_NAMES and list(sums.models) == sorted(MODELS)
    assert list(sums.window_ids) == sorted({r["window_id"] for r in rows})
    for k, name in enumerate(SLICE_NAMES):
        for i, w in enumerate(sums.window_ids):
            for j, model in enumerate(sums.models):
                n, xs = naive.get((name, w, MODELS.index(model)), (0, []))
                assert sums.n[i, k] == n, (name, w)
                assert sums.s[i, k, j] == pytest.approx(math.fsum(xs), rel=1e-12, abs=1e-12)
    # the long view of every slice
    got = {(s, m): (n, x) for s, m, n, x in long}
    for name in SLICE_NAMES:
        for j, model in enumerate(MODELS):
            cells = [v for (s, _, jj), v in naive.items() if s == name and jj == j]
            n = sum(c[0] for c in cells)
            if n == 0:
                assert (name, model) not in got
                continue
            assert got[(name, model)][0] == n
            total = math.fsum(x for c in cells for x in c[1])
            assert got[(name, model)][1] == pytest.approx(total, rel=1e-12, abs=1e-12)

    # the statistics of every slice, and the slice_perplexity and gap views of Table 1's
    def mean(name: str, model: str) -> float:
        xs = [x for (s, _, j), c in naive.items() if s == name and j == MODELS.index(model)
              for x in c[1]]  # fmt: skip
        return math.fsum(xs) / len(xs) if xs else math.nan

    def same(value, expected: float) -> bool:
        return math.isnan(expected) if value is None else value == pytest.approx(expected)

    point = point_estimates(sums, 0)
    for j, model in enumerate(sums.models):
        row, gap = wide[j], gaps[j]
        assert row["model"] == gap["model"] == model
        for name in SLICE_NAMES:
            expected = mean(name, model)
            assert point[f"mean_nll_{name}"][j] == pytest.approx(expected, nan_ok=True)
            if name in {s.name for s in TABLE1_SLICES}:
                assert same(row[f"mean_nll_{name}"], expected), (model, name)
                assert same(gap[f"delta_log_ppl_{name}"], expected - mean(name, MODELS[0]))
        assert row["n_ar_hits"] == sum(r["is_ar_hit"] for r in rows)


# ---- the training-count buckets ----------------------------------------------------------------

EDGES = [0, 1, 9, 10, 11, 99, 100, 101, 999, 1000, 1250, 9999, 10_000] + [
    v for k in range(5, 18) for v in (10**k - 1, 10**k)
]


def naive_bucket(count: int) -> int:
    """Bucket 0 holds count 0; bucket k >= 1 the counts 10^(k-1) .. 10^k - 1 (k decimal digits)."""
    return 0 if count == 0 else len(str(count))


def naive_label(bucket: int) -> tuple[int, int, str]:
    if bucket == 0:
        return 0, 0, "0"
    lo, hi = 10 ** (bucket - 1), 10**bucket - 1
    return lo, hi, f"{lo}-{hi}"


def bucket_rows(counts: list[int]) -> list[tuple]:
    con = duckdb.connect()
    for statement in COUNT_BUCKET_MACROS:
        con.execute(statement)
    con.execute("CREATE TABLE c AS SELECT unnest($c::BIGINT[]) AS n", {"c": counts})
    try:
        return con.execute(
            "SELECT n, count_bucket(n) AS b, count_bucket_lo(count_bucket(n)), "
            "count_bucket_hi(count_bucket(n)), count_bucket_label(count_bucket(n)) FROM c ORDER BY n"
        ).fetchall()
    finally:
        con.close()


def test_bucket_macros_on_the_edges_of_every_bucket():
    rows = bucket_rows(EDGES)
    assert [r[0] for r in rows] == sorted(EDGES)
    for n, b, lo, hi, label in rows:
        assert b == naive_bucket(n), n
        assert (lo, hi, label) == naive_label(b), n
        assert lo <= n <= hi or b == 0
    labels = {r[1]: r[4] for r in rows}
    assert [labels[b] for b in range(4)] == ["0", "1-9", "10-99", "100-999"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 10**18 - 1), min_size=1, max_size=50))
def test_bucket_macros_on_random_counts(counts):
    for n, b, lo, hi, label in bucket_rows(counts):
        assert (b, (lo, hi, label)) == (naive_bucket(n), naive_label(naive_bucket(n)))


def test_the_recall_gain_sums_bucket_by_the_macro():
    """`ar_slicing.analysis.metrics` buckets as the queries do: through `count_bucket`."""
    rows = []
    for k, count in enumerate(EDGES[:14]):
        rows.append(
            {
                "window_id": 0, "pos": k + 1, "doc_id": 0, "token": 5, "prev": 6,
                "train_count": count, "prev_pos": None, "is_repeat": k % 2 == 0,
                "is_ar_hit": False, "subset": None, "match_len": 1 - k % 2,
                "span_train_count": count if k % 2 == 0 else None,
                "nll": [1.0, 2.0],
            }
        )  # fmt: skip
    con = connect_tables(rows, 8)
    try:
        sums = recall_sums(con)
    finally:
        con.close()
    assert list(sums.buckets) == sorted({naive_bucket(n) for n in EDGES[:14]})
    per_bucket = {b: 0 for b in sums.buckets}
    for n in EDGES[:14]:
        per_bucket[naive_bucket(n)] += 1
    assert list(sums.n_rep.sum(0) + sums.n_non.sum(0)) == [per_bucket[b] for b in sums.buckets]


# ---- a run: results.duckdb, the queries and Run.slices() ----------------------------------------


def test_results_db_holds_the_definitions_for_any_connection(tiny_run):  # noqa: F811
    from ar_slicing import open_run
    from ar_slicing.analysis.results import ensure_results, recorded_plan
    from ar_slicing.analysis.slices import definitions_digest

    ensure_results(tiny_run)
    db = tiny_run / "results.duckdb"
    assert recorded_plan(db)["settings"] == {"definitions": definitions_digest()}
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count_bucket(150), ar_threshold()").fetchone() == (3, 1250)
        got = con.execute("SELECT slice, label, predicate FROM slices ORDER BY position").fetchall()
        assert got == [(s.name, s.label, s.where) for s in SLICES]
        ar = con.execute(
            "SELECT window_id, pos FROM slice_token_losses WHERE slice = 'ar' AND model = 'hyena'"
        ).fetchall()
        assert set(ar) == TINY_AR
    finally:
        con.close()
    # a file made with other definitions (another digest in its plan) is rebuilt with these
    con = duckdb.connect(str(db))
    con.execute("UPDATE run_info SET value = replace(value, $d, 'old') WHERE key = 'plan'",
                {"d": definitions_digest()})  # fmt: skip
    con.close()
    _, built = ensure_results(tiny_run)
    assert built
    # and a run opened for others' SQL answers with them too
    run = open_run(tiny_run, read_only_files=True)
    assert run.sql("SELECT count_bucket_label(count_bucket(42)) AS b")["b"].to_list() == ["10-99"]


def test_run_slices_are_table1s_numbers_for_its_slices(tiny_run):  # noqa: F811
    from ar_slicing import open_run

    run = open_run(tiny_run)
    long = run.slices(bootstrap=50, seed=3)
    t1 = run.table1(bootstrap=50, seed=3)
    assert long["model"].unique(maintain_order=True).to_list() == ["attention", "hyena", QUOTED]
    assert long.filter(long["model"] == "hyena")["slice"].to_list() == list(SLICE_NAMES)
    for s in TABLE1_SLICES:
        mine = long.filter(long["slice"] == s.name)
        for key in ("ppl", "ppl_lo", "ppl_hi", "delta", "delta_lo", "delta_hi"):
            stat = key.replace("ppl", f"ppl_{s.name}").replace("delta", f"delta_{s.name}")
            assert mine[key].to_list() == t1[stat].to_list(), (s.name, key)
    hyena = {r["slice"]: r for r in long.filter(long["model"] == "hyena").iter_rows(named=True)}
    # by hand (tests/queries/test_queries.py): 3 AR hits at 3.0 nats, 12 others
    assert hyena["ar"]["n_tokens"] == 3 and hyena["ar"]["mean_nll"] == pytest.approx(3.0)
    assert hyena["ar"]["delta"] == pytest.approx(1.0)
    assert hyena["other"]["mean_nll"] == pytest.approx((12 * 2.0 - 4 * 0.25) / 12)
    assert hyena["all"]["label"] == "all tokens" and hyena["all"]["n_tokens"] == 15
    # Table 1 and the slice_perplexity, by_subset and gap_vs_reference queries show Table 1's
    # slices, and only those
    shown = {s.name for s in TABLE1_SLICES}
    columns = {name: run.query(name).columns for name in ("slice_perplexity", "by_subset")}
    columns["gap_vs_reference"] = run.query("gap_vs_reference").columns
    for name in SLICE_NAMES:
        assert (f"ppl_{name}" in t1.columns) == (name in shown), name
        assert (f"ppl_{name}" in columns["slice_perplexity"]) == (name in shown), name
        assert (f"ppl_{name}" in columns["by_subset"]) == (name in shown), name
        assert (f"delta_log_ppl_{name}" in columns["gap_vs_reference"]) == (name in shown), name
        assert long.filter(long["slice"] == name)["in_table1"].to_list() == [name in shown] * 3
    assert run.slices(bootstrap=0).columns == [
        "model", "slice", "label", "in_table1", "n_tokens", "mean_nll", "ppl", "delta",
    ]  # fmt: skip
