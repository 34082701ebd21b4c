"""`arslice report` as a stage: results.duckdb, the tables and figures, report/ and its meta.json."""

from __future__ import annotations

import logging
import math
import time

from ar_slicing.analysis.slices import AR, TABLE1_SLICES
from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import build_meta, write_bytes_atomic
from ar_slicing.machinery.layout import (
    COPY_LENGTH_FIGURE,
    EMERGENCE_FIGURE,
    FREQUENCY_CURVE_FIGURE,
    MQAR_FIGURE,
    PROBES_FIGURE,
    PROBES_TRAINING_FIGURE,
    RECALL_GAIN_FIGURE,
    REPORT_HTML_NAME,
    REPORT_MD_NAME,
    SLICE_BARS_FIGURE,
    TABLE_CSV,
    RunLayout,
)
from pipeline.config import Command, config_to_dict, say
from pipeline.mqar import mqar_results
from pipeline.report.config import QUERY_TABLES, ReportConfig
from pipeline.report.figures import (
    copy_length_png,
    emergence_png,
    frequency_curve_png,
    probes_png,
    probes_training_png,
    recall_gain_png,
    slice_bars_png,
)
from pipeline.report.passages import choose_windows, load_passages
from pipeline.report.render import render_html, render_markdown
from pipeline.report.tables import (
    copy_length_by_subset_text,
    copy_length_text,
    delta_header,
    emergence_text,
    ppl_header,
    probes_text,
    seeds_text,
    table1_text,
    write_csv,
)
from pipeline.stage import Finished
from pipeline.wiring import LOSSES, PROBES, REPORT, TAGS, Wiring

log = logging.getLogger(__name__)


def validate_report(cfg: ReportConfig) -> None:
    if cfg.bootstrap < 0:
        raise ArSliceError(f"--bootstrap {cfg.bootstrap}: must be 0 (no intervals) or more")
    if cfg.passages < 0:
        raise ArSliceError(f"--passages {cfg.passages}: must be 0 (none) or more")


# the bootstrapped tables of a report (Table 1, the recall gain, the copy-length table split and
# merged), each resampling the windows once; the emergence, when there are checkpoints, one more
BOOTSTRAPPED_TABLES = 4


def require_bootstrap_fits(cfg: ReportConfig, layout: RunLayout) -> None:
    """Refuse, before anything is written, a `--bootstrap` that would run for more than a day
    here or hold more than this machine's memory, with the estimate: the time of one chunk of
    resamples of the run's windows, measured now, scaled to every resample of every table."""
    from ar_slicing.analysis.metrics import bootstrap_cost
    from ar_slicing.machinery.io import read_json
    from ar_slicing.machinery.layout import META_NAME
    from ar_slicing.machinery.limits import require_memory, require_time

    if cfg.bootstrap == 0 or not (layout.tags / META_NAME).is_file():
        return  # (no intervals; or no tags, which the run's own check names)
    windows = int(read_json(layout.tags / META_NAME).get("counts", {}).get("windows") or 0)
    models = max(1, len(layout.loss_folders().complete))
    seconds, memory = bootstrap_cost(cfg.bootstrap, windows, 2 + 2 * models)
    what = f"--bootstrap {cfg.bootstrap}: resampling {windows:,} windows of {models} model(s)"
    fix = "lower --bootstrap (1000 resamples give 95% intervals to two digits)"
    require_time(seconds * BOOTSTRAPPED_TABLES, what, fix)
    require_memory(memory, what, fix)


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
    from ar_slicing.analysis.results import ensure_results
    from ar_slicing.machinery.ownership import refuse_not_owned, results_lock

    t0 = time.time()
    validate_report(cfg)
    # every check of report/ before the first write, results.duckdb's included
    refuse_not_owned(RunLayout(cfg.run).report, "report")
    require_bootstrap_fits(cfg, RunLayout(cfg.run))
    with results_lock(cfg.run):  # one writer of results.duckdb
        # (rebuilt whenever its inputs change, so --overwrite has nothing more to redo there)
        checked, _ = ensure_results(cfg.run)
        return _report_from(cfg, checked, t0)


