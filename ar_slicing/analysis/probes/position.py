"""Loss by position on the run's own windows, per slice, and the in-context learning score
(Olsson et al. 2022: the loss at a late position minus the loss at an early one; docs/design.md,
"Probes of a checkpoint"), from the per-token table of tags joined with a model's losses.

The positions are Olsson et al.'s 50 and 500 of a 2048-token window scaled to the run's window
`L`, rounded half up: `early = max(1, floor(50 L / 2048 + 1/2))`, `late = floor(500 L / 2048 +
1/2)` (L = 256: 6 and 63). Only windows that reach `late` count, at both positions, so a short
last window does not weigh on one side only.
"""

from __future__ import annotations

import math

import numpy as np

from ar_slicing.analysis.probes.intervals import bootstrap_interval, frame
from ar_slicing.analysis.slices import TABLE1_SLICES
from ar_slicing.errors import ArSliceError

# Olsson et al. 2022's positions of the in-context learning score, in their 2048-token context
OLSSON_WINDOW, OLSSON_EARLY, OLSSON_LATE = 2048, 50, 500


def icl_positions(window: int) -> tuple[int, int]:
    """(early, late) positions of the in-context learning score in windows of `window` tokens.

    >>> icl_positions(2048), icl_positions(256), icl_positions(128)
    ((50, 500), (6, 63), (3, 31))
    """
    early = max(1, math.floor(OLSSON_EARLY * window / OLSSON_WINDOW + 0.5))
    late = math.floor(OLSSON_LATE * window / OLSSON_WINDOW + 0.5)
    if late <= early:
        raise ArSliceError(
            f"window {window}: too short for an in-context learning score (its early and late "
            f"positions, {early} and {late}, must differ)"
        )
    return early, late


# Table 1's slices: their predicates read `is_ar_hit` only, which the probes' inputs hold
SLICES = tuple(s.name for s in TABLE1_SLICES)


def _slice_masks() -> dict:
    """Each of `SLICES` as a polars expression: its predicate (`ar_slicing.analysis.slices`) as written."""
    import polars as pl

    return {s.name: pl.sql_expr(s.where) for s in TABLE1_SLICES}


def _models(df) -> list:
    return sorted(df["model"].unique().to_list()) if "model" in df.columns else [None]


def loss_by_position(token_losses):
    """Mean NLL per window position and slice: a polars DataFrame (`model` when the input has
    one,) `slice`, `pos`, `tokens`, `mean_nll`, by slice then pos. `token_losses` holds
    `window_id, pos, nll, is_ar_hit` (tags joined with losses; `model` too for several)."""
    import polars as pl

    df = frame(token_losses)
    keys = ["model"] if "model" in df.columns else []
    masks = _slice_masks()
    parts = [
        df.filter(masks[name])
        .group_by(*keys, "pos")
        .agg(pl.len().alias("tokens"), pl.col("nll").cast(pl.Float64).mean().alias("mean_nll"))
        .with_columns(pl.lit(name).alias("slice"))
        for name in SLICES
    ]
    order = {name: i for i, name in enumerate(SLICES)}
    return (
        pl.concat(parts)
        .with_columns(pl.col("slice").replace_strict(order, return_dtype=pl.Int8).alias("_order"))
        .sort(*keys, "_order", "pos")
        .select(*keys, "slice", "pos", "tokens", "mean_nll")
    )


def _per_window(df, early: int, late: int, mask) -> np.ndarray:
    """(W, 4) per window reaching `late`: tokens and NLL sum of the slice at `early`, then at
    `late`."""
    import polars as pl

    reaching = df.group_by("window_id").agg(pl.col("pos").max().alias("last"))
    reaching = reaching.filter(pl.col("last") >= late).select("window_id")
    at = df.join(reaching, on="window_id").filter(pl.col("pos").is_in([early, late]))
    nll = pl.col("nll").cast(pl.Float64)
    sums = (
        at.group_by("window_id")
        .agg(
            (mask & (pl.col("pos") == early)).sum().cast(pl.Float64).alias("n_early"),
            nll.filter(mask & (pl.col("pos") == early)).sum().alias("sum_early"),
            (mask & (pl.col("pos") == late)).sum().cast(pl.Float64).alias("n_late"),
            nll.filter(mask & (pl.col("pos") == late)).sum().alias("sum_late"),
        )
        .sort("window_id")
    )
    return sums.select("n_early", "sum_early", "n_late", "sum_late").to_numpy()


def _icl(totals: np.ndarray) -> np.ndarray:
    """mean NLL at late − mean NLL at early, of totals (..., 4) as `_per_window` sums."""
    return totals[..., 3] / totals[..., 2] - totals[..., 1] / totals[..., 0]


def icl_score(
    token_losses, window: int, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95
):
    """The in-context learning score per slice (and model): a polars DataFrame of `slice`,
    `early`, `late`, `windows` (those reaching `late`), `tokens_early`, `tokens_late`,
    `nll_early`, `nll_late`, `score = nll_late - nll_early` (negative: the model predicts better
    with more context; null where the slice has no token at one of the positions) and its
    percentile bootstrap interval over windows, `score_lo`, `score_hi` (the same seed and
    windows: the same resamples for every model and slice, so their intervals are paired)."""
    import polars as pl

    df = frame(token_losses)
    early, late = icl_positions(window)
    masks = _slice_masks()
    rows = []
    for model in _models(df):
        of_model = df if model is None else df.filter(pl.col("model") == model)
        for name in SLICES:
            per_window = _per_window(of_model, early, late, masks[name])
            totals = per_window.sum(axis=0) if len(per_window) else np.zeros(4)
            defined = totals[0] > 0 and totals[2] > 0
            lo, hi = (
                bootstrap_interval(per_window, _icl, n_bootstrap, seed, level)
                if defined
                else (None, None)
            )
            rows.append(
                {
                    **({} if model is None else {"model": model}),
                    "slice": name,
                    "early": early,
                    "late": late,
                    "windows": len(per_window),
                    "tokens_early": int(totals[0]),
                    "tokens_late": int(totals[2]),
                    "nll_early": float(totals[1] / totals[0]) if totals[0] else None,
                    "nll_late": float(totals[3] / totals[2]) if totals[2] else None,
                    "score": float(_icl(totals)) if defined else None,
                    "score_lo": lo,
                    "score_hi": hi,
                }
            )
    return pl.DataFrame(rows)
