"""`arslice query`: run one SQL question from `queries/` against a run's results.duckdb.

Each `queries/<name>.sql` is plain DuckDB SQL over the views of `results.duckdb` (see
`ar_slicing/results.py`), with values bound as `$name` parameters, so the same file runs
unchanged from Python::

    con = duckdb.connect("runs/pile/results.duckdb", read_only=True)
    con.execute(open("queries/gap_vs_reference.sql").read(), {"reference": "attention"}).fetchall()

A query's leading `--` comment says what it answers; a comment line `-- $name  help (default: X)`
documents a parameter and its default. `$reference` defaults to the run's reference model (the
attention model when there is one), as in `arslice report`.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from pipeline.config import Command

# queries/ is a package of its own (its .sql files are package data), editable install or wheel.
QUERIES_DIR = Path(importlib.import_module("queries").__file__).resolve().parent
FORMATS = ("table", "csv", "json")
_PARAM_DOC = re.compile(r"^--\s*\$(\w+)\s+(.*?)\s*$")
_DEFAULT = re.compile(r"\(default:\s*([^)]*)\)")


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


@dataclass
class SqlQuery:
    """One file of queries/: its SQL, one-line summary and documented parameters."""

    name: str
    path: Path
    sql: str
    summary: str
    params: dict[str, str]  # name -> help line
    defaults: dict[str, str]  # name -> default value as written in the help line

    @property
    def required(self) -> set[str]:
        """The `$names` the SQL binds (what DuckDB itself reports for the statement)."""
        import duckdb

        con = duckdb.connect()
        try:
            names: set[str] = set()
            for stmt in con.extract_statements(self.sql):
                names |= set(stmt.named_parameters)
            return names
        finally:
            con.close()


def available_queries() -> list[str]:
    return sorted(p.stem for p in QUERIES_DIR.glob("*.sql"))


def load_query(name: str) -> SqlQuery:
    path = QUERIES_DIR / f"{name}.sql"
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name) or not path.is_file():
        raise ArSliceError(
            f"no query {name!r} in {QUERIES_DIR}; available: {', '.join(available_queries())}"
        )
    sql = path.read_text()
    summary_lines, params, defaults = [], {}, {}
    for line in sql.splitlines():
        if not line.startswith("--"):
            break
        m = _PARAM_DOC.match(line)
        if m:
            params[m.group(1)] = m.group(2)
            d = _DEFAULT.search(m.group(2))
            if d:
                defaults[m.group(1)] = d.group(1).strip()
        elif not params:
            summary_lines.append(line.lstrip("-").strip())
    summary = " ".join(summary_lines).split(". ")[0].rstrip(".")
    return SqlQuery(name, path, sql, summary, params, defaults)


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


def resolve_params(query: SqlQuery, given: dict[str, Any], con) -> dict[str, Any]:
    """Exactly the parameters `query` binds: given ones, else documented defaults.

    `$reference` defaults to the run's reference model and must name a model of the run.
    """
    required = query.required
    unknown = sorted(set(given) - required)
    if unknown:
        raise ArSliceError(
            f"query {query.name} has no parameter {', '.join(unknown)}; "
            f"its parameters: {', '.join(sorted(required)) or 'none'}"
        )
    params: dict[str, Any] = {}
    for name in sorted(required):
        if name in given:
            params[name] = given[name]
        elif name == "reference":
            row = con.execute(
                "SELECT value FROM run_info WHERE key = 'default_reference'"
            ).fetchone()
            params[name] = row[0]
        elif name in query.defaults:
            params[name] = query.defaults[name]
        else:
            raise ArSliceError(
                f"query {query.name} needs --param {name}=VALUE ({query.params.get(name, '')})"
            )
    if "reference" in params:
        models = [r[0] for r in con.execute("SELECT model FROM models ORDER BY model").fetchall()]
        if params["reference"] not in models:
            raise ArSliceError(
                f"reference {params['reference']!r} is not a model of this run; models: {', '.join(models)}"
            )
    return params


def execute(con, query: SqlQuery, params: dict[str, Any]) -> tuple[list[str], list[tuple]]:
    """Run `query` with bound `params`; (column names, rows)."""
    import duckdb

    try:
        cur = con.execute(query.sql, params)
    except duckdb.Error as e:
        raise ArSliceError(f"query {query.path}: {e}") from None
    columns = [d[0] for d in cur.description]
    return columns, cur.fetchall()


def run_named_query(
    con, name: str, given: dict[str, Any] | None = None
) -> tuple[list[str], list[tuple]]:
    query = load_query(name)
    return execute(con, query, resolve_params(query, dict(given or {}), con))


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
    from ar_slicing.results import open_results

    if cfg.format not in FORMATTERS:
        raise ArSliceError(f"--format {cfg.format!r}: choose one of {', '.join(FORMATS)}")
    query = load_query(cfg.name)
    con = open_results(cfg.run)
    try:
        params = resolve_params(query, parse_params(cfg.param), con)
        columns, rows = execute(con, query, params)
    finally:
        con.close()
    text = FORMATTERS[cfg.format](columns, rows)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return {"query": cfg.name, "params": params, "columns": columns, "rows": len(rows)}


COMMAND = Command(
    QueryConfig,
    run_query,
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
