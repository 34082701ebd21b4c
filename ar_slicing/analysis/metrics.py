"""Slice metrics with bootstrap intervals: per-slice perplexity, the gap to a reference, AR share.

Definitions (docs/design.md, Metrics): for a slice T (`ar_slicing.analysis.slices`), `mean_nll(T) = Σ nll / |T|`, `ppl = exp(mean_nll)`;
against reference r, `Δ_T = mean_nll_m(T) − mean_nll_r(T)` and the AR share of the gap
`Σ_AR (nll_m − nll_r) / Σ_all (nll_m − nll_r)` (as is: it may exceed 1 or be negative; NaN when
the denominator is 0).

Uncertainty comes from resampling **windows** with replacement (tokens of one window are not
independent). Everything a statistic needs is a sum over windows, so the per-token table is
reduced once (in DuckDB) to per-window sums of every slice and each bootstrap replicate is a
weighted sum: `counts (B, W) @ sums (W, S·M)`. The same resampled windows are used for every model, so intervals
of Δ and of the AR share are paired. A fixed seed makes the intervals reproducible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ar_slicing.analysis.slices import ALL, AR, SLICE_NAMES, SLICES

log = logging.getLogger(__name__)

# Bootstrap replicates are drawn in chunks of CHUNK_CELLS (replicate, window) cells: a few int64
# arrays of that size (~100 MB) whatever the number of windows.
CHUNK_CELLS = 1 << 22


@dataclass
class WindowSums:
    """Per-window sufficient statistics of every slice (`ar_slicing.analysis.slices`) and model (W
    windows, S slices, M models)."""

    models: list[str]
    window_ids: np.ndarray  # (W,) int
    slices: tuple[str, ...]  # (S,) slice names, in declaration order
    n: np.ndarray  # (W, S) scored tokens of each slice per window
    s: np.ndarray  # (W, S, M) Σ nll over each slice's tokens of the window, per model

    @property
    def n_windows(self) -> int:
        return len(self.window_ids)

    def tokens(self, name: str) -> np.ndarray:
        """(W,) the tokens of the slice `name` per window."""
        return self.n[:, self.slices.index(name)]


def window_sums(con, models: list[str] | None = None) -> WindowSums:
    """Reduce `token_losses` of a results.duckdb connection to per-window sums of every slice."""
    from ar_slicing.analysis.slices import slice_counts_sql, slice_sums_sql

    windows = con.execute(
        f"SELECT window_id, {slice_counts_sql()} FROM tags GROUP BY window_id ORDER BY window_id"
    ).fetchnumpy()
    window_ids = windows["window_id"].astype(np.int64)
    if models is None:
        models = [r[0] for r in con.execute("SELECT model FROM models ORDER BY model").fetchall()]
    per = con.execute(
        f"SELECT model, window_id, {slice_sums_sql()} FROM token_losses GROUP BY model, window_id"
    ).fetchnumpy()
    sums = np.zeros((len(window_ids), len(SLICES), len(models)))
    col = {m: i for i, m in enumerate(models)}
    keep = np.isin(per["model"], models)
    rows = np.searchsorted(window_ids, per["window_id"][keep].astype(np.int64))
    cols = np.array([col[m] for m in per["model"][keep]], dtype=np.int64)
    for k, sl in enumerate(SLICES):
        sums[rows, k, cols] = per[f"s_{sl.name}"][keep]
    return WindowSums(
        models=list(models),
        window_ids=window_ids,
        slices=SLICE_NAMES,
        n=np.stack([windows[f"n_{sl.name}"].astype(np.int64) for sl in SLICES], axis=1),
        s=sums,
    )


def slice_statistics(
    n: np.ndarray, s: np.ndarray, ref: int, slices: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """Every reported statistic from (resampled) totals of the slices named `slices`.

    Shapes: `n` (..., S) token counts; `s` (..., S, M) loss sums; `ref` the reference model's
    column. Per slice T: `mean_nll_T`, `ppl_T`, `delta_T` (..., M); and `pct_ar` (...,), the AR
    hits' share of all tokens, and `ar_share` (..., M), their share of the gap.
    """
    n = np.asarray(n, dtype=np.float64)[..., None]  # (..., S, 1)
    every, ar = slices.index(ALL.name), slices.index(AR.name)
    with np.errstate(divide="ignore", invalid="ignore"):
        out: dict[str, np.ndarray] = {"pct_ar": 100.0 * n[..., ar, 0] / n[..., every, 0]}
        for k, name in enumerate(slices):
            mean = s[..., k, :] / n[..., k, :]
            out[f"mean_nll_{name}"] = mean
            out[f"ppl_{name}"] = np.exp(mean)
            out[f"delta_{name}"] = mean - mean[..., ref : ref + 1]
        gap_all = s[..., every, :] - s[..., every, ref : ref + 1]
        gap_ar = s[..., ar, :] - s[..., ar, ref : ref + 1]
        out["ar_share"] = np.where(
            gap_all == 0, np.nan, gap_ar / np.where(gap_all == 0, 1, gap_all)
        )
    return out


def ar_share_of_gap(
    nll_model: np.ndarray, nll_reference: np.ndarray, is_ar_hit: np.ndarray
) -> float:
    """Σ_AR (nll_m − nll_r) / Σ_all (nll_m − nll_r) from per-token arrays (NaN when the total is 0)."""
    diff = np.asarray(nll_model, dtype=np.float64) - np.asarray(nll_reference, dtype=np.float64)
    total = diff.sum()
    return (
        float(diff[np.asarray(is_ar_hit, dtype=bool)].sum() / total) if total != 0 else float("nan")
    )


def resample_counts(rng: np.random.Generator, n_windows: int, n_replicates: int) -> np.ndarray:
    """(n_replicates, n_windows) multiplicities of windows drawn uniformly with replacement."""
    idx = rng.integers(0, n_windows, size=(n_replicates, n_windows))
    flat = idx + (np.arange(n_replicates)[:, None] * n_windows)
    return np.bincount(flat.ravel(), minlength=n_replicates * n_windows).reshape(
        n_replicates, n_windows
    )


def resampled_totals(
    per_window: np.ndarray, n_replicates: int, seed: int = 0, desc: str = "bootstrap"
) -> np.ndarray:
    """(n_replicates, C) column totals of `per_window` (W, C) over windows drawn with replacement.

    The draws depend only on `seed`, W and `n_replicates`, so every statistic bootstrapped with
    the same seed over the same windows sees the same resamples: their intervals are paired.
    """
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    w, c = per_window.shape
    chunk = max(1, min(n_replicates, CHUNK_CELLS // max(w, 1)))
    per_window = np.asarray(per_window, dtype=np.float64)
    parts = []
    with tqdm(total=n_replicates, desc=desc, unit="rep", disable=n_replicates < 2 * chunk) as bar:
        for start in range(0, n_replicates, chunk):
            k = min(chunk, n_replicates - start)
            parts.append(resample_counts(rng, w, k) @ per_window)  # (k, C)
            bar.update(k)
    return np.concatenate(parts) if parts else np.zeros((0, c))


def bootstrap_cost(n_replicates: int, n_windows: int, n_columns: int) -> tuple[float, int]:
    """(seconds, bytes) that `resampled_totals` takes for `n_replicates` resamples of
    `n_windows` windows and `n_columns` columns here: the seconds measured on one chunk of
    draws now and scaled (the draws cost the same whatever the values), the bytes of the
    (B, C) totals it returns and their percentiles."""
    import time

    w = max(n_windows, 1)
    probe = max(1, min(n_replicates, CHUNK_CELLS // w))
    t0 = time.perf_counter()
    resample_counts(np.random.default_rng(0), w, probe) @ np.zeros((w, n_columns))
    seconds = (time.perf_counter() - t0) * n_replicates / probe
    return seconds, 2 * 8 * n_replicates * n_columns


def bootstrap(
    sums: WindowSums, ref: int, n_replicates: int = 1000, seed: int = 0
) -> dict[str, np.ndarray]:
    """Every statistic of `slice_statistics` for `n_replicates` window resamples, (B, ...)."""
    w, k, m = sums.s.shape
    per_window = np.concatenate([sums.n, sums.s.reshape(w, k * m)], axis=1)  # (W, S + S·M)
    totals = resampled_totals(per_window, n_replicates, seed)  # (B, S + S·M)
    return slice_statistics(totals[:, :k], totals[:, k:].reshape(-1, k, m), ref, sums.slices)


def point_estimates(sums: WindowSums, ref: int) -> dict[str, np.ndarray]:
    return slice_statistics(sums.n.sum(axis=0), sums.s.sum(axis=0), ref, sums.slices)


def intervals(
    replicates: dict[str, np.ndarray], level: float = 0.95
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Percentile intervals (lo, hi) of every statistic over the replicate axis (NaNs ignored)."""
    q = [50 * (1 - level), 50 * (1 + level)]
    out = {}
    for key, values in replicates.items():
        with np.errstate(invalid="ignore"), _quiet_all_nan():
            lo, hi = np.nanpercentile(values, q, axis=0)
        out[key] = (lo, hi)
    return out