def _report_from(cfg: ReportConfig, checked, t0: float) -> dict:
    import duckdb

    from ar_slicing.analysis.results import run_info
    from ar_slicing.analysis.table1 import models_table, resolve_reference
    from ar_slicing.machinery.plan import StagePlan, identity
    from pipeline.stage import run_stage

    layout = checked.layout
    out = layout.report
    con = duckdb.connect(str(layout.results), read_only=True)
    try:
        info = run_info(con)
        models_meta = models_table(con)
        reference = resolve_reference(con, cfg.reference, list(models_meta), str(layout.run_dir))
        inputs = {
            "tags": identity(layout.tags),
            "losses": {name: identity(layout.losses(name)) for name in checked.models},
            "scored_windows": checked.scored_windows,
        }
        if checked.checkpoints:  # (a run without checkpoints keeps the plan it had)
            inputs["checkpoints"] = {n: identity(layout.losses(n)) for n in checked.checkpoints}
        if checked.probes:  # (likewise, a run without probes)
            inputs["probes"] = {n: identity(layout.probes(n)) for n in checked.probes}
        mqar = mqar_results(layout.mqar)
        if mqar is not None:  # (a run without the probe keeps the plan it had)
            inputs["mqar"] = identity(layout.mqar)
        plan = StagePlan("report", settings=report_settings(cfg, reference), inputs=inputs)

        def skipped(meta: dict) -> dict:
            say(str(out / REPORT_HTML_NAME))
            return meta

        return run_stage(
            "report",
            out,
            plan,
            lambda stage, _: _write_report(stage, cfg, con, checked, info, reference, t0, mqar),
            overwrite=cfg.overwrite,
            follow_inputs=True,  # a report keeps no work of its own: new or redone inputs rebuild it
            detail="and up to date",
            skipped=skipped,
        )
    finally:
        con.close()


# Every file the report may write (the emergence only for a run with checkpoints, the MQAR
# figure only beside a complete MQAR sweep, the probes' only in a run with probes).
REPORT_FILES = (
    REPORT_MD_NAME,
    REPORT_HTML_NAME,
    FREQUENCY_CURVE_FIGURE,
    COPY_LENGTH_FIGURE,
    SLICE_BARS_FIGURE,
    RECALL_GAIN_FIGURE,
    MQAR_FIGURE,
    EMERGENCE_FIGURE,
    PROBES_FIGURE,
    PROBES_TRAINING_FIGURE,
    *(
        TABLE_CSV.format(n)
        for n in (*QUERY_TABLES, "table1", "copy_length", "emergence", "probes", "seeds")
    ),
)


