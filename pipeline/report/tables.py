"""Tables of the report: number formats, Markdown/HTML/CSV writers, and Table 1."""

from __future__ import annotations

import csv
import html
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.analysis.slices import TABLE1_SLICES, Slice
from ar_slicing.machinery.io import write_bytes_atomic
from models.checkpoints.registry import fmt_params


def fmt_num(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_ci(v: float, lo: float | None, hi: float | None, digits: int = 2, pct: bool = False) -> str:
    scale = 100.0 if pct else 1.0
    suffix = "%" if pct else ""
    if v is None or math.isnan(v):
        return "—"
    text = f"{v * scale:.{digits}f}{suffix}"
    if lo is not None and hi is not None and not (math.isnan(lo) or math.isnan(hi)):
        text += f" [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return text


def csv_value(v: Any) -> Any:
    # 10 significant digits: stable across reruns whatever order DuckDB's threads add in.
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.10g}"
    return "" if v is None else v


def write_csv(path: Path, columns: list[str], rows: list[tuple]) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([csv_value(v) for v in row])
    write_bytes_atomic(path, buf.getvalue().encode())


def markdown_table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    """A Markdown table; by default a column is right-aligned when all its cells look numeric."""
    if align is None:
        align = [
            "r" if rows and all(_looks_numeric(r[i]) for r in rows) else "l"
            for i in range(len(header))
        ]
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _looks_numeric(cell: str) -> bool:
    head = cell.split(" ")[0].rstrip("%KMB").replace(",", "")
    try:
        float(head)
        return True
    except ValueError:
        return cell in ("", "—", "nan")