class _quiet_all_nan:
    """Silence numpy's "All-NaN slice" warning (the reference's own AR share is NaN by definition)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


@dataclass
class SliceReport:
    """Point estimates and bootstrap intervals of every statistic, per model."""

    models: list[str]
    reference: str
    n_tokens: int
    n_ar_hits: int
    slice_tokens: dict[str, int]  # slice name -> its tokens
    n_windows: int
    n_bootstrap: int
    seed: int
    level: float
    point: dict[str, np.ndarray]
    interval: dict[str, tuple[np.ndarray, np.ndarray]]

    def rows(self) -> list[dict]:
        """One dict per model: each statistic with `_lo` / `_hi` interval bounds."""
        out = []
        for i, model in enumerate(self.models):
            row: dict = {"model": model}
            for key, value in self.point.items():
                v = value if np.ndim(value) == 0 else value[i]
                row[key] = float(v)
                if self.n_bootstrap:
                    lo, hi = self.interval[key]
                    row[f"{key}_lo"] = float(lo if np.ndim(lo) == 0 else lo[i])
                    row[f"{key}_hi"] = float(hi if np.ndim(hi) == 0 else hi[i])
            out.append(row)
        return out


def slice_report(
    sums: WindowSums, reference: str, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95
) -> SliceReport:
    ref = sums.models.index(reference)
    point = point_estimates(sums, ref)
    interval = intervals(bootstrap(sums, ref, n_bootstrap, seed), level) if n_bootstrap > 0 else {}
    return SliceReport(
        models=sums.models,
        reference=reference,
        n_tokens=int(sums.tokens(ALL.name).sum()),
        n_ar_hits=int(sums.tokens(AR.name).sum()),
        slice_tokens={name: int(sums.tokens(name).sum()) for name in sums.slices},
        n_windows=sums.n_windows,
        n_bootstrap=n_bootstrap,
        seed=seed,
        level=level,
        point=point,
        interval=interval,
    )


# ---- in-context recall gain -------------------------------------------------------------------
#
# Within each decade bucket b of the training count (the frequency curve's buckets: 0, 1-9,
# 10-99, ...; results.duckdb's macro `count_bucket`, `ar_slicing.analysis.slices`), gain_b = mean_nll(non-repeats in b) - mean_nll(repeats in b); a model's gain is
# the repeat-weighted mean  Σ_b |R_b| gain_b / Σ_b |R_b|  over the buckets holding both kinds.
# It needs no reference model: positive means a bigram is predicted better when it already
# occurred in the context than an equally frequent bigram that did not (in-context recall).


@dataclass
class RecallSums:
    """Per-window token counts and loss sums per (count bucket, repeat or not), per model."""

    models: list[str]
    window_ids: np.ndarray  # (W,) int
    buckets: np.ndarray  # (K,) bucket numbers present (0 = never seen, k = k-digit counts)
    n_rep: np.ndarray  # (W, K) repeats per window and bucket
    n_non: np.ndarray  # (W, K) non-repeats per window and bucket
    sum_rep: np.ndarray  # (W, K, M) Σ nll over those repeats, per model
    sum_non: np.ndarray  # (W, K, M) Σ nll over those non-repeats, per model


def recall_sums(
    con, models: list[str] | None = None, max_train_count: int | None = None
) -> RecallSums:
    """Reduce `token_losses` of a results.duckdb connection to RecallSums.

    `max_train_count` keeps only bigrams seen at most that many times in training (None: all).
    The windows are every window of `tags`, in window_id order, as `window_sums` has them, so a
    bootstrap with the same seed resamples the same windows for both.
    """
    window_ids = (
        con.execute("SELECT DISTINCT window_id FROM tags ORDER BY window_id")
        .fetchnumpy()["window_id"]
        .astype(np.int64)
    )
    if models is None:
        models = [r[0] for r in con.execute("SELECT model FROM models ORDER BY model").fetchall()]
    limit = -1 if max_train_count is None else int(max_train_count)
    per = con.execute(
        """
        SELECT model, window_id, count_bucket(train_count) AS bucket, is_repeat,
               count(*) AS n, fsum(nll::DOUBLE) AS s
        FROM token_losses
        WHERE $limit::BIGINT < 0 OR train_count <= $limit::BIGINT
        GROUP BY ALL
        """,
        {"limit": limit},
    ).fetchnumpy()
    keep = np.isin(per["model"], models)
    per = {k: np.asarray(v)[keep] for k, v in per.items()}
    buckets, n, s = bucket_sums(per, window_ids, models)
    return RecallSums(
        models=list(models),
        window_ids=window_ids,
        buckets=buckets,
        n_rep=n[1],
        n_non=n[0],
        sum_rep=s[1],
        sum_non=s[0],
    )


def bucket_sums(
    per: dict, window_ids: np.ndarray, models: list[str], model_key: str = "model"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buckets (K,), token counts (2, W, K), loss sums (2, W, K, M)) by non-repeat (0) or
    repeat (1), window of `window_ids`, training-count bucket and model, from rows grouped in
    SQL: `per` holds the columns `model_key` (a name of `models`), window_id, bucket, is_repeat,
    n and s (rows of one cell are added up). Token counts come from the first model's rows:
    every model scores the same tokens."""
    buckets = np.unique(per["bucket"].astype(np.int64))
    rows = np.searchsorted(window_ids, per["window_id"].astype(np.int64))
    cols = np.searchsorted(buckets, per["bucket"].astype(np.int64))
    col = {name: i for i, name in enumerate(models)}
    mods = np.array([col[name] for name in per[model_key]], dtype=np.int64)
    rep = per["is_repeat"].astype(bool).astype(np.int64)
    n = np.zeros((2, len(window_ids), len(buckets)), dtype=np.int64)
    s = np.zeros((2, len(window_ids), len(buckets), len(models)))
    first = mods == 0
    np.add.at(n, (rep[first], rows[first], cols[first]), np.asarray(per["n"])[first])
    np.add.at(s, (rep, rows, cols, mods), np.asarray(per["s"], dtype=np.float64))
    return buckets, n, s