def _write_report(stage, cfg, con, checked, info, reference, t0, mqar=None) -> Finished:
    from ar_slicing.analysis.sql import load_query, run_named_query
    from ar_slicing.analysis.table1 import compute_table1

    out = stage.out
    stage.expect(out / name for name in REPORT_FILES)
    tables: dict[str, tuple[list[str], list[tuple]]] = {}
    for name in QUERY_TABLES:
        query = load_query(name)
        params = {"reference": reference, "limit": "10"}
        tables[name] = run_named_query(
            con, query, {k: params[k] for k in query.required & set(params)}
        )
        write_csv(out / TABLE_CSV.format(name), *tables[name])

    t1 = compute_table1(con, reference, n_bootstrap=cfg.bootstrap, seed=cfg.seed)
    text = table1_text(t1)
    write_csv(out / TABLE_CSV.format("table1"), text.csv_columns, text.csv_rows)

    copies = _copy_length(con, cfg, out)
    figures = {
        FREQUENCY_CURVE_FIGURE: frequency_curve_png(*tables["frequency_curve"], reference),
        COPY_LENGTH_FIGURE: copy_length_png(copies.pop("curve"), reference),
        SLICE_BARS_FIGURE: slice_bars_png(t1.slices, t1.order),
        RECALL_GAIN_FIGURE: recall_gain_png(t1),
    }
    for name, png in figures.items():
        write_bytes_atomic(out / name, png)
    if mqar is not None:  # the probe's table and figure, as `arslice mqar` wrote them
        figures[MQAR_FIGURE] = mqar.figure.read_bytes()
        write_bytes_atomic(out / MQAR_FIGURE, figures[MQAR_FIGURE])
    emergence, points = _emergence(con, cfg, out, figures) if checked.checkpoints else (None, [])
    probes, probe_points = (
        _probes(con, out, figures, points, tables["recall_gain"]) if checked.probes else (None, [])
    )
    seeds = _seeds(out, points, probe_points)

    passages = load_passages(con, checked, choose_windows(con, reference, cfg.passages), t1.order)

    shown = sorted(x for p in passages for v in p.nll.values() for x in v if not math.isnan(x))
    vmax = max(1.0, math.ceil(shown[int(0.98 * (len(shown) - 1))])) if shown else 10.0
    report = t1.slices
    context = {
        "run": str(checked.layout.run_dir),
        "reference": reference,
        "n_tokens": report.n_tokens,
        "n_ar_hits": report.n_ar_hits,
        "n_windows": report.n_windows,
        "n_bootstrap": report.n_bootstrap,
        "seed": cfg.seed,
        "info": info,
        "coverage": coverage_notes(checked),
        "mqar": mqar,
        "copy_length": copies,
        "emergence": emergence,
        "probes": probes,
        "probes_training": PROBES_TRAINING_FIGURE in figures,
        "seeds": seeds,
    }
    write_bytes_atomic(out / REPORT_MD_NAME, render_markdown(context, text, tables).encode())
    page = render_html(context, text, tables, figures, passages, t1.order, vmax)
    write_bytes_atomic(out / REPORT_HTML_NAME, page.encode())

    wall = time.time() - t0
    models = list(t1.models_meta)
    meta = build_meta(
        "report",
        config=config_to_dict(cfg),
        inputs={
            "run": str(checked.layout.run_dir),
            "results": str(checked.layout.results),
            "models": models,
        },
        counts={
            "models": len(models),
            "tokens": report.n_tokens,
            "ar_hits": report.n_ar_hits,
            "windows": report.n_windows,
            "passages": len(passages),
        },
        skipped={f"losses/{k}": 1 for k in checked.skipped_losses},
        wall_time_s=wall,
        throughput={"tokens_per_s": report.n_tokens * len(models) / max(wall, 1e-9)},
        reference=reference,
        scored_windows=checked.scored_windows,
    )
    return Finished(meta, [console_summary(text, t1, context, cfg), str(out / REPORT_HTML_NAME)])


def _copy_length(con, cfg, out) -> dict:
    """The copy-length table (with intervals), its rows per subset, and the figure's curve;
    copy_length.csv holds every (model, copy bucket, span bucket) cell with its interval."""
    from ar_slicing.analysis.copy_length import CURVE_MAX_BUCKET, copy_length_rows
    from ar_slicing.analysis.sql import run_named_query

    boot = {"n_bootstrap": cfg.bootstrap, "seed": cfg.seed}
    split = copy_length_rows(con, **boot)
    merged = copy_length_rows(con, spans="all", **boot)
    columns = list(split[0]) if split else ["model"]
    rows = [tuple(r.get(c) for c in columns) for r in split]
    write_csv(out / TABLE_CSV.format("copy_length"), columns, rows)
    by_subset = run_named_query(con, "copy_length", {"by_subset": "true"})
    curve = copy_length_rows(con, n_bootstrap=0, max_bucket=CURVE_MAX_BUCKET, spans="novel_seen")
    return {
        "table": copy_length_text(split, merged),
        "by_subset": copy_length_by_subset_text(*by_subset),
        "curve": curve,
    }


def _emergence(con, cfg, out, figures: dict) -> tuple[tuple[list[str], list[list[str]]], list]:
    """The recall emergence (a run with checkpoints): emergence.csv, emergence.png (added to
    `figures`), the table's text and its rows."""
    from ar_slicing.analysis.emergence import emergence_rows

    rows = emergence_rows(con, n_bootstrap=cfg.bootstrap, seed=cfg.seed)
    columns = list(rows[0]) if rows else ["model"]
    write_csv(out / TABLE_CSV.format("emergence"), columns, [tuple(r.values()) for r in rows])
    figures[EMERGENCE_FIGURE] = emergence_png(rows)
    write_bytes_atomic(out / EMERGENCE_FIGURE, figures[EMERGENCE_FIGURE])
    return emergence_text(rows), rows


