"""`arslice report`: Table 1, Figure 1 and a browsable HTML report of a run.

Reads the run's tags and every complete `losses/<model>/` (through `results.duckdb`, built or
refreshed first) and writes, under `<run>/report/`:

  report.md            Table-1-style summary: per model, parameters, perplexity on all tokens /
                       AR hits / other tokens with bootstrap 95% intervals over windows, Δ log-ppl
                       vs the reference per slice, and the AR share of the gap; then the gap,
                       per-subset and example tables
  report.html          one self-contained file (figures inline as base64, no external assets):
                       the same tables, the figures, and a passage viewer showing validation
                       windows token by token, AR hits underlined, coloured by each model's loss
  frequency_curve.png  log perplexity per training-count decade bucket, repeats vs non-repeats,
                       one colour per model (the paper's Figure 1)
  slice_bars.png       perplexity per slice per model with the bootstrap intervals
  *.csv                every table: table1, and one per query of queries/
  meta.json            written last (inputs signature, resolved config, counts, timings)

Every table except Table 1 is the result of the same `queries/*.sql` file that `arslice query`
runs, so the report and ad-hoc SQL agree by construction. A complete report is skipped unless
`--overwrite` or its inputs (tags, losses, config) changed since it was written.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import html
import io
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

log = logging.getLogger(__name__)

REPORT_DIR = "report"
QUERY_TABLES = ("slice_perplexity", "gap_vs_reference", "frequency_curve", "by_subset", "examples")
SLICE_LABELS = {"all": "all tokens", "ar": "AR hits", "other": "other tokens"}


@dataclass(frozen=True)
class ReportConfig:
    run: str = field(metadata={"help": "run directory (holds tags/ and losses/<model>/)"})
    reference: str | None = field(
        default=None,
        metadata={
            "help": "reference model (a losses folder name); default: the model whose architecture "
            "or name says attention, else the first"
        },
    )
    bootstrap: int = field(
        default=1000,
        metadata={"help": "bootstrap resamples of windows for the 95%% intervals (0 = none)"},
    )
    seed: int = field(
        default=0, metadata={"help": "bootstrap random seed (fixed: reruns are identical)"}
    )
    passages: int = field(
        default=3, metadata={"help": "validation windows shown in the HTML passage viewer"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete report"})


# ---- formatting ------------------------------------------------------------------------------------


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


# ---- figures -------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def frequency_curve_png(columns: list[str], rows: list[tuple], reference: str) -> bytes:
    """Figure 1: mean NLL (log ppl) per training-count bucket; solid repeats, dashed non-repeats."""
    plt = _pyplot()
    recs = [dict(zip(columns, r)) for r in rows]
    buckets = sorted({r["bucket"] for r in recs})
    labels = {r["bucket"]: r["bucket_label"] for r in recs}
    x_of = {b: i for i, b in enumerate(buckets)}
    models = sorted({r["model"] for r in recs}, key=lambda m: (m != reference, m))
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(models):
        for repeat, style in ((True, "-"), (False, "--")):
            pts = sorted(
                (x_of[r["bucket"]], r["mean_nll"])
                for r in recs
                if r["model"] == model and r["is_repeat"] == repeat
            )
            if not pts:
                continue
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                marker="o" if repeat else "s",
                color=colours[i % len(colours)],
                label=f"{model} — {'repeats' if repeat else 'non-repeats'}",
            )
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([labels[b] for b in buckets], rotation=30, ha="right")
    ax.set_xlabel("training count of the bigram")
    ax.set_ylabel("log perplexity (mean NLL, nats)")
    ax.set_title("Loss vs training frequency: in-context repeats vs other tokens")
    ax.grid(alpha=0.3)
    ax.legend(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        title="solid: repeats",
        title_fontsize=7,
    )
    fig.tight_layout()
    return _png(fig)


def slice_bars_png(report, order: list[str]) -> bytes:
    """Perplexity per slice (groups) per model (bars), with bootstrap intervals as error bars."""
    import numpy as np

    plt = _pyplot()
    rows = {r["model"]: r for r in report.rows()}
    slices = list(SLICE_LABELS)
    width = 0.8 / max(len(order), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    x = np.arange(len(slices))
    for i, model in enumerate(order):
        r = rows[model]
        values = np.array([r[f"ppl_{s}"] for s in slices])
        kwargs = {}
        if report.n_bootstrap:
            lo = np.array([r[f"ppl_{s}_lo"] for s in slices])
            hi = np.array([r[f"ppl_{s}_hi"] for s in slices])
            kwargs["yerr"] = np.nan_to_num(np.vstack([values - lo, hi - values]).clip(min=0))
            kwargs["capsize"] = 3
        ax.bar(
            x + (i - (len(order) - 1) / 2) * width,
            np.nan_to_num(values),
            width,
            label=model,
            **kwargs,
        )
    ax.set_xticks(x)
    ax.set_xticklabels([SLICE_LABELS[s] for s in slices])
    ax.set_ylabel("perplexity")
    ax.set_title(
        "Perplexity per slice"
        + (" (95% bootstrap intervals over windows)" if report.n_bootstrap else "")
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


# ---- passage viewer ------------------------------------------------------------------------------


def decode_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text of each token, decoded one by one.

    A byte-level token can hold part of a multi-byte character; such a run of tokens (at most 4)
    is decoded together and its text shown on its first token (the others show nothing).
    """
    pieces = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    out = list(pieces)
    k = 0
    while k < len(ids):
        if "\ufffd" in out[k]:
            for j in range(2, 5):
                if k + j > len(ids):
                    break
                joined = tokenizer.decode(ids[k : k + j], skip_special_tokens=False)
                if "\ufffd" not in joined:
                    out[k : k + j] = [joined] + [""] * (j - 1)
                    k += j - 1
                    break
        k += 1
    return out