def recall_gain_statistics(
    n_rep: np.ndarray, n_non: np.ndarray, s_rep: np.ndarray, s_non: np.ndarray
) -> dict[str, np.ndarray]:
    """The recall gain from (resampled) totals.

    Shapes: `n_rep`, `n_non` (..., K) token counts per bucket; `s_rep`, `s_non` (..., K, M) loss
    sums. Returns `recall_gain` (..., M) (NaN where no bucket holds both kinds), `gain_by_bucket`
    (..., K, M) (NaN where a bucket lacks either kind) and `n_repeats_weighted` (...,), the
    repeats in buckets that count.
    """
    n_rep = np.asarray(n_rep, dtype=np.float64)
    n_non = np.asarray(n_non, dtype=np.float64)
    both = (n_rep > 0) & (n_non > 0)  # (..., K)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain_b = s_non / n_non[..., None] - s_rep / n_rep[..., None]  # (..., K, M)
    gain_b = np.where(both[..., None], gain_b, np.nan)
    weight = np.where(both, n_rep, 0.0)  # (..., K)
    total = weight.sum(axis=-1)  # (...,)
    weighted = np.nansum(gain_b * weight[..., None], axis=-2)  # (..., M)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(total[..., None] > 0, weighted / total[..., None], np.nan)
    return {"recall_gain": gain, "gain_by_bucket": gain_b, "n_repeats_weighted": total}