# the statistics whose spread across seeds the report gives: the recall emergence's, the probes'
SEED_EMERGENCE = ("recall_gain", "recall_gain_count0")
SEED_PROBES = ("induction_score", "recall_accuracy")


def seed_rows(emergence: list[dict], probes: list[dict]) -> list[dict]:
    """The spread rows of the emergence and of the probes (`spread_rows`) as one row per recipe
    and step, every statistic of `SEED_EMERGENCE` and `SEED_PROBES` (NaN where a side has no
    point), `runs` and `models` those of the emergence where it has the point."""
    keys = [f"{k}{end}" for k in (*SEED_EMERGENCE, *SEED_PROBES) for end in ("", "_min", "_max")]
    merged: dict[tuple, dict] = {}
    for row in (*emergence, *probes):
        at = merged.setdefault(
            (row["recipe"], row["step"]),
            {**{k: row[k] for k in ("recipe", "step", "tokens_seen", "runs", "models")},
             **dict.fromkeys(keys, math.nan)},
        )  # fmt: skip
        at.update({k: v for k, v in row.items() if k in keys})
    return [merged[key] for key in sorted(merged)]


def probe_rows(con, points: list[dict], recall_gain) -> list[dict]:
    """`queries/probe_scores.sql`'s rows with the recall gain of each model or checkpoint on the
    run's text beside them: its point of the recall emergence (with its interval), else, for a
    model without one, its gain in `recall_gain` (the query's (columns, rows): no interval)."""
    from ar_slicing.analysis.sql import run_named_query

    columns, rows = run_named_query(con, "probe_scores", {})
    by_point = {p["checkpoint"]: p for p in points}
    cols = list(recall_gain[0])
    plain = {
        r[cols.index("model")]: r[cols.index("gain")]
        for r in recall_gain[1]
        if r[cols.index("bucket_label")] == "all"
    }
    out = []
    for row in rows:
        r = dict(zip(columns, row))
        point = by_point.get(r["model"])
        if point is not None:
            r.update({k: point[k] for k in ("recall_gain", "recall_gain_lo", "recall_gain_hi")})
        else:
            r.update(recall_gain=plain.get(r["model"]), recall_gain_lo=None, recall_gain_hi=None)
        out.append(r)
    return out


def _probes(con, out, figures: dict, points: list, recall_gain) -> tuple[tuple, list[dict]]:
    """The probes (a run with `arslice probe`): probes.csv, probes.png and, with checkpoints,
    probes_training.png (added to `figures`), the table's text and its rows."""
    rows = probe_rows(con, points, recall_gain)
    columns = list(rows[0]) if rows else ["model"]
    write_csv(out / TABLE_CSV.format("probes"), columns, [tuple(r.values()) for r in rows])
    models = sorted({r["model"] for r in rows if r["model"] == r["of_model"]})

    def of_models(view: str) -> list[dict]:
        cur = con.execute(
            f"SELECT * FROM {view} WHERE list_contains($models, model) ORDER BY ALL",
            {"models": models},
        )
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    figures[PROBES_FIGURE] = probes_png(
        of_models("probe_induction_curve"),
        of_models("probe_recall_by_k"),
        of_models("probe_position"),
    )
    write_bytes_atomic(out / PROBES_FIGURE, figures[PROBES_FIGURE])
    if any(r["model"] != r["of_model"] for r in rows):  # checkpoints along training
        figures[PROBES_TRAINING_FIGURE] = probes_training_png(rows)
        write_bytes_atomic(out / PROBES_TRAINING_FIGURE, figures[PROBES_TRAINING_FIGURE])
    return probes_text(rows), rows