def html_table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell_html(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_WITH_INTERVAL = re.compile(r"(\S+) (\[[^\]]*\])")


def _cell_html(cell: str) -> str:
    """A cell; an interval after its value (`fmt_ci`) goes in a smaller grey span."""
    m = _WITH_INTERVAL.fullmatch(cell)
    if m is None:
        return html.escape(cell)
    return f'{html.escape(m.group(1))} <span class="ci">{html.escape(m.group(2))}</span>'


def query_rows_as_text(columns: list[str], rows: list[tuple]) -> list[list[str]]:
    def cell(c: str, v: Any) -> str:
        if isinstance(v, float):
            return fmt_num(v, 1 if c.startswith("pct") else 4)
        return "" if v is None else str(v)

    return [[cell(c, v) for c, v in zip(columns, r)] for r in rows]


# ---- Table 1 -----------------------------------------------------------------------------------


def ppl_header(s: Slice) -> str:
    """The header of a slice's perplexity column in Table 1."""
    return f"ppl {s.header}"


def delta_header(s: Slice) -> str:
    """The header of a slice's Δ log-ppl column in Table 1."""
    return f"Δ log-ppl {s.short}"


# Table 1's columns as shown: (header, statistic, digits, as a percentage); None: a model field.
# A slice's columns are named by its declaration (`ar_slicing.analysis.slices`).
TABLE1_COLUMNS = (
    ("model", None, 0, False),
    ("architecture", None, 0, False),
    ("parameters", None, 0, False),
    *((ppl_header(s), f"ppl_{s.name}", 2, False) for s in TABLE1_SLICES),
    *((delta_header(s), f"delta_{s.name}", 3, False) for s in TABLE1_SLICES),
    ("AR share of gap", "ar_share", 1, True),
    ("recall gain (nats)", "recall_gain", 3, False),
)
# Statistics relative to the reference: the reference's own row shows 0 (Δ) or — (its share).
_RELATIVE = {**{f"delta_{s.name}": "0" for s in TABLE1_SLICES}, "ar_share": "—"}


@dataclass
class Table1Text:
    header: list[str]
    rows: list[list[str]]
    csv_columns: list[str]
    csv_rows: list[tuple]

    def column(self, header: str) -> list[str]:
        i = self.header.index(header)
        return [r[i] for r in self.rows]


def table1_text(t1) -> Table1Text:
    """Table 1 (`ar_slicing.analysis.table1.Table1`) as text cells, and its CSV columns and rows."""
    rows = []
    for rec in t1.records():
        is_ref = rec["model"] == t1.reference
        meta = t1.models_meta.get(rec["model"], {})
        cells = [
            rec["model"] + (" (reference)" if is_ref else ""),
            str(meta.get("architecture") or ""),
            fmt_params(meta.get("n_params")),
        ]
        for _, key, digits, pct in TABLE1_COLUMNS[3:]:
            if is_ref and key in _RELATIVE:
                cells.append(_RELATIVE[key])
            else:
                cells.append(
                    fmt_ci(rec[key], rec.get(f"{key}_lo"), rec.get(f"{key}_hi"), digits, pct)
                )
        rows.append(cells)
    header = [h for h, *_ in TABLE1_COLUMNS]
    csv_rows = [tuple(rec[c] for c in t1.columns) for rec in t1.records()]
    return Table1Text(header, rows, t1.columns, csv_rows)


# ---- copy length ------------------------------------------------------------------------------


def copy_length_text(split: list[dict], merged: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The copy-length table (`ar_slicing.analysis.copy_length` rows): one row per model and copy bucket,
    the ppl over every span count, then per span-count bucket, each with its interval and tokens."""
    spans = sorted({(r["span_bucket"], r["span_label"]) for r in split if r["copy_bucket"]})
    header = ["model", "copy length", "tokens", "ppl (every span)"]
    header += [f"ppl, span count {label}" for _, label in spans]

    def cell(r):
        if r is None:
            return ""
        ci = fmt_ci(r["ppl"], r.get("ppl_lo"), r.get("ppl_hi"), 2)
        return f"{ci} n={r['n_tokens']:,}"

    by = {(r["model"], r["copy_bucket"], r["span_bucket"]): r for r in split}
    rows = []
    for r in merged:
        key = (r["model"], r["copy_bucket"])
        row = [r["model"], r["copy_label"] if r["copy_bucket"] else "none (not a repeat)"]
        row += [f"{r['n_tokens']:,}", fmt_ci(r["ppl"], r.get("ppl_lo"), r.get("ppl_hi"), 2)]
        row += [cell(by.get((*key, b))) if r["copy_bucket"] else "" for b, _ in spans]
        rows.append(row)
    return header, rows


def copy_length_by_subset_text(columns: list[str], rows: list[tuple]):
    """Per subset: ppl per copy bucket (every span count), from `copy_length.sql` by subset."""
    at = {c: k for k, c in enumerate(columns)}
    sums: dict[tuple, list[float]] = {}
    labels: dict[int, str] = {}
    for r in rows:
        key = (r[at["model"]], r[at["subset"]], r[at["copy_bucket"]])
        acc = sums.setdefault(key, [0, 0.0])
        acc[0] += r[at["n_tokens"]]
        acc[1] += r[at["sum_nll"]]
        labels[r[at["copy_bucket"]]] = r[at["copy_label"]]
    buckets = sorted(labels)
    header = ["model", "subset", *(f"ppl, copy {labels[b]}" for b in buckets)]
    out = []
    for model, subset in sorted({k[:2] for k in sums}):
        row = [model, subset]
        for b in buckets:
            n, s = sums.get((model, subset, b), (0, 0.0))
            row.append(f"{math.exp(s / n):.2f} n={n:,}" if n else "")
        out.append(row)
    return header, out


# ---- recall emergence -------------------------------------------------------------------------


def emergence_text(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The recall-emergence table (`ar_slicing.analysis.emergence` rows): per model and point of its
    training, the tokens seen, the windows compared, and the recall gain, its part at training
    count 0 and the ppl on AR hits and other tokens, each with its interval."""
    header = [
        "model",
        "checkpoint",
        "step",
        "tokens seen",
        "windows",
        "recall gain (nats)",
        "gain, count 0 (nats)",
        "ppl AR hits",
        "ppl other",
    ]
    out = []
    for r in rows:
        out.append(
            [
                r["model"],
                r["checkpoint"] + (" (final)" if r["final"] else ""),
                f"{r['step']:,}",
                f"{r['tokens_seen']:,}",
                f"{r['n_windows']:,}",
                *(
                    fmt_ci(r[key], r[f"{key}_lo"], r[f"{key}_hi"], digits)
                    for key, digits in (
                        ("recall_gain", 3),
                        ("recall_gain_count0", 3),
                        ("ppl_ar", 2),
                        ("ppl_other", 2),
                    )
                ),
            ]
        )
    return header, out


def seeds_text(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The spread across seeds (`pipeline.report.stage.seed_rows`): per recipe and step, the runs
    there and each statistic's mean over them with the least and greatest run."""
    header = [
        "recipe",
        "step",
        "runs",
        "recall gain (nats)",
        "gain, count 0 (nats)",
        "induction score (nats)",
        "recall acc. (mean over k)",
    ]

    def spread(r: dict, key: str) -> str:
        v, lo, hi = r[key], r[f"{key}_min"], r[f"{key}_max"]
        if v is None or math.isnan(v):
            return "—"
        return f"{v:.3f}" if r["runs"] == 1 or lo == hi else f"{v:.3f} ({lo:.3f} to {hi:.3f})"

    out = []
    for r in rows:
        keys = ("recall_gain", "recall_gain_count0", "induction_score", "recall_accuracy")
        out.append([r["recipe"], f"{r['step']:,}", str(r["runs"]), *(spread(r, k) for k in keys)])
    return header, out


# ---- probes ------------------------------------------------------------------------------------


def probes_text(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The probes' table (`probe_rows`): per model and checkpoint, the induction score with its
    interval and second-copy accuracy, zero-shot recall accuracy over k and at the largest k,
    the in-context learning score (all tokens, AR hits), and the recall gain at that point."""
    header = [
        "model",
        "step",
        "induction score (nats)",
        "2nd-copy acc.",
        "recall acc. (mean over k)",
        "recall acc. (largest k)",
        "ICL score all",
        "ICL score AR",
        "recall gain (nats)",
    ]

    def num(v, digits: int) -> str:
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"

    out = []
    for r in rows:
        out.append(
            [
                r["model"],
                "—" if r["step"] is None else f"{r['step']:,}",
                fmt_ci(r["induction_score"], r["induction_score_lo"], r["induction_score_hi"], 3),
                num(r["second_accuracy"], 3),
                num(r["recall_accuracy"], 3),
                f"{num(r['recall_accuracy_max_k'], 3)} (k={r['max_k']})",
                num(r["icl_all"], 3),
                num(r["icl_ar"], 3),
                fmt_ci(r["recall_gain"], r["recall_gain_lo"], r["recall_gain_hi"], 3),
            ]
        )
    return header, out