@dataclass
class RecallGainReport:
    """Point estimate and bootstrap interval of every model's in-context recall gain."""

    models: list[str]
    buckets: np.ndarray  # (K,)
    n_rep: np.ndarray  # (K,) repeats per bucket
    n_non: np.ndarray  # (K,) non-repeats per bucket
    gain: np.ndarray  # (M,) nats
    gain_lo: np.ndarray  # (M,) NaN without a bootstrap
    gain_hi: np.ndarray  # (M,)
    gain_by_bucket: np.ndarray  # (K, M) NaN where the bucket lacks repeats or non-repeats
    n_windows: int
    n_bootstrap: int
    seed: int
    level: float

    def rows(self) -> list[dict]:
        """One dict per model: `recall_gain`, `recall_gain_lo`, `recall_gain_hi` (nats) and
        `by_bucket`, a list of {bucket, n_repeats, n_non_repeats, gain} per count bucket."""
        out = []
        for i, model in enumerate(self.models):
            out.append(
                {
                    "model": model,
                    "recall_gain": float(self.gain[i]),
                    "recall_gain_lo": float(self.gain_lo[i]),
                    "recall_gain_hi": float(self.gain_hi[i]),
                    "by_bucket": [
                        {
                            "bucket": int(b),
                            "n_repeats": int(self.n_rep[k]),
                            "n_non_repeats": int(self.n_non[k]),
                            "gain": float(self.gain_by_bucket[k, i]),
                        }
                        for k, b in enumerate(self.buckets)
                    ],
                }
            )
        return out