@dataclass
class Passage:
    window_id: int
    start: int
    subset: str
    pieces: list[str]  # text of pos 0 (context) .. n_targets
    tokens: list[int]
    tags: list[dict]  # per target (pos 1..n)
    nll: dict[str, list[float]]  # model -> per target
    why: str


def choose_windows(con, reference: str, n: int) -> list[tuple[int, str]]:
    """(window_id, why) of the windows to show: where models lose most to the reference on AR hits."""
    from pipeline.query import run_named_query

    if n <= 0:
        return []
    chosen: list[tuple[int, str]] = []
    cols, rows = run_named_query(con, "examples", {"reference": reference, "limit": str(n)})
    recs = sorted(
        (dict(zip(cols, r)) for r in rows), key=lambda r: (-r["excess_nll_ar"], r["window_id"])
    )
    for r in recs:
        if r["window_id"] not in {w for w, _ in chosen} and r["excess_nll_ar"] > 0:
            chosen.append(
                (
                    r["window_id"],
                    f"{r['model']} loses {r['excess_nll_ar']:.1f} nats to {reference} on its "
                    f"{r['n_ar_hits']} AR hits",
                )
            )
        if len(chosen) == n:
            return chosen
    for w, hits in con.execute(
        """
        SELECT window_id, count(*) FILTER (WHERE is_ar_hit) AS hits FROM tags
        GROUP BY window_id ORDER BY hits DESC, window_id LIMIT $n
        """,
        {"n": n + len(chosen)},
    ).fetchall():
        if w not in {c for c, _ in chosen} and len(chosen) < n:
            chosen.append((w, f"{hits} AR hits"))
    return chosen


def load_passages(con, layout, windows: list[tuple[int, str]], models: list[str]) -> list[Passage]:
    from ar_slicing.tokenizer import fingerprint, load_tokenizer

    tokenizer = None
    for candidate in [
        layout.tokens_dir / "tokenizer.json" if layout.tokens_dir else None,
        layout.run_dir / "tokenizer.json",
    ]:
        if candidate is not None and candidate.is_file():
            tokenizer = load_tokenizer(candidate)
            expected = layout.tags_meta.get("fingerprint")
            if expected and fingerprint(tokenizer) != expected:
                log.warning(
                    "%s is not the tokenizer of the tags; the passage viewer shows token ids",
                    candidate,
                )
                tokenizer = None
            break
    if tokenizer is None:
        log.warning(
            "no tokenizer.json found beside the validation store; the passage viewer shows token ids"
        )
    passages = []
    for w, why in windows:
        start = con.execute("SELECT start FROM windows WHERE window_id = $w", {"w": w}).fetchone()[
            0
        ]
        cur = con.execute(
            """
            SELECT pos, token, prev, train_count, prev_pos, is_repeat, is_ar_hit, subset
            FROM tags WHERE window_id = $w ORDER BY pos
            """,
            {"w": w},
        )
        cols = [d[0] for d in cur.description]
        tags = [dict(zip(cols, r)) for r in cur.fetchall()]
        nll = {m: [math.nan] * len(tags) for m in models}
        for m, pos, x in con.execute(
            "SELECT model, pos, nll FROM losses WHERE window_id = $w", {"w": w}
        ).fetchall():
            if m in nll:
                nll[m][pos - 1] = float(x)
        ids = [int(tags[0]["prev"])] + [int(t["token"]) for t in tags]
        pieces = decode_pieces(tokenizer, ids) if tokenizer is not None else [f"⟨{i}⟩" for i in ids]
        subsets = sorted({t["subset"] for t in tags if t["subset"]})
        passages.append(
            Passage(w, int(start), ", ".join(subsets) or "—", pieces, ids, tags, nll, why)
        )
    return passages


