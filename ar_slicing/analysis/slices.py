"""The slices of the scored tokens, each declared once (its name, its label and the SQL predicate
over the tags' columns that picks its tokens), and the training-count buckets as DuckDB macros.

Everything that reports slices follows from `SLICES`: the per-window sums the bootstrap resamples
(`ar_slicing.analysis.metrics.window_sums`), Table 1's statistics and columns (`ar_slicing.analysis.table1`, the
report's table, its slice bars), `Run.slices()`, and the SQL objects of results.duckdb
(`create_definitions`): the views `slice_perplexity` and `slice_perplexity_by_subset` and the
table macro `gap_vs_reference(reference)` that the queries slice_perplexity, by_subset and
gap_vs_reference read, the long view `slice_token_losses` (a row per model, token and slice
holding it) and the table `slices`. A new slice is one `Slice(...)` in `SLICES` and its line in
the naive reference of tests/ar_slicing/test_slices.py.

The training-count bucket of the frequency curve and the recall gain (0 for a bigram never seen
in training, then one bucket per decade: 1-9, 10-99, ...) is the macro `count_bucket`, with its
edges and label `count_bucket_lo`, `count_bucket_hi`, `count_bucket_label`; every query that
buckets and `ar_slicing.analysis.metrics` call them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from ar_slicing.analysis.seeds import MACROS_SQL as SEED_MACROS


@dataclass(frozen=True)
class Slice:
    """One slice: the scored tokens for which `where` holds."""

    name: str  # the suffix of its statistics and columns: ppl_<name>, delta_<name>, mean_nll_<name>
    label: str  # what the report calls it (the slice bars, `Run.slices()`)
    where: str  # SQL predicate over the tags' columns and the macros of `create_definitions`
    header: str = ""  # its name in Table 1's perplexity column, "ppl <header>" (default: label)
    short: str = ""  # in Table 1's narrower Δ column, "Δ log-ppl <short>" (default: header)
    # Table 1 (report.md, table1.csv, `Run.table1`), the slice bars and the slice_perplexity,
    # by_subset and gap_vs_reference queries show the slices that have it; every slice is in
    # `Run.slices()` and in the `slice_token_losses` view.
    in_table1: bool = True

    def __post_init__(self):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):  # (it names SQL columns)
            raise ValueError(f"slice name {self.name!r}: lower-case letters, digits and _ only")
        object.__setattr__(self, "header", self.header or self.label)
        object.__setattr__(self, "short", self.short or self.header)


SLICES = (
    Slice("all", "all tokens", "true", header="all"),
    Slice("ar", "AR hits", "is_ar_hit", short="AR"),
    Slice("other", "other tokens", "NOT is_ar_hit", header="other"),
    # docs/copy-length.md: a repeat copying 2 or more bigrams whose copied span is rare in training
    Slice(
        "ar2",
        "AR hits of order ≥ 2",
        "match_len >= 2 AND span_train_count <= ar_threshold()",
        in_table1=False,  # (Table 1 stays the paper's)
    ),
)
SLICE = {s.name: s for s in SLICES}
SLICE_NAMES = tuple(SLICE)
TABLE1_SLICES = tuple(s for s in SLICES if s.in_table1)
# (the AR share of the gap and the share of AR hits compare these two)
ALL, AR = SLICE["all"], SLICE["ar"]


# ---- SQL over the slices -------------------------------------------------------------------------


def slice_counts_sql(slices=SLICES) -> str:
    """Select-list items `n_<name>`: the tokens of each slice in the group."""
    return ", ".join(f"count(*) FILTER (WHERE {s.where}) AS n_{s.name}" for s in slices)


def slice_sums_sql(slices=SLICES) -> str:
    """Select-list items `s_<name>`: Σ nll over each slice's tokens in the group (0 if none)."""
    return ", ".join(
        f"coalesce(fsum(nll::DOUBLE) FILTER (WHERE {s.where}), 0) AS s_{s.name}" for s in slices
    )


def _perplexity_columns(slices) -> list[str]:
    """The columns of the slice_perplexity views after their keys (queries/slice_perplexity.sql)."""
    columns = [
        "count(*) AS n_tokens",
        f"count(*) FILTER (WHERE {AR.where}) AS n_ar_hits",
        f"100.0 * count(*) FILTER (WHERE {AR.where}) / count(*) AS pct_ar_hits",
    ]
    for s in slices:
        mean = (
            f"fsum(nll::DOUBLE) FILTER (WHERE {s.where})"
            f" / nullif(count(*) FILTER (WHERE {s.where}), 0)"
        )
        columns += [f"{mean} AS mean_nll_{s.name}", f"exp({mean}) AS ppl_{s.name}"]
    return columns


