"""The Python API over one run, for a notebook: `open_run(RUN)` and the tables of a `Run` as
polars frames, the same numbers `arslice report` and `arslice query` print.

    >>> from ar_slicing import open_run                     # doctest: +SKIP
    >>> run = open_run("runs/demo")
    >>> run.models, run.window, run.threshold
    >>> run.table1()                                        # Table 1, intervals included
    >>> run.slices()                                        # every declared slice, long
    >>> run.copy_length()                                   # ppl per copy length x span count
    >>> run.emergence()                                     # recall gain along training
    >>> run.query("gap_vs_reference", reference="rwkv")     # any queries/*.sql
    >>> run.sql("SELECT model, avg(nll) FROM token_losses WHERE is_ar_hit GROUP BY model")
    >>> run.token_losses().filter(pl.col("is_repeat")).collect()   # lazy, straight from Parquet

Nothing is printed; a problem with the run raises `ar_slicing.errors.ArSliceError` with the
message the CLI would print. `open_run` brings the run's `results.duckdb` up to date once (as `arslice query`
does) and the `Run` reads that state: open the run again after evaluating another model.
"""

from __future__ import annotations

import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from ar_slicing.algorithms.tags import TAG_COLUMNS
from ar_slicing.analysis.results import CheckedRun
from ar_slicing.errors import ArSliceError

# token_losses' columns, in the order of the results.duckdb view of that name
TOKEN_LOSS_COLUMNS = ("model", *TAG_COLUMNS, "nll")


def open_run(run_dir: str | os.PathLike, read_only_files: bool = False) -> Run:
    """The run in `run_dir` (its tags and every complete `losses/<model>/`).

    `Run.sql` runs any SQL DuckDB accepts, with the rights of the calling user: by default it
    can read any file on the machine (`read_csv_auto('/etc/passwd')`) and write one (`COPY ...
    TO`), as DuckDB itself can. That is what a notebook on one's own runs wants; a service that
    passes other people's SQL to a run opens it with `read_only_files=True`: then DuckDB may open
    only the run's own Parquet files that the views read (`allowed_paths`, external access off,
    the configuration locked against `SET`), and `sql()` runs only SELECT (and EXPLAIN)
    statements, so no file is written.
    """
    from ar_slicing.analysis.results import ensure_results
    from ar_slicing.machinery.ownership import results_lock

    with results_lock(run_dir, wait=True):  # a rebuild by `report` or `query`: wait for it
        checked, _ = ensure_results(run_dir)
    return Run(checked, read_only_files=read_only_files)


