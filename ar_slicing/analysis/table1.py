"""Table 1 of a run as numbers: per model, perplexity on each slice of Table 1 (all tokens / AR
hits / other tokens, as `ar_slicing.analysis.slices` declares them), the gap to the reference per slice,
the AR share of the gap and the in-context recall gain, each with its 95% bootstrap interval over
windows.

`arslice report` formats it (report.md, report.html, table1.csv) and `ar_slicing.analysis.api.Run.table1`
returns it as a polars DataFrame; both come from `compute_table1`, so they agree by construction.
Every column is bootstrapped from the same resampled windows (one seed; `ar_slicing.analysis.metrics`),
so the intervals of Δ, the AR share and the recall gain are paired.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ar_slicing.analysis.metrics import (
    RecallGainReport,
    SliceReport,
    recall_gain_report,
    slice_report,
    window_sums,
)
from ar_slicing.analysis.slices import SLICES, TABLE1_SLICES
from ar_slicing.errors import ArSliceError

# The statistics of Table 1, in column order (each with `_lo`/`_hi` when bootstrapped): the
# perplexity of each of its slices, the gap of each to the reference, the AR share, the gain.
STATISTICS = (
    *(f"ppl_{s.name}" for s in TABLE1_SLICES),
    *(f"delta_{s.name}" for s in TABLE1_SLICES),
    "ar_share",
    "recall_gain",
)
MODEL_FIELDS = ("model", "architecture", "n_params")


@dataclass
class Table1:
    """Table 1's numbers: the reference first, then the other models by name."""

    reference: str
    order: list[str]
    models_meta: dict[str, dict]  # model -> its row of the `models` table
    slices: SliceReport
    recall: RecallGainReport

    @property
    def n_bootstrap(self) -> int:
        return self.slices.n_bootstrap

    @property
    def columns(self) -> list[str]:
        out = list(MODEL_FIELDS)
        for key in STATISTICS:
            out.append(key)
            if self.n_bootstrap:
                out += [f"{key}_lo", f"{key}_hi"]
        return out

    def records(self) -> list[dict[str, Any]]:
        """One dict per model, in `order`, keyed by `columns` (NaN where a statistic has no
        value, e.g. the reference's own AR share)."""
        slices = {r["model"]: r for r in self.slices.rows()}
        recall = {r["model"]: r for r in self.recall.rows()}
        out = []
        for model in self.order:
            meta = self.models_meta.get(model, {})
            values = {**slices[model], **recall[model]}
            rec: dict[str, Any] = {
                "model": model,
                "architecture": meta.get("architecture"),
                "n_params": meta.get("n_params"),
            }
            for key in self.columns[len(MODEL_FIELDS) :]:
                rec[key] = values[key]
            out.append(rec)
        return out


def models_table(con) -> dict[str, dict]:
    """The `models` table of a results.duckdb connection: model -> row (by model name)."""
    cur = con.execute("SELECT * FROM models ORDER BY model")
    columns = [d[0] for d in cur.description]
    return {r[0]: dict(zip(columns, r)) for r in cur.fetchall()}


def resolve_reference(con, reference: str | None, models: list[str], where: str) -> str:
    """`reference`, or the run's default one; refused unless it names a model of the run."""
    if reference is None:
        reference = con.execute(
            "SELECT value FROM run_info WHERE key = 'default_reference'"
        ).fetchone()[0]
    if reference not in models:
        raise ArSliceError(
            f"reference {reference!r} is not a model of {where}; models: {', '.join(models)}"
        )
    return reference


def compute_slices(
    con, reference: str | None = None, n_bootstrap: int = 1000, seed: int = 0
) -> tuple[dict[str, dict], SliceReport]:
    """The `models` table and every slice's statistics (`ar_slicing.analysis.slices`, those Table 1
    leaves out too) of the run behind the results.duckdb connection `con` (`reference` None:
    the run's default, its attention model); `n_bootstrap` resamples of windows, 0 for none."""
    if n_bootstrap < 0:
        raise ArSliceError(f"bootstrap {n_bootstrap}: must be 0 (no intervals) or more")
    meta = models_table(con)
    models = list(meta)
    run_dir = con.execute("SELECT value FROM run_info WHERE key = 'run_dir'").fetchone()[0]
    reference = resolve_reference(con, reference, models, run_dir)
    return meta, slice_report(
        window_sums(con, models), reference, n_bootstrap=n_bootstrap, seed=seed
    )


def compute_table1(
    con, reference: str | None = None, n_bootstrap: int = 1000, seed: int = 0
) -> Table1:
    """Table 1 of the run behind the results.duckdb connection `con` (arguments as for
    `compute_slices`)."""
    meta, slices = compute_slices(con, reference, n_bootstrap, seed)
    models = list(meta)
    recall = recall_gain_report(con, models, n_bootstrap=n_bootstrap, seed=seed)
    order = [slices.reference] + [m for m in models if m != slices.reference]
    return Table1(slices.reference, order, meta, slices, recall)


# The columns of `slice_records`, in order (the statistics with `_lo`/`_hi` when bootstrapped).
SLICE_FIELDS = ("model", "slice", "label", "in_table1", "n_tokens")
SLICE_STATISTICS = ("mean_nll", "ppl", "delta")


def slice_records(report: SliceReport) -> list[dict[str, Any]]:
    """One dict per model and declared slice (the reference first, then the models by name; the
    slices in declaration order): its tokens, mean NLL, perplexity and Δ (mean NLL minus the
    reference's), each with its interval when bootstrapped."""
    rows = {r["model"]: r for r in report.rows()}
    order = [report.reference] + [m for m in report.models if m != report.reference]
    out = []
    for model in order:
        for s in SLICES:
            rec: dict[str, Any] = {
                "model": model,
                "slice": s.name,
                "label": s.label,
                "in_table1": s.in_table1,
                "n_tokens": report.slice_tokens[s.name],
            }
            for key in SLICE_STATISTICS:
                rec[key] = rows[model][f"{key}_{s.name}"]
                if report.n_bootstrap:
                    rec[f"{key}_lo"] = rows[model][f"{key}_{s.name}_lo"]
                    rec[f"{key}_hi"] = rows[model][f"{key}_{s.name}_hi"]
            out.append(rec)
    return out