def _gap_macro(slices) -> str:
    """The table macro `gap_vs_reference(reference)` (queries/gap_vs_reference.sql): per model,
    the gap of each of `slices` to the reference model and the AR share of the gap."""
    summed = [*dict.fromkeys((ALL, AR, *slices))]
    means = ", ".join(f"s_{s.name} / nullif(n_{s.name}, 0) AS mean_{s.name}" for s in summed)
    gaps = [f"m.mean_{s.name} - r.mean_{s.name} AS delta_log_ppl_{s.name}" for s in slices]
    gaps += [f"exp(m.mean_{s.name}) - exp(r.mean_{s.name}) AS delta_ppl_{s.name}" for s in slices]
    return (
        "CREATE MACRO gap_vs_reference(reference) AS TABLE WITH per_model AS (SELECT model, "
        f"{slice_counts_sql(summed)}, {slice_sums_sql(summed)} FROM token_losses GROUP BY model), "
        f"means AS (SELECT *, {means} FROM per_model), "
        "ref AS (SELECT * FROM means WHERE model = reference) "
        f"SELECT m.model, r.model AS reference, m.n_{ALL.name} AS n_tokens, {', '.join(gaps)}, "
        f"(m.s_{AR.name} - r.s_{AR.name}) / nullif(m.s_{ALL.name} - r.s_{ALL.name}, 0) "
        "AS ar_share_of_gap FROM means AS m CROSS JOIN ref AS r"
    )


# The training-count buckets (module docstring). The label's edges are the lo/hi macros' own.
COUNT_BUCKET_MACROS = (
    "CREATE MACRO count_bucket(n) AS CASE WHEN n <= 0 THEN 0 ELSE length(n::VARCHAR) END",
    "CREATE MACRO count_bucket_lo(b) AS CASE WHEN b = 0 THEN 0 ELSE pow(10, b - 1)::BIGINT END",
    "CREATE MACRO count_bucket_hi(b) AS CASE WHEN b = 0 THEN 0 ELSE pow(10, b)::BIGINT - 1 END",
    "CREATE MACRO count_bucket_label(b) AS CASE WHEN b = 0 THEN '0' "
    "ELSE count_bucket_lo(b)::VARCHAR || '-' || count_bucket_hi(b)::VARCHAR END",
)


def definitions_sql(threshold: int | None) -> list[str]:
    """The statements that define the buckets, `recipe_of(model)` and `seed_of(model)` (runs of
    one recipe, `ar_slicing.analysis.seeds`), `ar_threshold()` (the run's AR threshold, for
    slice predicates) and the views, table macro and table of the slices, over a database that
    has `token_losses` and `models` (results.duckdb's)."""
    keys = "model, coalesce(subset, '(none)')"
    every_slice = "\nUNION ALL\n".join(
        f"SELECT '{s.name}' AS slice, * FROM token_losses WHERE {s.where}" for s in SLICES
    )
    limit = "NULL" if threshold is None else str(int(threshold))  # (an int: safe in DDL)
    return [
        *COUNT_BUCKET_MACROS,
        *SEED_MACROS,
        f"CREATE MACRO ar_threshold() AS {limit}::BIGINT",
        "CREATE VIEW slice_perplexity AS SELECT tl.model, any_value(m.architecture) AS "
        "architecture, any_value(m.n_params) AS n_params, "
        + ", ".join(_perplexity_columns(TABLE1_SLICES))
        + " FROM token_losses AS tl LEFT JOIN models AS m ON m.model = tl.model GROUP BY tl.model",
        f"CREATE VIEW slice_perplexity_by_subset AS SELECT {keys} AS subset, "
        + ", ".join(_perplexity_columns(TABLE1_SLICES))
        + f" FROM token_losses GROUP BY {keys}",
        _gap_macro(TABLE1_SLICES),
        f"CREATE VIEW slice_token_losses AS {every_slice}",
        "CREATE TABLE slices (position INTEGER, slice VARCHAR, label VARCHAR, predicate VARCHAR, "
        "in_table1 BOOLEAN)",
    ]


def slice_rows() -> list[tuple]:
    """The rows of the `slices` table: position, name, label, predicate, in_table1."""
    return [(k, s.name, s.label, s.where, s.in_table1) for k, s in enumerate(SLICES)]


def create_definitions(con, threshold: int | None) -> None:
    """Run `definitions_sql` in `con` and fill the `slices` table."""
    for statement in definitions_sql(threshold):
        con.execute(statement)
    con.executemany("INSERT INTO slices VALUES (?, ?, ?, ?, ?)", slice_rows())


def definitions_digest() -> str:
    """What results.duckdb's plan records of these definitions, so that a file made with other
    ones is rebuilt (the threshold is the tags', an input of the plan already)."""
    text = "\n".join([*definitions_sql(None), *map(repr, slice_rows())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