def _loss_colour(x: float, vmax: float) -> str:
    if math.isnan(x):
        return "transparent"
    a = max(0.0, min(1.0, x / vmax))
    return f"rgba(220,40,30,{a:.2f})"


def passage_html(p: Passage, models: list[str], reference: str, vmax: float) -> str:
    options = "".join(
        f'<option value="{i}"{" selected" if m == reference else ""}>{html.escape(m)} loss</option>'
        for i, m in enumerate(models)
    )
    options += "".join(
        f'<option value="d{i}">{html.escape(m)} − {html.escape(reference)}</option>'
        for i, m in enumerate(models)
        if m != reference
    )
    ref_i = models.index(reference)
    spans = [
        f'<span class="t ctx" title="pos 0 (context only), token {p.tokens[0]}">{html.escape(p.pieces[0])}</span>'
    ]
    for k, t in enumerate(p.tags):
        losses = [p.nll[m][k] for m in models]
        title = (
            f"pos {t['pos']} · token {t['token']} · train count of the bigram {t['train_count']}"
        )
        if t["is_ar_hit"]:
            title += f" · AR hit (bigram seen at pos {t['prev_pos']})"
        elif t["is_repeat"]:
            title += f" · repeat (pos {t['prev_pos']}), too frequent in training for an AR hit"
        title += "".join(f"\n{m}: {x:.2f} nats" for m, x in zip(models, losses))
        cls = "t ar" if t["is_ar_hit"] else "t"
        data = ",".join("nan" if math.isnan(x) else f"{x:.3f}" for x in losses)
        style = f"background:{_loss_colour(losses[ref_i], vmax)}"
        spans.append(
            f'<span class="{cls}" data-l="{data}" style="{style}" title="{html.escape(title)}">'
            f"{html.escape(p.pieces[k + 1])}</span>"
        )
    n_ar = sum(t["is_ar_hit"] for t in p.tags)
    return (
        f'<div class="passage" data-window="{p.window_id}" data-ref="{ref_i}"><h3>Window {p.window_id} — stream {p.start:,}–'
        f"{p.start + len(p.tags):,}, subset {html.escape(p.subset)}, {n_ar} AR hits</h3>"
        f"<p class=why>{html.escape(p.why)}</p>"
        f'<label>colour: <select onchange="recolour(this)">{options}</select></label>'
        f'<pre class="text">{"".join(spans)}</pre></div>'
    )


