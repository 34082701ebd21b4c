"""Recall emergence: how a model's in-context recall grows along its training (docs/design.md,
"Recall emergence"). The points of a model's curve are its evaluated checkpoints (losses folders
whose meta.json names the model as `checkpoint_of`, with their step and tokens seen) and the
model itself when it records where its training ended (a model this project trained). Every
statistic of a model's curve is computed on the windows every one of its points scored, so the
points compare the same tokens; the windows of Table 1 are not touched.

At each point: the in-context recall gain (Table 1's definition, `ar_slicing.analysis.metrics`), its part
at training count 0 (bigrams never seen in training: the gain in bucket 0 alone), and the
perplexity on AR hits and on other tokens, each with a 95% bootstrap interval over windows. The
windows are resampled as Table 1's are (`resampled_totals`, one seed), the same resamples for
every point of a model, so the intervals of two points are paired.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.windows import scored_window_ids
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import RunLayout, meta_path

# the statistics of a point, in column order (each with `_lo`/`_hi` when bootstrapped)
STATISTICS = ("recall_gain", "recall_gain_count0", "ppl_ar", "ppl_other")


@dataclass(frozen=True)
class Point:
    """One point of a model's emergence curve: a losses folder and where along training."""

    model: str  # the model whose training it follows
    checkpoint: str  # its losses folder's name (`<model>@step<n>`, or the model's own)
    step: int
    tokens_seen: int
    final: bool  # the model itself, at the end of its training
    windows: np.ndarray  # the ids of the windows it scored


def losses_windows(meta: dict, n_windows: int) -> np.ndarray:
    """The ids of the windows a losses folder scored, from its meta.json (`n_windows`: the
    tags' count, for a meta.json that does not record it)."""
    return scored_window_ids(
        int(meta.get("windows_total", n_windows)),
        meta.get("window_subset"),
        meta.get("windows_evaluated"),
    )


def emergence_points(
    layout: RunLayout, models: list[str], checkpoints: list[str], n_windows: int
) -> list[Point]:
    """Every point of every model's curve, by model and step: each losses folder of
    `checkpoints` (complete, with `checkpoint_of`), and each of `models` that records its step
    and has a checkpoint among them."""
    points = []
    for name in checkpoints:
        meta = read_json(meta_path(layout.losses(name)))
        points.append(_point(meta["checkpoint_of"], name, meta, False, n_windows))
    followed = {p.model for p in points}
    for name in models:
        meta = read_json(meta_path(layout.losses(name)))
        if name in followed and meta.get("step") is not None:
            points.append(_point(name, name, meta, True, n_windows))
    return sorted(points, key=lambda p: (p.model, p.step, p.final, p.checkpoint))


def _point(model: str, name: str, meta: dict, final: bool, n_windows: int) -> Point:
    return Point(
        model, name, int(meta["step"]), int(meta["tokens_seen"]), final,
        losses_windows(meta, n_windows),
    )  # fmt: skip


def common_windows(points: list[Point]) -> dict[str, np.ndarray]:
    """model -> the windows every one of its points scored (increasing ids)."""
    out: dict[str, np.ndarray] = {}
    for p in points:
        out[p.model] = p.windows if p.model not in out else np.intersect1d(out[p.model], p.windows)
    return out


# ---- the statistics ------------------------------------------------------------------------------


