"""The SQL questions of `queries/`: loading a `queries/<name>.sql` and running it against a run's
`results.duckdb` with its `$parameters` bound, never formatted into the SQL.

A query's leading `--` comment says what it answers; a comment line `-- $name  help (default: X)`
documents a parameter and its default. `$reference` defaults to the run's reference model (the
attention model when there is one), as in `arslice report`. `arslice query` (`pipeline.query`),
the report and `ar_slicing.analysis.api.Run.query` all run queries through here.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

# queries/ is a package of its own (its .sql files are package data), editable install or wheel.
QUERIES_DIR = Path(importlib.import_module("queries").__file__).resolve().parent
_PARAM_DOC = re.compile(r"^--\s*\$(\w+)\s+(.*?)\s*$")
_DEFAULT = re.compile(r"\(default:\s*([^)]*)\)")


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
                f"query {query.name} needs the parameter {name}=VALUE ({query.params.get(name, '')})"
            )
    if "reference" in params:
        models = [r[0] for r in con.execute("SELECT model FROM models ORDER BY model").fetchall()]
        if params["reference"] not in models:
            raise ArSliceError(
                f"reference {params['reference']!r} is not a model of this run; models: {', '.join(models)}"
            )
    return params


def execute(con, sql: str, params: dict[str, Any] | None = None, where: str = "SQL"):
    """Run `sql` with bound `params` (never formatted in); the DuckDB cursor. A DuckDB error
    becomes one line naming `where` (a query file, or "SQL" for text a user typed)."""
    import duckdb

    try:
        return con.execute(sql, params or None)
    except duckdb.Error as e:
        raise ArSliceError(f"{where}: {e}") from None


def require_select(con, sql: str) -> None:
    """Refuse `sql` unless every statement in it only reads (SELECT, EXPLAIN): what a run opened
    with `read_only_files=True` runs, as `COPY ... TO` could overwrite the run's own files."""
    import duckdb

    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise ArSliceError(f"SQL: {e}") from None
    reading = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)
    for stmt in statements:
        if stmt.type not in reading:
            raise ArSliceError(
                f"SQL: a {stmt.type.name} statement is refused; this run was opened with "
                "read_only_files=True, which runs SELECT statements only"
            )


def frame(con, sql: str, params: dict[str, Any] | None = None, where: str = "SQL"):
    """`execute`, the result as a polars DataFrame (DuckDB's column types, through Arrow)."""
    import duckdb

    try:
        return con.sql(sql, params=params or None).pl()
    except duckdb.Error as e:
        raise ArSliceError(f"{where}: {e}") from None


def bind_named(con, query: str | SqlQuery, given: dict[str, Any] | None = None):
    """(the query, its parameters): a query of queries/ by name (or loaded) with `given`
    parameters, the documented defaults filled in."""
    query = load_query(query) if isinstance(query, str) else query
    return query, resolve_params(query, dict(given or {}), con)


def run_named_query(
    con, query: str | SqlQuery, given: dict[str, Any] | None = None
) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of a query of queries/ (see `bind_named`)."""
    query, params = bind_named(con, query, given)
    cur = execute(con, query.sql, params, where=f"query {query.path}")
    return [d[0] for d in cur.description], cur.fetchall()