class Run:
    """One run's results: `table1()`, `slices()`, `query(name)`, `sql(text)`, `token_losses()`."""

    def __init__(self, checked: CheckedRun, read_only_files: bool = False):
        self.checked = checked
        self.layout = checked.layout
        self.read_only_files = read_only_files

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, models={list(self.models)})"

    @property
    def path(self) -> Path:
        return self.layout.run_dir

    def _connect(self):
        import duckdb

        con = duckdb.connect(str(self.layout.results), read_only=True)
        if self.read_only_files:
            # (in this order: once external access is off, only these files can be opened, and
            # once the configuration is locked no statement can change that)
            con.execute("SET allowed_paths = $paths", {"paths": self._view_files()})
            con.execute("SET enable_external_access = false")
            con.execute("SET autoload_known_extensions = false")
            con.execute("SET lock_configuration = true")
        return con

    def _view_files(self) -> list[str]:
        """Every file the views of results.duckdb read, as the views name them."""
        from ar_slicing.analysis.results import probe_files
        from ar_slicing.machinery.layout import BIGRAMS_NAME

        layout, checked = self.layout, self.checked
        files = [layout.windows, *layout.tag_parts()]
        for name in [*checked.models, *checked.checkpoints]:
            files += layout.loss_parts(name)
        for name in checked.probes:
            files += probe_files(layout, name)
        if checked.counts_dir is not None:
            files.append(checked.counts_dir / BIGRAMS_NAME)
        return [str(f) for f in files]

    @cached_property
    def _info(self) -> dict[str, str | None]:
        from ar_slicing.analysis.results import run_info

        con = self._connect()
        try:
            return run_info(con)
        finally:
            con.close()

    @property
    def models(self) -> tuple[str, ...]:
        """The evaluated models (losses folder names), in name order."""
        return tuple(sorted(self.checked.models))

    @property
    def checkpoints(self) -> tuple[str, ...]:
        """The evaluated checkpoints along the models' training (losses folder names,
        `<model>@step<n>`), in name order: not models of Table 1, points of `emergence()`."""
        return tuple(sorted(self.checked.checkpoints))

    @property
    def reference(self) -> str:
        """The default reference: the model whose architecture or name says attention."""
        return self._info["default_reference"]

    @property
    def window(self) -> int:
        return int(self._info["window"])

    @property
    def threshold(self) -> int:
        return int(self._info["threshold"])

    def sql(self, text: str, **params: Any):
        """A polars DataFrame of the SQL `text` over results.duckdb (views `tags`, `losses`,
        `token_losses`, `windows`, `counts`, tables `models`, `run_info`, and the slices' views
        and the bucket macros of `ar_slicing.analysis.slices`); `$name` in the
        text is bound to `params[name]`, never formatted in. It can read and write any file the
        user can unless the run was opened with `open_run(..., read_only_files=True)`."""
        from ar_slicing.analysis.sql import frame, require_select

        con = self._connect()
        try:
            if self.read_only_files:
                require_select(con, text)
            return frame(con, text, params)
        finally:
            con.close()

    def query(self, name: str, **params: Any):
        """A polars DataFrame of `queries/<name>.sql`, its parameters' documented defaults (and
        the run's reference) filled in, as `arslice query NAME --param k=v` does."""
        from ar_slicing.analysis.sql import bind_named, frame

        con = self._connect()
        try:
            query, bound = bind_named(con, name, params)
            return frame(con, query.sql, bound, where=f"query {query.path}")
        finally:
            con.close()

    def table1(self, reference: str | None = None, bootstrap: int = 1000, seed: int = 0):
        """Table 1 as a polars DataFrame, one row per model (the reference first): `ppl_all`,
        `ppl_ar`, `ppl_other`, `delta_*`, `ar_share`, `recall_gain`, each with `_lo`/`_hi`
        95% bootstrap bounds. The numbers of `arslice report`'s table1.csv for the same
        `--reference`, `--bootstrap` and `--seed` (these defaults are the report's)."""
        import polars as pl

        from ar_slicing.analysis.table1 import compute_table1

        con = self._connect()
        try:
            t1 = compute_table1(con, reference, n_bootstrap=bootstrap, seed=seed)
        finally:
            con.close()
        # (a statistic without a value, such as the reference's own AR share, is null)
        rows = [[_none_if_nan(r[c]) for c in t1.columns] for r in t1.records()]
        return pl.DataFrame(rows, schema=_table1_schema(t1.columns), orient="row")

    def slices(self, reference: str | None = None, bootstrap: int = 1000, seed: int = 0):
        """Every declared slice of every model (`ar_slicing.analysis.slices`: Table 1's and those it
        leaves out) as a polars DataFrame, one row per model and slice (the reference first, the
        slices in declaration order): `slice`, `label`, `in_table1`, `n_tokens`, `mean_nll`,
        `ppl` and `delta` (mean NLL minus the reference's), each with `_lo`/`_hi` 95% bootstrap
        bounds. The numbers of `table1()` for its slices, from the same resampled windows."""
        import polars as pl

        from ar_slicing.analysis.table1 import (
            SLICE_FIELDS,
            SLICE_STATISTICS,
            compute_slices,
            slice_records,
        )

        con = self._connect()
        try:
            _, report = compute_slices(con, reference, n_bootstrap=bootstrap, seed=seed)
        finally:
            con.close()
        ends = ("", "_lo", "_hi") if bootstrap else ("",)
        schema = {
            **dict(zip(SLICE_FIELDS, (pl.String, pl.String, pl.String, pl.Boolean, pl.Int64))),
            **{f"{k}{end}": pl.Float64 for k in SLICE_STATISTICS for end in ends},
        }
        rows = [[_none_if_nan(r[c]) for c in schema] for r in slice_records(report)]
        return pl.DataFrame(rows, schema=schema, orient="row")

    def copy_length(self, bootstrap: int = 1000, seed: int = 0, spans: str = "split"):
        """Perplexity per copy-length bucket (match_len 1, 2-3, 4-7, 8-15, 16+; 'none' = the
        non-repeats) x span-count bucket (0, 1..threshold, above), per model, as a polars
        DataFrame with 95% bootstrap bounds (`ppl_lo`, `ppl_hi`; windows resampled as for
        `table1`). `spans="all"` merges the span buckets, `"novel_seen"` splits them into count 0
        and the rest (docs/copy-length.md)."""
        import polars as pl

        from ar_slicing.analysis.copy_length import copy_length_rows

        if spans not in ("split", "all", "novel_seen"):
            raise ArSliceError(f"spans={spans!r}: expected 'split', 'all' or 'novel_seen'")
        con = self._connect()
        try:
            rows = copy_length_rows(con, n_bootstrap=bootstrap, seed=seed, spans=spans)
        finally:
            con.close()
        return pl.DataFrame(rows, infer_schema_length=None)

    def emergence(self, bootstrap: int = 1000, seed: int = 0):
        """The recall emergence as a polars DataFrame: one row per point of each model's
        training curve (its checkpoints and, when it records its step, the model itself;
        `final`), by model and step, with `tokens_seen`, the windows and tokens compared
        (`n_windows`, `n_tokens`, `n_ar_hits`: those every point of the model scored), and
        `recall_gain`, `recall_gain_count0` (bigrams never seen in training), `ppl_ar` and
        `ppl_other`, each with `_lo`/`_hi` 95% bootstrap bounds (windows resampled as for
        `table1`, the same resamples for every point of a model). Empty for a run without
        checkpoints (docs/design.md, "Recall emergence")."""
        import polars as pl

        from ar_slicing.analysis.emergence import STATISTICS, emergence_rows

        con = self._connect()
        try:
            rows = emergence_rows(con, n_bootstrap=bootstrap, seed=seed)
        finally:
            con.close()
        schema = {
            "model": pl.String,
            "checkpoint": pl.String,
            "step": pl.Int64,
            "tokens_seen": pl.Int64,
            "final": pl.Boolean,
            "n_windows": pl.Int64,
            "n_tokens": pl.Int64,
            "n_ar_hits": pl.Int64,
            **{f"{k}{end}": pl.Float64 for k in STATISTICS for end in ("", "_lo", "_hi")},
        }
        values = [[_none_if_nan(r[c]) for c in schema] for r in rows]
        return pl.DataFrame(values, schema=schema, orient="row")

    @property
    def probed(self) -> tuple[str, ...]:
        """The probed models and checkpoints (probes folder names), in name order."""
        return tuple(sorted(self.checked.probes))

    def probes(self, table: str = "scores", **params: Any):
        """The probes of the run's models and checkpoints (docs/design.md, "Probes of a
        checkpoint") as a polars DataFrame: `scores` (the default), one row per probed model or
        checkpoint, by model and step, as `queries/probe_scores.sql` gives it (the induction
        score with its interval, recall accuracy over k, the in-context learning scores);
        `recall` (per k, with the baselines; `model=` one of them) and `position` (the loss by
        window position; `slice=` all, ar or other) as their queries give them; or any view of
        the probes by its name (`induction`, `induction_curve`, `recall_by_distance`, `icl`,
        ...: `probe_<table>`). Empty for a run without `arslice probe`."""
        from ar_slicing.analysis.results import PROBE_VIEWS
        from ar_slicing.errors import BadInput

        if table in ("scores", "recall", "position"):
            return self.query(f"probe_{table}", **params)
        view = f"probe_{table}"
        if view not in PROBE_VIEWS:
            names = ["scores", "recall", "position", *(v[len("probe_") :] for v in PROBE_VIEWS)]
            raise BadInput(f"probes({table!r}): no such table; one of {', '.join(names)}")
        if params:
            raise BadInput(f"probes({table!r}) takes no parameters, not {', '.join(params)}")
        return self.sql(f"SELECT * FROM {view} ORDER BY ALL")

    def checkpoint_token_losses(self):
        """A polars LazyFrame like `token_losses()` for the points of the models' training
        curves (`emergence()`): every scored token of the windows all points of a model scored,
        with each point's loss and where it stands (`model`, `checkpoint`, `step`,
        `tokens_seen`, `final`, the tag columns, `nll`), scanned from the Parquet as the
        results.duckdb view `checkpoint_token_losses` reads it."""
        import polars as pl

        points = self.sql("SELECT model, checkpoint, step, tokens_seen, final FROM checkpoints")
        shared = self.sql("SELECT model, window_id FROM checkpoint_windows").lazy()
        tags = pl.scan_parquet([str(p) for p in self.layout.tag_parts()])
        along = ["model", "checkpoint", "step", "tokens_seen", "final"]
        losses = [
            pl.scan_parquet([str(p) for p in self.layout.loss_parts(point["checkpoint"])]).select(
                *(pl.lit(point[c]).alias(c) for c in along), "window_id", "pos", "nll"
            )
            for point in points.iter_rows(named=True)
        ]
        columns = [*along, *TAG_COLUMNS, "nll"]
        if not losses:
            return tags.join(
                pl.LazyFrame(schema={**points.schema, "window_id": pl.Int32, "pos": pl.Int32,
                                     "nll": pl.Float32}),
                on=["window_id", "pos"],
            ).select(columns)  # fmt: skip
        scored = pl.concat(losses).join(shared, on=["model", "window_id"], how="semi")
        return tags.join(scored, on=["window_id", "pos"], how="inner").select(columns)

    def token_losses(self):
        """A polars LazyFrame of every scored token joined with every model's loss (the
        `token_losses` view), scanned from the run's Parquet: nothing is read until `.collect()`,
        and a filter or a column choice reads only what it needs."""
        import polars as pl

        tags = pl.scan_parquet([str(p) for p in self.layout.tag_parts()])
        losses = pl.concat(
            [
                pl.scan_parquet([str(p) for p in self.layout.loss_parts(name)]).select(
                    pl.lit(name).alias("model"), "window_id", "pos", "nll"
                )
                for name in sorted(self.checked.models)
            ]
        )
        scored = self.checked.scored_windows
        if scored is not None:
            # the windows every model scored, as results.duckdb's views have them
            tags = tags.filter(pl.col("window_id") < scored)
            losses = losses.filter(pl.col("window_id") < scored)
        return tags.join(losses, on=["window_id", "pos"], how="inner").select(TOKEN_LOSS_COLUMNS)


def _none_if_nan(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def _table1_schema(columns: list[str]) -> dict:
    import polars as pl

    types = {"model": pl.String, "architecture": pl.String, "n_params": pl.Int64}
    return {c: types.get(c, pl.Float64) for c in columns}
