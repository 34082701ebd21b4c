"""Copy-length slices with bootstrap intervals: perplexity per copy-length x span-count bucket.

The cells are those of `queries/copy_length.sql` (copy buckets by `match_len`: 1, 2-3, 4-7,
8-15, 16+, and 'none' for the non-repeats; span buckets by `span_train_count`: 0, 1..threshold,
above), read once per window so that intervals come from resampling windows exactly as Table 1's
do (`ar_slicing.analysis.metrics.resampled_totals`: with the same seed, the same resamples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the last copy bucket of the table (16+) and of the figure's curve (1024+)
TABLE_MAX_BUCKET = 5
CURVE_MAX_BUCKET = 11
# span buckets merged: one row per copy bucket over every span count ("all"), or novel/seen
MERGED = {"all": (0, 1, 2), "novel": (0,), "seen": (1, 2)}


@dataclass(frozen=True)
class Cell:
    copy_bucket: int
    copy_label: str
    span_bucket: int | None  # None: every span count (or a non-repeat)
    span_label: str


def copy_length_rows(
    con,
    *,
    n_bootstrap: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    max_bucket: int = TABLE_MAX_BUCKET,
    spans: str = "split",
) -> list[dict]:
    """One dict per (model, cell) with tokens, mean NLL and ppl, with `_lo`/`_hi` bounds.

    `spans`: "split" gives the span buckets 0, 1-T, >T of every repeat bucket; "all" one row per
    copy bucket; "novel_seen" the two rows novel (span count 0) and seen (1 or more). The
    non-repeats are the row of copy bucket 0 in every case.
    """
    from ar_slicing.analysis.metrics import intervals, resampled_totals
    from ar_slicing.analysis.sql import run_named_query

    cols, rows = run_named_query(
        con, "copy_length", {"by_window": "true", "max_bucket": str(max_bucket)}
    )
    at = {c: k for k, c in enumerate(cols)}
    windows = [
        r[0] for r in con.execute("SELECT DISTINCT window_id FROM tags ORDER BY 1").fetchall()
    ]
    models = sorted({r[at["model"]] for r in rows})
    labels = {r[at["copy_bucket"]]: r[at["copy_label"]] for r in rows}
    span_labels = {r[at["span_bucket"]]: r[at["span_label"]] for r in rows}
    cells, index = _cells(labels, span_labels, spans)
    w_of = {w: k for k, w in enumerate(windows)}
    m_of = {m: k for k, m in enumerate(models)}
    n = np.zeros((len(windows), len(cells)))
    s = np.zeros((len(windows), len(cells), len(models)))
    for r in rows:
        w, m = w_of[r[at["window_id"]]], m_of[r[at["model"]]]
        for c in index[(r[at["copy_bucket"]], r[at["span_bucket"]])]:
            if m == 0:  # every model scores the same tokens: count them once
                n[w, c] += r[at["n_tokens"]]
            s[w, c, m] += r[at["sum_nll"]]
    point_mean = _means(n.sum(axis=0), s.sum(axis=0))
    bounds = {}
    if n_bootstrap > 0 and windows:
        per_window = np.concatenate([n, s.reshape(len(windows), -1)], axis=1)
        totals = resampled_totals(per_window, n_bootstrap, seed, desc="bootstrap: copy length")
        k = len(cells)
        reps = _means(totals[:, :k], totals[:, k:].reshape(n_bootstrap, k, len(models)))
        bounds = intervals({"mean_nll": reps}, level)["mean_nll"]
    out = []
    for m, model in enumerate(models):
        for c, cell in enumerate(cells):
            tokens = int(n[:, c].sum())
            if tokens == 0:
                continue
            mean = float(point_mean[c, m])
            row = {
                "model": model,
                "copy_bucket": cell.copy_bucket,
                "copy_label": cell.copy_label,
                "span_bucket": cell.span_bucket,
                "span_label": cell.span_label,
                "n_tokens": tokens,
                "mean_nll": mean,
                "ppl": float(np.exp(mean)),
            }
            if bounds:
                lo, hi = float(bounds[0][c, m]), float(bounds[1][c, m])
                row |= {"mean_nll_lo": lo, "mean_nll_hi": hi}
                row |= {"ppl_lo": float(np.exp(lo)), "ppl_hi": float(np.exp(hi))}
            out.append(row)
    return out


def _means(n: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Mean NLL per cell and model: s (..., C, M) / n (..., C)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return s / n[..., None]


def _cells(labels: dict, span_labels: dict, spans: str):
    """The cells to report and, for each (copy bucket, span bucket) of the query, those it adds to."""
    cells: list[Cell] = []
    index: dict[tuple, list[int]] = {}
    groups = {
        "split": {b: (b,) for b in sorted(k for k in span_labels if k is not None)},
        "all": {None: MERGED["all"]},
        "novel_seen": {0: MERGED["novel"], 1: MERGED["seen"]},
    }[spans]
    names = {"split": None, "all": "all", "novel_seen": ("novel", "seen")}[spans]
    for copy_bucket in sorted(labels):
        if copy_bucket == 0:
            index[(0, None)] = [len(cells)]
            cells.append(Cell(0, labels[0], None, "—"))
            continue
        for g, (key, members) in enumerate(groups.items()):
            if names is None:
                label = span_labels[key]
            elif isinstance(names, tuple):
                label = names[g]
            else:
                label = names
            for b in members:
                index.setdefault((copy_bucket, b), []).append(len(cells))
            cells.append(Cell(copy_bucket, labels[copy_bucket], key, label))
    return cells, index