def recall_gain_report(
    con,
    models: list[str] | None = None,
    n_bootstrap: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    max_train_count: int | None = None,
) -> RecallGainReport:
    """Every model's in-context recall gain with a bootstrap interval over windows.

    `con` is a results.duckdb connection (`ar_slicing.analysis.results.open_results`); `models` defaults
    to every model of the run, in name order. With the `n_bootstrap` and `seed` that
    `slice_report` got, the resamples are the same windows as Table 1's other columns (paired).
    """
    sums = recall_sums(con, models, max_train_count)
    k, m = len(sums.buckets), len(sums.models)
    point = recall_gain_statistics(
        sums.n_rep.sum(0), sums.n_non.sum(0), sums.sum_rep.sum(0), sums.sum_non.sum(0)
    )
    lo = hi = np.full(m, np.nan)
    if n_bootstrap > 0:
        w = len(sums.window_ids)
        per_window = np.concatenate(
            [sums.n_rep, sums.n_non, sums.sum_rep.reshape(w, -1), sums.sum_non.reshape(w, -1)],
            axis=1,
        )  # (W, 2K + 2KM)
        t = resampled_totals(per_window, n_bootstrap, seed, desc="bootstrap recall gain")
        reps = recall_gain_statistics(
            t[:, :k],
            t[:, k : 2 * k],
            t[:, 2 * k : 2 * k + k * m].reshape(-1, k, m),
            t[:, 2 * k + k * m :].reshape(-1, k, m),
        )
        lo, hi = intervals({"g": reps["recall_gain"]}, level)["g"]
    return RecallGainReport(
        models=sums.models,
        buckets=sums.buckets,
        n_rep=sums.n_rep.sum(0),
        n_non=sums.n_non.sum(0),
        gain=point["recall_gain"],
        gain_lo=np.asarray(lo),
        gain_hi=np.asarray(hi),
        gain_by_bucket=point["gain_by_bucket"],
        n_windows=len(sums.window_ids),
        n_bootstrap=n_bootstrap,
        seed=seed,
        level=level,
    )
