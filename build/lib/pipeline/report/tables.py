"""Tables of the report: number formats, Markdown/HTML/CSV writers, and Table 1."""

from __future__ import annotations

import csv
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.io import write_bytes_atomic


def fmt_params(n: Any) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n)}"


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
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def query_rows_as_text(columns: list[str], rows: list[tuple]) -> list[list[str]]:
    def cell(c: str, v: Any) -> str:
        if isinstance(v, float):
            return fmt_num(v, 1 if c.startswith("pct") else 4)
        return "" if v is None else str(v)

    return [[cell(c, v) for c, v in zip(columns, r)] for r in rows]


# ---- Table 1 -----------------------------------------------------------------------------------


@dataclass
class Table1:
    header: list[str]
    rows: list[list[str]]
    csv_columns: list[str]
    csv_rows: list[tuple]


def table1(report, models_meta: dict[str, dict]) -> Table1:
    """Table-1-style rows: reference first, then the other models by name."""
    rows_by_model = {r["model"]: r for r in report.rows()}
    order = [report.reference] + [m for m in report.models if m != report.reference]
    has_ci = report.n_bootstrap > 0
    stats = ["ppl_all", "ppl_ar", "ppl_other", "delta_all", "delta_ar", "delta_other", "ar_share"]
    header = [
        "model",
        "architecture",
        "parameters",
        "ppl all",
        "ppl AR hits",
        "ppl other",
        "Δ log-ppl all",
        "Δ log-ppl AR",
        "Δ log-ppl other",
        "AR share of gap",
    ]
    rows, csv_rows = [], []
    for model in order:
        r = rows_by_model[model]
        meta = models_meta.get(model, {})

        def cell(key, digits=2, pct=False, r=r):
            return fmt_ci(r[key], r.get(f"{key}_lo"), r.get(f"{key}_hi"), digits, pct)

        is_ref = model == report.reference
        rows.append(
            [
                model + (" (reference)" if is_ref else ""),
                str(meta.get("architecture") or ""),
                fmt_params(meta.get("n_params")),
                cell("ppl_all"),
                cell("ppl_ar"),
                cell("ppl_other"),
                "0" if is_ref else cell("delta_all", 3),
                "0" if is_ref else cell("delta_ar", 3),
                "0" if is_ref else cell("delta_other", 3),
                "—" if is_ref else cell("ar_share", 1, pct=True),
            ]
        )
        values: list[Any] = [model, meta.get("architecture"), meta.get("n_params")]
        for key in stats:
            values.append(r[key])
            if has_ci:
                values += [r[f"{key}_lo"], r[f"{key}_hi"]]
        csv_rows.append(tuple(values))
    csv_columns = ["model", "architecture", "n_params"]
    for key in stats:
        csv_columns.append(key)
        if has_ci:
            csv_columns += [f"{key}_lo", f"{key}_hi"]
    return Table1(header, rows, csv_columns, csv_rows)