HTML_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th:first-child,td:first-child{text-align:left}
th{background:#f3f3f3}
img{max-width:100%;border:1px solid #eee}
pre.text{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:13px;line-height:1.7;
 border:1px solid #ddd;padding:1em;background:#fff}
span.t.ar{border-bottom:3px solid #1f4fd8;font-weight:bold}
span.ctx{color:#999}
.why{color:#555;font-style:italic}
.legend span{padding:0 .5em}
"""

HTML_SCRIPT = """
function recolour(sel){
  var box=sel.closest('.passage'), v=sel.value, diff=v[0]==='d', i=parseInt(diff?v.slice(1):v);
  var ref=parseInt(box.dataset.ref), vmax=parseFloat(document.body.dataset.vmax);
  box.querySelectorAll('span.t[data-l]').forEach(function(s){
    var l=s.dataset.l.split(',').map(parseFloat), x=diff?l[i]-l[ref]:l[i];
    if(isNaN(x)){s.style.background='transparent';return;}
    if(diff){var a=Math.min(1,Math.abs(x)/3);
      s.style.background=x>0?'rgba(220,40,30,'+a+')':'rgba(30,90,220,'+a+')';}
    else{s.style.background='rgba(220,40,30,'+Math.max(0,Math.min(1,x/vmax))+')';}
  });
}
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


# ---- the stage -----------------------------------------------------------------------------------


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


def _intro(context: dict) -> list[str]:
    info = context["info"]
    lines = [
        f"Run `{context['run']}`: {context['n_tokens']:,} scored validation tokens in "
        f"{context['n_windows']:,} windows of {info.get('window')} tokens; "
        f"{context['n_ar_hits']:,} AR hits ({100 * context['n_ar_hits'] / max(context['n_tokens'], 1):.2f}%), "
        f"training-count threshold {info.get('threshold')}. Reference: **{context['reference']}**.",
    ]
    if info.get("scored_windows") not in (None, "None"):
        lines.append(
            f"Some models were evaluated on part of the windows only: every number covers windows "
            f"0..{int(info['scored_windows']) - 1}, which all models scored."
        )
    if context["n_bootstrap"]:
        lines.append(
            f"Brackets: 95% bootstrap intervals from {context['n_bootstrap']} resamples of windows "
            f"(seed {context['seed']}; the same resamples for every model, so Δ and the AR share are paired)."
        )
    lines.append(
        "Δ log-ppl = mean NLL of the model minus the reference's on the slice (nats); AR share of gap = "
        "Σ over AR hits of (NLL model − NLL reference) / the same sum over all tokens (may exceed 100% "
        "or be negative)."
    )
    return lines


def render_markdown(context: dict, t1: Table1, tables: dict) -> str:
    parts = ["# AR slicing report", "", *(line + "\n" for line in _intro(context))]
    parts += ["## Table 1: perplexity per slice", "", markdown_table(t1.header, t1.rows), ""]
    parts += ["![frequency curve](frequency_curve.png)", "", "![slice bars](slice_bars.png)", ""]
    titles = {
        "gap_vs_reference": "Gap to the reference (`queries/gap_vs_reference.sql`)",
        "by_subset": "Per subset (`queries/by_subset.sql`)",
        "frequency_curve": "Frequency curve (`queries/frequency_curve.sql`)",
        "examples": "Windows where models lose most on AR hits (`queries/examples.sql`)",
    }
    for name, title in titles.items():
        cols, rows = tables[name]
        parts += [f"## {title}", "", markdown_table(cols, query_rows_as_text(cols, rows)), ""]
    parts.append(
        "Every table is also in this directory as CSV; `arslice query NAME --run RUN` reruns any query."
    )
    return "\n".join(parts) + "\n"


def render_html(context, t1, tables, freq_png, bars_png, passages, order, vmax) -> str:
    reference = context["reference"]
    body = ["<h1>AR slicing report</h1>"]
    body += [f"<p>{html.escape(line).replace('**', '')}</p>" for line in _intro(context)]
    body += ["<h2>Table 1: perplexity per slice</h2>", html_table(t1.header, t1.rows, "table1")]
    body += ["<h2>Figures</h2>", _img(freq_png, "frequency curve"), _img(bars_png, "slice bars")]
    for name, title in (
        ("gap_vs_reference", "Gap to the reference"),
        ("by_subset", "Per subset"),
        ("frequency_curve", "Frequency curve"),
        ("examples", "Windows where models lose most on AR hits"),
    ):
        cols, rows = tables[name]
        body += [f"<h2>{html.escape(title)} <small>(queries/{name}.sql)</small></h2>"]
        body += [html_table(cols, query_rows_as_text(cols, rows), name)]
    body += [
        "<h2>Passages</h2>",
        f"<p>Validation windows token by token. <b style='border-bottom:3px solid #1f4fd8'>Underlined</b>: "
        f"AR hits. Background: the chosen model's loss (white 0 → red ≥ {vmax:g} nats), or the "
        f"difference to {html.escape(reference)} (blue: lower loss, red: higher). Hover a token for "
        "its position, training count and every model's loss. The first (grey) token is context only.</p>",
    ]
    body += [passage_html(p, order, reference, vmax) for p in passages] or ["<p>(no windows)</p>"]
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>AR slicing report</title>"
        f"<style>{HTML_STYLE}</style><script>{HTML_SCRIPT}</script></head>"
        f'<body data-vmax="{vmax:g}">' + "\n".join(body) + "</body></html>\n"
    )


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
