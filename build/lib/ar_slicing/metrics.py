"""Slice metrics with bootstrap intervals: per-slice perplexity, the gap to a reference, AR share.

Definitions (DESIGN.md, Metrics): for a slice T, `mean_nll(T) = Σ nll / |T|`, `ppl = exp(mean_nll)`;
against reference r, `Δ_T = mean_nll_m(T) − mean_nll_r(T)` and the AR share of the gap
`Σ_AR (nll_m − nll_r) / Σ_all (nll_m − nll_r)` (as is: it may exceed 1 or be negative; NaN when
the denominator is 0).

Uncertainty comes from resampling **windows** with replacement (tokens of one window are not
independent). Everything a statistic needs is a sum over windows, so the per-token table is
reduced once (in DuckDB) to per-window sums and each bootstrap replicate is a weighted sum:
`counts (B, W) @ sums (W, M)`. The same resampled windows are used for every model, so intervals
of Δ and of the AR share are paired. A fixed seed makes the intervals reproducible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SLICES = ("all", "ar", "other")
# Bootstrap replicates are drawn in chunks of CHUNK_CELLS (replicate, window) cells: a few int64
# arrays of that size (~100 MB) whatever the number of windows.
CHUNK_CELLS = 1 << 22


@dataclass
class WindowSums:
    """Per-window sufficient statistics of every model (W windows, M models)."""

    models: list[str]
    window_ids: np.ndarray  # (W,) int
    n_all: np.ndarray  # (W,) scored tokens per window
    n_ar: np.ndarray  # (W,) AR hits per window
    sum_all: np.ndarray  # (W, M) Σ nll over the window, per model
    sum_ar: np.ndarray  # (W, M) Σ nll over the window's AR hits, per model

    @property
    def n_windows(self) -> int:
        return len(self.window_ids)


def window_sums(con, models: list[str] | None = None) -> WindowSums:
    """Reduce `token_losses` of a results.duckdb connection to per-window sums."""
    windows = con.execute(
        """
        SELECT window_id, count(*) AS n_all, count(*) FILTER (WHERE is_ar_hit) AS n_ar
        FROM tags GROUP BY window_id ORDER BY window_id
        """
    ).fetchnumpy()
    window_ids = windows["window_id"].astype(np.int64)
    if models is None:
        models = [r[0] for r in con.execute("SELECT model FROM models ORDER BY model").fetchall()]
    per = con.execute(
        """
        SELECT model, window_id,
               fsum(nll::DOUBLE) AS s_all,
               coalesce(fsum(nll::DOUBLE) FILTER (WHERE is_ar_hit), 0) AS s_ar
        FROM token_losses GROUP BY model, window_id
        """
    ).fetchnumpy()
    sum_all = np.zeros((len(window_ids), len(models)))
    sum_ar = np.zeros((len(window_ids), len(models)))
    col = {m: i for i, m in enumerate(models)}
    keep = np.isin(per["model"], models)
    rows = np.searchsorted(window_ids, per["window_id"][keep].astype(np.int64))
    cols = np.array([col[m] for m in per["model"][keep]], dtype=np.int64)
    sum_all[rows, cols] = per["s_all"][keep]
    sum_ar[rows, cols] = per["s_ar"][keep]
    return WindowSums(
        models=list(models),
        window_ids=window_ids,
        n_all=windows["n_all"].astype(np.int64),
        n_ar=windows["n_ar"].astype(np.int64),
        sum_all=sum_all,
        sum_ar=sum_ar,
    )


def slice_statistics(
    n_all: np.ndarray, n_ar: np.ndarray, s_all: np.ndarray, s_ar: np.ndarray, ref: int
) -> dict[str, np.ndarray]:
    """Every reported statistic from (resampled) totals.

    Shapes: `n_all`, `n_ar` (...,) token counts; `s_all`, `s_ar` (..., M) loss sums; `ref` the
    reference model's column. Returns arrays of shape (..., M), except `pct_ar` (...,).
    """
    n_all = np.asarray(n_all, dtype=np.float64)[..., None]
    n_ar = np.asarray(n_ar, dtype=np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = {
            "all": s_all / n_all,
            "ar": s_ar / n_ar,
            "other": (s_all - s_ar) / (n_all - n_ar),
        }
        out: dict[str, np.ndarray] = {"pct_ar": 100.0 * n_ar[..., 0] / n_all[..., 0]}
        for t in SLICES:
            out[f"mean_nll_{t}"] = mean[t]
            out[f"ppl_{t}"] = np.exp(mean[t])
            out[f"delta_{t}"] = mean[t] - mean[t][..., ref : ref + 1]
        gap_all = s_all - s_all[..., ref : ref + 1]
        gap_ar = s_ar - s_ar[..., ref : ref + 1]
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


def bootstrap(
    sums: WindowSums, ref: int, n_replicates: int = 1000, seed: int = 0
) -> dict[str, np.ndarray]:
    """Every statistic of `slice_statistics` for `n_replicates` window resamples, (B, ...)."""
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    w = sums.n_windows
    chunk = max(1, min(n_replicates, CHUNK_CELLS // max(w, 1)))
    per_window = np.concatenate(
        [sums.n_all[:, None], sums.n_ar[:, None], sums.sum_all, sums.sum_ar], axis=1
    ).astype(np.float64)  # (W, 2 + 2M)
    m = len(sums.models)
    parts = []
    with tqdm(
        total=n_replicates, desc="bootstrap", unit="rep", disable=n_replicates < 2 * chunk
    ) as bar:
        for start in range(0, n_replicates, chunk):
            k = min(chunk, n_replicates - start)
            totals = resample_counts(rng, w, k) @ per_window  # (k, 2 + 2M)
            parts.append(totals)
            bar.update(k)
    totals = np.concatenate(parts) if parts else np.zeros((0, 2 + 2 * m))
    return slice_statistics(
        totals[:, 0], totals[:, 1], totals[:, 2 : 2 + m], totals[:, 2 + m :], ref
    )


def point_estimates(sums: WindowSums, ref: int) -> dict[str, np.ndarray]:
    return slice_statistics(
        sums.n_all.sum(), sums.n_ar.sum(), sums.sum_all.sum(axis=0), sums.sum_ar.sum(axis=0), ref
    )


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
        n_tokens=int(sums.n_all.sum()),
        n_ar_hits=int(sums.n_ar.sum()),
        n_windows=sums.n_windows,
        n_bootstrap=n_bootstrap,
        seed=seed,
        level=level,
        point=point,
        interval=interval,
    )
