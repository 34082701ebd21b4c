"""`arslice query`: run one SQL question from `queries/` against a run's results.duckdb.

Each `queries/<name>.sql` is plain DuckDB SQL over the views of `results.duckdb` (see
`ar_slicing/analysis/results.py`), with values bound as `$name` parameters, so the same file runs
unchanged from Python (`ar_slicing.open_run(RUN).query(NAME, **params)`, or DuckDB itself)::

    con = duckdb.connect("runs/pile/results.duckdb", read_only=True)
    con.execute(open("queries/gap_vs_reference.sql").read(), {"reference": "attention"}).fetchall()

Loading and running the files is `ar_slicing.analysis.sql`'s; this module parses `--param NAME=VALUE`
flags and prints the result as a table, CSV or JSON.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from ar_slicing.analysis.sql import available_queries, load_query, run_named_query
from ar_slicing.errors import ArSliceError
from pipeline.config import Command

FORMATS = ("table", "csv", "json")


@dataclass(frozen=True)
class QueryConfig:
    name: str = field(
        metadata={
            "help": "query name: a file stem in queries/ (e.g. slice_perplexity)",
            "positional": True,
        }
    )
    run: str = field(metadata={"help": "run directory (holds tags/, losses/, results.duckdb)"})
    param: list[str] = field(
        default_factory=list,
        metadata={
            "help": "a query parameter as NAME=VALUE; repeat the flag for several",
            "repeatable": True,
        },
    )
    format: str = field(
        default="table", metadata={"help": "output format", "choices": list(FORMATS)}
    )


def parse_params(items: list[str]) -> dict[str, str]:
    """`["k=v", ...]` -> {k: v}; values stay strings (each query casts its parameters itself)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ArSliceError(
                f"--param {item!r}: expected NAME=VALUE, e.g. --param reference=attention"
            )
        out[key.strip()] = value
    return out


# ---- output ------------------------------------------------------------------------------------


def format_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4f}" if abs(v) < 1e6 else f"{v:.4g}"
    return str(v)


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """An aligned plain-text table (numbers right-aligned)."""
    cells = [[format_value(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(columns))
    ]

    def line(values):
        return "  ".join(
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)
        ).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def format_csv(columns: list[str], rows: list[tuple]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in row])
    return buf.getvalue()


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


def format_json(columns: list[str], rows: list[tuple]) -> str:
    return json.dumps([{c: _jsonable(v) for c, v in zip(columns, row)} for row in rows], indent=2)


FORMATTERS = {"table": format_table, "csv": format_csv, "json": format_json}


def run_query(cfg: QueryConfig) -> dict:
    """Print the result of `queries/<cfg.name>.sql` on the run `cfg.run`."""
    from ar_slicing.analysis.results import open_results
    from ar_slicing.machinery.ownership import results_lock

    if cfg.format not in FORMATTERS:
        raise ArSliceError(f"--format {cfg.format!r}: choose one of {', '.join(FORMATS)}")
    query, params = load_query(cfg.name), parse_params(cfg.param)
    with results_lock(cfg.run, wait=True):  # (a rebuild by another query: wait for it)
        con = open_results(cfg.run)
    try:
        columns, rows = run_named_query(con, query, params)
    finally:
        con.close()
    text = FORMATTERS[cfg.format](columns, rows)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return {"query": cfg.name, "params": params, "columns": columns, "rows": len(rows)}


COMMAND = Command(
    QueryConfig,
    run_query,
    inputs=lambda cfg: [("--run", cfg.run, "dir")],
    summary="run one SQL question from queries/ against a run",
    description=(
        "Run queries/NAME.sql against RUN/results.duckdb (built or refreshed first when needed) "
        "and print the result. Queries: "
        + ", ".join(available_queries())
        + ". Values are bound as $parameters, never formatted into the SQL."
    ),
    examples="""\
  arslice query slice_perplexity --run runs/pile
  arslice query gap_vs_reference --run runs/pile --param reference=pythia-160m --format csv
  arslice query examples --run runs/pile --param limit=5 --format json""",
)
