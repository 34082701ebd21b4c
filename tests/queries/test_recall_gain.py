"""In-context recall gain (`queries/recall_gain.sql`, `ar_slicing.analysis.metrics.recall_gain_report`)
against a naive per-token reference on a hand-made run.

The run: random documents over a few tokens, so bigrams repeat inside windows, with training
counts chosen on and around every decade boundary (0, 1, 9, 10, 99, 100, 999, 1000, 12345) and
per-token losses that depend on the count and on whether the token is a repeat, so a wrong bucket
boundary, a wrong weighting or a bucket kept without both kinds changes the answer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ar_slicing.analysis.metrics import (
    bootstrap,
    recall_gain_report,
    recall_gain_statistics,
    resample_counts,
    window_sums,
)
from tests.queries.test_queries import naive_tags, run_sql, tiny_run, write_run  # noqa: F401 (a fixture)

WINDOW = 16
BOUNDARY_COUNTS = [0, 1, 9, 10, 99, 100, 999, 1000, 12345]


def naive_bucket(count: int) -> int:
    """The decade bucket written out: 0 for 0, else k where 10**(k-1) <= count < 10**k."""
    if count == 0:
        return 0
    k = 1
    while count >= 10**k:
        k += 1
    return k


def naive_recall_gain(rows, nll, max_train_count=None) -> tuple[float, dict[int, float]]:
    """Σ_b |R_b| (mean non-repeat nll - mean repeat nll) / Σ_b |R_b| over buckets with both."""
    rep: dict[int, list[float]] = {}
    non: dict[int, list[float]] = {}
    for r, x in zip(rows, nll):
        if max_train_count is not None and r["train_count"] > max_train_count:
            continue
        (rep if r["is_repeat"] else non).setdefault(naive_bucket(r["train_count"]), []).append(x)
    by_bucket = {b: sum(non[b]) / len(non[b]) - sum(rep[b]) / len(rep[b]) for b in rep if b in non}
    weight = sum(len(rep[b]) for b in by_bucket)
    gain = sum(len(rep[b]) * g for b, g in by_bucket.items()) / weight if weight else math.nan
    return gain, by_bucket


@pytest.fixture(scope="module")
def gain_run(tmp_path_factory, bpe_tokenizer, bpe_tokenizer_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 7, size=int(rng.integers(20, 60))).tolist() for _ in range(12)]
    vocab = range(0, 7)
    counts = {
        (a, b): int(rng.choice(BOUNDARY_COUNTS)) for a in vocab for b in vocab if rng.random() < 0.9
    }
    counts = {k: v for k, v in counts.items() if v > 0}  # absent = never seen in training
    stream = [t for d in docs for t in d + [0]]
    doc_of = [i for i, d in enumerate(docs) for _ in range(len(d) + 1)]
    subsets = [None] * len(docs)
    rows, _ = naive_tags(stream, doc_of, subsets, counts, WINDOW)

    def losses(scale: float, recall: float) -> list[float]:
        out = []
        for r in rows:
            base = scale * (1.0 + 3.0 / (1.0 + math.log10(1 + r["train_count"])))
            x = base + float(rng.normal(0, 0.3))
            if r["is_repeat"]:
                x -= recall * (1 + naive_bucket(r["train_count"]))
            out.append(float(np.float32(x)))  # what the float32 nll column holds
        return out

    nll = {"attention": losses(1.0, 0.4), "hyena": losses(1.2, 0.1), "rwkv": losses(0.9, -0.05)}
    run = tmp_path_factory.mktemp("gain") / "run"
    rows = write_run(
        run,
        docs,
        subsets,
        counts,
        WINDOW,
        nll,
        bpe_tokenizer,
        tokenizer_json=bpe_tokenizer_path.read_text(),
        architectures={"attention": "attention", "hyena": "hyena", "rwkv": "rwkv"},
    )
    # the table exercises what it is meant to: several buckets with both kinds, of unequal size
    _, by_bucket = naive_recall_gain(rows, nll["attention"])
    assert len(by_bucket) >= 4
    rep_sizes = {
        b: sum(r["is_repeat"] and naive_bucket(r["train_count"]) == b for r in rows)
        for b in by_bucket
    }
    assert len(set(rep_sizes.values())) > 1
    return run, rows, nll


def test_sql_equals_the_naive_reference(gain_run):
    run, rows, nll = gain_run
    got = run_sql(run, "recall_gain", {"max_train_count": -1})
    for model, x in nll.items():
        gain, by_bucket = naive_recall_gain(rows, x)
        mine = [r for r in got if r["model"] == model]
        total = mine[0]
        assert (total["bucket"], total["bucket_label"]) == (None, "all")
        assert total["gain"] == pytest.approx(gain, rel=1e-9)
        buckets = {r["bucket"]: r for r in mine[1:]}
        assert set(buckets) == set(by_bucket)
        n_rep = {b: r["n_repeats"] for b, r in buckets.items()}
        assert total["n_repeats"] == sum(n_rep.values())
        for b, r in buckets.items():
            assert r["gain"] == pytest.approx(by_bucket[b], rel=1e-9)
            assert r["gain"] == pytest.approx(r["mean_nll_non_repeats"] - r["mean_nll_repeats"])
            assert r["weight"] == pytest.approx(n_rep[b] / total["n_repeats"])
    for r in got:
        if r["bucket"] is not None:
            b = r["bucket"]
            assert r["bucket_label"] == ("0" if b == 0 else f"{10 ** (b - 1)}-{10**b - 1}")


def test_sql_max_train_count_keeps_only_rarer_bigrams(gain_run):
    run, rows, nll = gain_run
    got = run_sql(run, "recall_gain", {"max_train_count": 99})
    gain, by_bucket = naive_recall_gain(rows, nll["hyena"], max_train_count=99)
    mine = [r for r in got if r["model"] == "hyena"]
    assert mine[0]["gain"] == pytest.approx(gain, rel=1e-9)
    assert {r["bucket"] for r in mine[1:]} == set(by_bucket) <= {0, 1, 2}
    # the documented default, as `arslice query recall_gain` resolves it, is "no limit"
    from ar_slicing.analysis.results import open_results
    from ar_slicing.analysis.sql import run_named_query

    con = open_results(run)
    try:
        columns, result = run_named_query(con, "recall_gain")
    finally:
        con.close()
    totals = {r[0]: dict(zip(columns, r)) for r in result if r[columns.index("bucket")] is None}
    assert totals["hyena"]["gain"] == pytest.approx(naive_recall_gain(rows, nll["hyena"])[0])


def test_report_point_estimates_equal_the_naive_reference(gain_run):
    from ar_slicing.analysis.results import open_results

    run, rows, nll = gain_run
    con = open_results(run)
    try:
        rep = recall_gain_report(con, n_bootstrap=0)
        limited = recall_gain_report(con, ["rwkv"], n_bootstrap=0, max_train_count=9)
    finally:
        con.close()
    assert rep.models == ["attention", "hyena", "rwkv"]
    for row in rep.rows():
        gain, by_bucket = naive_recall_gain(rows, nll[row["model"]])
        assert row["recall_gain"] == pytest.approx(gain, rel=1e-9)
        assert math.isnan(row["recall_gain_lo"])  # no bootstrap, no interval
        kept = {b["bucket"]: b["gain"] for b in row["by_bucket"] if not math.isnan(b["gain"])}
        assert kept == pytest.approx(by_bucket, rel=1e-9)
    assert limited.rows()[0]["recall_gain"] == pytest.approx(
        naive_recall_gain(rows, nll["rwkv"], max_train_count=9)[0], rel=1e-9
    )
    # the planted effects come out in order: attention recalls most, rwkv not at all
    g = dict(zip(rep.models, rep.gain))
    assert g["attention"] > g["hyena"] > 0 > g["rwkv"]


def test_bootstrap_replicates_equal_naive_resampling_and_pair_with_table1(gain_run):
    """Replicate b is the naive gain of the tokens of the windows drawn in replicate b, and those
    draws are the ones `bootstrap` (Table 1's intervals) makes with the same seed."""
    from ar_slicing.analysis.metrics import recall_sums, resampled_totals
    from ar_slicing.analysis.results import open_results

    run, rows, nll = gain_run
    con = open_results(run)
    try:
        sums = recall_sums(con)
        rep = recall_gain_report(con, n_bootstrap=60, seed=11)
        table1_sums = window_sums(con)
    finally:
        con.close()
    w = len(sums.window_ids)
    assert np.array_equal(sums.window_ids, np.arange(w))  # window_id = column of the draws
    assert np.array_equal(table1_sums.window_ids, sums.window_ids)
    draws = resample_counts(np.random.default_rng(11), w, 60)  # (B, W) multiplicities
    k, m = len(sums.buckets), len(sums.models)
    per_window = np.concatenate(
        [sums.n_rep, sums.n_non, sums.sum_rep.reshape(w, -1), sums.sum_non.reshape(w, -1)], axis=1
    )
    totals = resampled_totals(per_window, 60, seed=11)
    reps = recall_gain_statistics(
        totals[:, :k],
        totals[:, k : 2 * k],
        totals[:, 2 * k : 2 * k + k * m].reshape(-1, k, m),
        totals[:, 2 * k + k * m :].reshape(-1, k, m),
    )["recall_gain"]
    for b in range(0, 60, 7):
        picked = [(r, j) for j, r in enumerate(rows) for _ in range(draws[b, r["window_id"]])]
        for i, model in enumerate(sums.models):
            want, _ = naive_recall_gain([r for r, _ in picked], [nll[model][j] for _, j in picked])
            assert reps[b, i] == pytest.approx(want, rel=1e-9)
    # Table 1's bootstrap with the same seed resamples the same windows: its replicate means
    # over all tokens match the naive means of the same draws
    t1 = bootstrap(table1_sums, 0, 60, seed=11)
    for b in (0, 59):
        sel = [j for j, r in enumerate(rows) for _ in range(draws[b, r["window_id"]])]
        assert t1["mean_nll_all"][b, 1] == pytest.approx(np.mean([nll["hyena"][j] for j in sel]))
    lo, hi = np.nanpercentile(reps, [2.5, 97.5], axis=0)
    np.testing.assert_allclose(rep.gain_lo, lo)
    np.testing.assert_allclose(rep.gain_hi, hi)
    assert np.all(rep.gain_lo <= rep.gain) and np.all(rep.gain <= rep.gain_hi)


def test_statistics_skip_buckets_missing_a_kind_and_weight_by_repeats():
    # bucket 0: 2 repeats (mean 1) vs 1 non-repeat (mean 3): gain 2; bucket 1: 6 repeats (mean 2)
    # vs 2 non-repeats (mean 2.5): gain 0.5; bucket 2: repeats only, bucket 3: non-repeats only.
    n_rep = np.array([2, 6, 5, 0])
    n_non = np.array([1, 2, 0, 4])
    s_rep = np.array([[2.0], [12.0], [100.0], [0.0]])
    s_non = np.array([[3.0], [5.0], [0.0], [40.0]])
    out = recall_gain_statistics(n_rep, n_non, s_rep, s_non)
    assert out["recall_gain"][0] == pytest.approx((2 * 2.0 + 6 * 0.5) / 8)  # not (2 + 0.5) / 2
    assert out["n_repeats_weighted"] == 8
    assert np.isnan(out["gain_by_bucket"][2:, 0]).all()
    none = recall_gain_statistics(np.array([3, 0]), np.array([0, 2]), s_rep[:2], s_non[:2])
    assert np.isnan(none["recall_gain"][0])


def test_sql_and_report_agree_on_the_tiny_run(tiny_run):  # noqa: F811
    """docs/design.md's worked example: hyena loses 1 nat on every repeat; attention is flat."""
    from ar_slicing.analysis.results import open_results

    got = {
        r["model"]: r
        for r in run_sql(tiny_run, "recall_gain", {"max_train_count": -1})
        if r["bucket"] is None
    }
    # buckets with both kinds: 0 (repeat (7,8) vs two non-repeat (7,8)) and 10-99 (two (5,6)
    # repeats vs (5,6) at pos 1 and (8,7) count 99); hyena's repeats cost 3.0, the rest 2.0
    assert got["hyena"]["gain"] == pytest.approx(-1.0)
    assert got["hyena"]["n_repeats"] == 3
    assert got["attention"]["gain"] == pytest.approx(0.0)
    con = open_results(tiny_run)
    try:
        rep = recall_gain_report(con, n_bootstrap=0)
    finally:
        con.close()
    assert dict(zip(rep.models, rep.gain))["hyena"] == pytest.approx(-1.0)