def _seeds(out, points: list[dict], probe_points: list[dict]) -> tuple | None:
    """The spread across the runs of each recipe that has several (`ar_slicing.analysis.seeds`),
    point by point: seeds.csv and the table's text; None in a run without such recipes."""
    from ar_slicing.analysis.seeds import spread_rows

    rows = seed_rows(
        spread_rows(points, SEED_EMERGENCE),
        spread_rows(probe_points, SEED_PROBES, model_key="of_model"),
    )
    if not rows:
        return None
    columns = list(rows[0])
    write_csv(out / TABLE_CSV.format("seeds"), columns, [tuple(r.values()) for r in rows])
    return seeds_text(rows)


def coverage_notes(checked) -> list[str]:
    """One sentence per model left out (an unfinished evaluation) and one naming the models
    that scored fewer windows than the others, when any did."""
    notes = [
        f"losses/{name} is left out: {why}; rerun its `arslice eval` to include it."
        for name, why in checked.skipped_losses.items()
    ]
    if checked.scored_windows is not None:
        partial = ", ".join(
            f"{name} ({n} window{'' if n == 1 else 's'})"
            for name, n in sorted(checked.partial_models.items())
        )
        notes.append(
            f"Evaluated on part of the windows only: {partial}. Every number covers windows "
            f"0..{checked.scored_windows - 1}, which all models scored."
        )
    return notes


# The console's short Table 1 (report.md has every column): the perplexity of every slice, the
# gap on AR hits and its share.
CONSOLE_COLUMNS = (
    "model",
    "parameters",
    *(ppl_header(s) for s in TABLE1_SLICES),
    delta_header(AR),
    "AR share of gap",
)


def console_summary(text, t1, context, cfg) -> str:
    """Table 1's main columns, the recall gain line, the token counts and what was left out."""
    from pipeline.query import format_table

    cols = [text.column(h) for h in CONSOLE_COLUMNS]
    lines = [format_table(list(CONSOLE_COLUMNS), list(zip(*cols))), ""]
    gains = text.column("recall gain (nats)")
    lines.append(
        "in-context recall gain (nats): " + "; ".join(f"{m} {g}" for m, g in zip(t1.order, gains))
    )
    n_tokens = max(context["n_tokens"], 1)
    lines.append(
        f"{context['n_tokens']:,} tokens in {context['n_windows']:,} windows, "
        f"{100 * context['n_ar_hits'] / n_tokens:.2f}% AR hits; reference {t1.reference}"
        + (
            f"; {cfg.bootstrap} bootstrap resamples of windows (seed {cfg.seed})"
            if cfg.bootstrap
            else ""
        )
    )
    lines += [f"note: {n}" for n in context["coverage"]]
    if context.get("emergence"):
        points = context["emergence"][1]
        models = len({row[0] for row in points})
        lines.append(
            f"recall emergence: {len(points)} points along the training of {models} model(s) "
            f"(report.md, {EMERGENCE_FIGURE})"
        )
    return "\n".join(lines)


COMMAND = Command(
    ReportConfig,
    run_report,
    validate=validate_report,
    plan_settings=report_settings,
    inputs=lambda cfg: [("--run", cfg.run, "dir")],
    summary="results.duckdb, Table 1, Figure 1 and the HTML report",
    description=(
        "Build RUN/results.duckdb and RUN/report/ (report.md, report.html, frequency_curve.png, "
        "slice_bars.png, CSVs) from the run's tags and every complete losses/<model>/; with "
        "checkpoints along training (losses/<model>@step<n>/), the recall emergence too "
        "(its table, emergence.csv, emergence.png); with probes (probes/<model>/), their table, "
        "probes.csv, probes.png and, along training, probes_training.png."
    ),
    examples="""\
  arslice report --run runs/pile
  arslice report --run runs/pile --reference pythia-160m --bootstrap 2000 --seed 1
  arslice report --run runs/demo --bootstrap 0 --overwrite""",
    pipeline=Wiring(
        table="report",
        reads=(TAGS, LOSSES, PROBES),
        writes=REPORT,
        defaults=lambda run, table: {"run": run.layout.run_dir},
        output_of=lambda cfg: RunLayout(cfg.run).report,
    ),
)
