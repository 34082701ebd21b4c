"""`arslice report` as a stage: results.duckdb, the tables and figures, report/ and its meta.json."""

from __future__ import annotations

import logging
import math
import time

from ar_slicing.errors import ArSliceError
from ar_slicing.io import (
    atomic_path,
    build_meta,
    write_bytes_atomic,
)
from pipeline.config import Command, config_to_dict
from pipeline.report.config import QUERY_TABLES, ReportConfig
from pipeline.report.figures import frequency_curve_png, slice_bars_png
from pipeline.report.passages import choose_windows, load_passages
from pipeline.report.render import render_html, render_markdown
from pipeline.report.tables import table1, write_csv

log = logging.getLogger(__name__)


def validate_report(cfg: ReportConfig) -> None:
    if cfg.bootstrap < 0:
        raise ArSliceError(f"--bootstrap {cfg.bootstrap}: must be 0 (no intervals) or more")
    if cfg.passages < 0:
        raise ArSliceError(f"--passages {cfg.passages}: must be 0 (none) or more")


def report_settings(cfg: ReportConfig, reference: str | None = None) -> dict:
    """What decides the report besides its inputs; `reference` is the resolved one (None: the
    default, which depends on the models evaluated)."""
    return {
        "reference": reference or cfg.reference,
        "bootstrap": cfg.bootstrap,
        "seed": cfg.seed,
        "passages": cfg.passages,
    }


def run_report(cfg: ReportConfig) -> dict:
    """Write results.duckdb and report/ for the run `cfg.run`; print Table 1 and the HTML path."""
    import duckdb

    from ar_slicing.plan import StagePlan, identity, open_stage
    from ar_slicing.results import ensure_results, run_info

    t0 = time.time()
    validate_report(cfg)
    # (rebuilt whenever its inputs change, so --overwrite has nothing more to redo there)
    layout, _ = ensure_results(cfg.run)
    out = layout.layout.report
    con = duckdb.connect(str(layout.results_path), read_only=True)
    try:
        info = run_info(con)
        cur = con.execute("SELECT * FROM models ORDER BY model")
        columns = [d[0] for d in cur.description]
        models_meta = {r[0]: dict(zip(columns, r)) for r in cur.fetchall()}
        models = list(models_meta)
        reference = cfg.reference or info["default_reference"]
        if reference not in models_meta:
            raise ArSliceError(
                f"--reference {reference!r} is not a model of {layout.run_dir}; models: {', '.join(models)}"
            )
        plan = StagePlan(
            "report",
            settings=report_settings(cfg, reference),
            inputs={
                "tags": identity(layout.tags_dir),
                "losses": {name: identity(d) for name, d in layout.models.items()},
                "scored_windows": layout.scored_windows,
            },
        )
        # a report keeps no work of its own: new or redone inputs rebuild it
        stage = open_stage(out, plan, overwrite=cfg.overwrite, follow_inputs=True)
        if stage.complete:
            print(f"report: {out} is complete and up to date; --overwrite to redo")
            print(out / "report.html")
            return stage.skip()
        with stage.running():
            return _write_report(stage, cfg, con, layout, info, models_meta, reference, t0)
    finally:
        con.close()


def _write_report(stage, cfg, con, layout, info, models_meta, reference, t0) -> dict:
    from ar_slicing.metrics import slice_report, window_sums
    from pipeline.query import format_table, load_query, run_named_query

    out = stage.out
    models = list(models_meta)
    tables: dict[str, tuple[list[str], list[tuple]]] = {}
    for name in QUERY_TABLES:
        params = {"reference": reference, "limit": "10"}
        needed = load_query(name).required
        tables[name] = run_named_query(con, name, {k: v for k, v in params.items() if k in needed})
        write_csv(out / f"{name}.csv", *tables[name])

    sums = window_sums(con, models)
    report = slice_report(sums, reference, n_bootstrap=cfg.bootstrap, seed=cfg.seed)
    t1 = table1(report, models_meta)
    write_csv(out / "table1.csv", t1.csv_columns, t1.csv_rows)
    order = [reference] + [m for m in models if m != reference]

    freq_png = frequency_curve_png(*tables["frequency_curve"], reference)
    bars_png = slice_bars_png(report, order)
    write_bytes_atomic(out / "frequency_curve.png", freq_png)
    write_bytes_atomic(out / "slice_bars.png", bars_png)

    passages = load_passages(con, layout, choose_windows(con, reference, cfg.passages), order)

    shown = sorted(x for p in passages for v in p.nll.values() for x in v if not math.isnan(x))
    vmax = max(1.0, math.ceil(shown[int(0.98 * (len(shown) - 1))])) if shown else 10.0
    context = {
        "run": str(layout.run_dir),
        "reference": reference,
        "n_tokens": report.n_tokens,
        "n_ar_hits": report.n_ar_hits,
        "n_windows": report.n_windows,
        "n_bootstrap": report.n_bootstrap,
        "seed": cfg.seed,
        "info": info,
    }
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(render_markdown(context, t1, tables))
    with atomic_path(out / "report.html") as tmp:
        tmp.write_text(render_html(context, t1, tables, freq_png, bars_png, passages, order, vmax))

    wall = time.time() - t0
    meta = build_meta(
        "report",
        config=config_to_dict(cfg),
        inputs={"run": str(layout.run_dir), "results": str(layout.results_path), "models": models},
        counts={
            "models": len(models),
            "tokens": report.n_tokens,
            "ar_hits": report.n_ar_hits,
            "windows": report.n_windows,
            "passages": len(passages),
        },
        skipped={f"losses/{k}": 1 for k in layout.skipped_losses},
        wall_time_s=wall,
        throughput={"tokens_per_s": report.n_tokens * len(models) / max(wall, 1e-9)},
        reference=reference,
        scored_windows=layout.scored_windows,
    )
    meta = stage.finish(meta)
    # the short summary: perplexities with intervals, and the AR share (report.md has every column)
    keep = [0, 2, 3, 4, 5, 7, 9]
    print(format_table([t1.header[i] for i in keep], [tuple(r[i] for i in keep) for r in t1.rows]))
    print(
        f"\n{report.n_tokens:,} tokens in {report.n_windows:,} windows, "
        f"{100 * report.n_ar_hits / max(report.n_tokens, 1):.2f}% AR hits; reference {reference}"
        + (
            f"; {cfg.bootstrap} bootstrap resamples of windows (seed {cfg.seed})"
            if cfg.bootstrap
            else ""
        )
    )
    print(out / "report.html")
    return meta


COMMAND = Command(
    ReportConfig,
    run_report,
    validate=validate_report,
    plan_settings=report_settings,
    summary="results.duckdb, Table 1, Figure 1 and the HTML report",
    description=(
        "Build RUN/results.duckdb and RUN/report/ (report.md, report.html, frequency_curve.png, "
        "slice_bars.png, CSVs) from the run's tags and every complete losses/<model>/."
    ),
    examples="""\
  arslice report --run runs/pile
  arslice report --run runs/pile --reference pythia-160m --bootstrap 2000 --seed 1
  arslice report --run runs/demo --bootstrap 0 --overwrite""",
)
