"""`arslice report` as a stage: results.duckdb, the tables and figures, report/ and its meta.json."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time

from ar_slicing.errors import ArSliceError
from ar_slicing.io import (
    atomic_path,
    build_meta,
    is_complete,
    read_json,
    write_bytes_atomic,
    write_meta,
)
from pipeline.config import Command, config_to_dict
from pipeline.report.config import QUERY_TABLES, REPORT_DIR, ReportConfig
from pipeline.report.figures import frequency_curve_png, slice_bars_png
from pipeline.report.passages import choose_windows, load_passages
from pipeline.report.render import render_html, render_markdown
from pipeline.report.tables import table1, write_csv

log = logging.getLogger(__name__)


def report_signature(inputs_signature: str, cfg: ReportConfig, reference: str) -> str:
    conf = {k: v for k, v in config_to_dict(cfg).items() if k not in ("run", "overwrite")}
    blob = json.dumps([inputs_signature, conf, reference], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_report(cfg: ReportConfig) -> dict:
    """Write results.duckdb and report/ for the run `cfg.run`; print Table 1 and the HTML path."""
    import duckdb

    from ar_slicing.metrics import slice_report, window_sums
    from ar_slicing.results import ensure_results, inputs_signature, run_info
    from pipeline.query import format_table, load_query, run_named_query

    t0 = time.time()
    if cfg.bootstrap < 0:
        raise ArSliceError(f"--bootstrap {cfg.bootstrap}: must be 0 (no intervals) or more")
    layout, _ = ensure_results(cfg.run, rebuild=cfg.overwrite)
    out = layout.run_dir / REPORT_DIR
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
        signature = report_signature(inputs_signature(layout), cfg, reference)
        if is_complete(out) and not cfg.overwrite:
            old = read_json(out / "meta.json")
            if old.get("signature") == signature:
                print(
                    f"report: {out} is complete and up to date; --overwrite to redo\n{out / 'report.html'}"
                )
                return old
            log.info("%s was made from other inputs or settings; rewriting it", out)
        (out / "meta.json").unlink(missing_ok=True)  # incomplete from here until written again
        out.mkdir(parents=True, exist_ok=True)

        tables: dict[str, tuple[list[str], list[tuple]]] = {}
        for name in QUERY_TABLES:
            params = {"reference": reference, "limit": "10"}
            needed = load_query(name).required
            tables[name] = run_named_query(
                con, name, {k: v for k, v in params.items() if k in needed}
            )
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
    finally:
        con.close()

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
        signature=signature,
        reference=reference,
        scored_windows=layout.scored_windows,
    )
    write_meta(out, meta)
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
