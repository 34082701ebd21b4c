"""How the probes' statistics read their tables (`frame`) and their bootstrap intervals:
resampling sequences (induction, recall) or windows (in-context learning score) with
replacement, as Table 1 resamples windows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def frame(table):
    """A polars DataFrame of a probe table (pyarrow Table, polars DataFrame or LazyFrame)."""
    import polars as pl

    if isinstance(table, pl.LazyFrame):
        return table.collect()
    if isinstance(table, pl.DataFrame):
        return table
    return pl.from_arrow(table)


def bootstrap_interval(
    per_unit: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    n_bootstrap: int,
    seed: int,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of `statistic(column totals (B, C)) -> (B,)` over `n_bootstrap`
    resamples of the rows of `per_unit` (U, C) (`ar_slicing.analysis.metrics.resampled_totals`: the same
    seed over the same number of rows draws the same resamples); (nan, nan) without resamples."""
    from ar_slicing.analysis.metrics import intervals, resampled_totals

    if n_bootstrap <= 0 or len(per_unit) == 0:
        return float("nan"), float("nan")
    totals = resampled_totals(np.asarray(per_unit, dtype=np.float64), n_bootstrap, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        replicates = statistic(totals)
    lo, hi = intervals({"statistic": replicates}, level)["statistic"]
    return float(lo), float(hi)