def emergence_rows(con, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> list[dict]:
    """One dict per point of every model's curve (by model, then step) with `tokens_seen`,
    `n_windows`, `n_tokens`, `n_ar_hits` and every statistic of `STATISTICS` with its `_lo`/`_hi`
    bounds (NaN without a bootstrap, or where a statistic has no value), from a results.duckdb
    connection (`checkpoints` and `checkpoint_token_losses`)."""
    points = con.execute(
        "SELECT model, checkpoint, step, tokens_seen, final FROM checkpoints "
        "ORDER BY model, step, final, checkpoint"
    ).fetchall()
    out = []
    for model in dict.fromkeys(p[0] for p in points):
        mine = [p for p in points if p[0] == model]
        out += _model_rows(con, model, mine, n_bootstrap, seed, level)
    return out


def _model_rows(con, model: str, points: list[tuple], n_bootstrap, seed, level) -> list[dict]:
    from ar_slicing.analysis.metrics import (
        bucket_sums,
        intervals,
        recall_gain_statistics,
        resampled_totals,
        slice_statistics,
    )
    from ar_slicing.analysis.slices import (
        ALL,
        AR,
        SLICE_NAMES,
        SLICES,
        slice_counts_sql,
        slice_sums_sql,
    )

    names = [p[1] for p in points]
    per = con.execute(
        f"""
        SELECT checkpoint, window_id, count_bucket(train_count) AS bucket, is_repeat,
               count(*) AS n, fsum(nll::DOUBLE) AS s, {slice_counts_sql()}, {slice_sums_sql()}
        FROM checkpoint_token_losses WHERE model = $model
        GROUP BY ALL
        """,
        {"model": model},
    ).fetchnumpy()
    windows = np.unique(per["window_id"].astype(np.int64))
    buckets, count, loss = bucket_sums(per, windows, names, model_key="checkpoint")
    w, k, m, n_slices = len(windows), len(buckets), len(names), len(SLICES)
    # every slice's tokens (the first point's rows: every point scores the same tokens) and sums
    rows = np.searchsorted(windows, per["window_id"].astype(np.int64))
    point = np.array([names.index(c) for c in per["checkpoint"]], dtype=np.int64)
    first = point == 0
    n_in = np.zeros((w, n_slices))
    s_in = np.zeros((w, n_slices, m))
    for j, sl in enumerate(SLICES):
        np.add.at(n_in[:, j], rows[first], per[f"n_{sl.name}"][first])
        np.add.at(s_in[:, j], (rows, point), per[f"s_{sl.name}"])
    per_window = np.concatenate(
        [
            count[1], count[0], loss[1].reshape(w, -1), loss[0].reshape(w, -1),
            n_in, s_in.reshape(w, -1),
        ],
        axis=1,
    )  # (W, 2K + 2KM + S + SM)  # fmt: skip

    def statistics(totals: np.ndarray) -> dict[str, np.ndarray]:
        """Every statistic of every point from (resampled) column totals (..., C)."""
        at = np.cumsum([0, k, k, k * m, k * m, n_slices, n_slices * m])
        part = [totals[..., a:b] for a, b in zip(at[:-1], at[1:])]
        lead = totals.shape[:-1]
        gain = recall_gain_statistics(
            part[0], part[1], part[2].reshape(*lead, k, m), part[3].reshape(*lead, k, m)
        )
        zero = np.flatnonzero(buckets == 0)
        count0 = (
            gain["gain_by_bucket"][..., zero[0], :] if zero.size else np.full((*lead, m), np.nan)
        )
        ppl = slice_statistics(part[4], part[5].reshape(*lead, n_slices, m), 0, SLICE_NAMES)
        return {
            "recall_gain": gain["recall_gain"],
            "recall_gain_count0": count0,
            "ppl_ar": ppl["ppl_ar"],
            "ppl_other": ppl["ppl_other"],
        }

    estimate = statistics(per_window.sum(axis=0))
    bounds = {}
    if n_bootstrap > 0 and w:
        totals = resampled_totals(per_window, n_bootstrap, seed, desc=f"bootstrap: {model}")
        bounds = intervals(statistics(totals), level)
    out = []
    for i, (_, name, step, tokens_seen, final) in enumerate(points):
        row = {
            "model": model,
            "checkpoint": name,
            "step": int(step),
            "tokens_seen": int(tokens_seen),
            "final": bool(final),
            "n_windows": w,
            "n_tokens": int(n_in[:, SLICE_NAMES.index(ALL.name)].sum()),
            "n_ar_hits": int(n_in[:, SLICE_NAMES.index(AR.name)].sum()),
        }
        for key in STATISTICS:
            row[key] = float(estimate[key][i])
            lo, hi = bounds.get(key, (np.full(m, np.nan), np.full(m, np.nan)))
            row[f"{key}_lo"], row[f"{key}_hi"] = float(lo[i]), float(hi[i])
        out.append(row)
    return out


def emergence_paths(layout: RunLayout, points: list[Point]) -> list[Path]:
    """The Parquet parts the emergence views read (for `open_run(read_only_files=True)`)."""
    names = dict.fromkeys(point.checkpoint for point in points)
    return [part for name in names for part in layout.loss_parts(name)]
