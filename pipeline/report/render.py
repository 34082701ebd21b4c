"""report.md and report.html from the computed tables, figures and passages."""

from __future__ import annotations

import base64
import html
import re

from ar_slicing.machinery.layout import (
    COPY_LENGTH_FIGURE,
    EMERGENCE_FIGURE,
    FREQUENCY_CURVE_FIGURE,
    MQAR_FIGURE,
    PROBES_FIGURE,
    PROBES_TRAINING_FIGURE,
    RECALL_GAIN_FIGURE,
    SLICE_BARS_FIGURE,
)
from pipeline.report.passages import passage_html
from pipeline.report.tables import Table1Text, html_table, markdown_table, query_rows_as_text

HTML_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1500px;color:#222;padding:0 1em}
.scroll{overflow-x:auto}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 5px;text-align:right}
td{white-space:nowrap}
td .ci{color:#666;font-size:10.5px}
table.table1{font-size:12px}
code{font-family:ui-monospace,monospace;font-size:90%;background:#f3f3f3;padding:0 .2em}
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


def _intro(context: dict) -> list[str]:
    info = context["info"]
    lines = [
        f"Run `{context['run']}`: {context['n_tokens']:,} scored validation tokens in "
        f"{context['n_windows']:,} windows of {info.get('window')} tokens; "
        f"{context['n_ar_hits']:,} AR hits ({100 * context['n_ar_hits'] / max(context['n_tokens'], 1):.2f}%), "
        f"training-count threshold {info.get('threshold')}. Reference: **{context['reference']}**.",
    ]
    lines += context["coverage"]
    if context["n_bootstrap"]:
        lines.append(
            f"Brackets: 95% bootstrap intervals from {context['n_bootstrap']} resamples of windows "
            f"(seed {context['seed']}; the same resamples for every model, so Δ, the AR share and the recall gain are paired)."
        )
    lines.append(
        "Δ log-ppl = mean NLL of the model minus the reference's on the slice (nats); AR share of gap = "
        "Σ over AR hits of (NLL model − NLL reference) / the same sum over all tokens (may exceed 100% "
        "or be negative). Recall gain = within each training-count bucket, mean NLL of the "
        "non-repeats minus that of the repeats, averaged over buckets weighted by their repeats "
        "(nats; positive: a bigram already in the context is predicted better than an equally "
        "frequent one that is not; no reference needed)."
    )
    return lines


QUERY_TITLES = {
    "gap_vs_reference": "Gap to the reference",
    "recall_gain": "In-context recall gain by training-count bucket",
    "by_subset": "Per subset",
    "frequency_curve": "Frequency curve",
    "examples": "Windows where models lose most on AR hits",
}
MQAR_TITLE = "MQAR: multi-query associative recall (Zoology Figure 2)"
MQAR_TEXT = (
    "Accuracy (%) on held-out sequences of two-layer models trained on the synthetic task "
    "(`arslice mqar`, best over its learning rates): which mixers can recall a value paired "
    "with a key earlier in the context, by model dimension and sequence length."
)
COPY_TITLE = "Copy length: perplexity by how long a span is copied (`queries/copy_length.sql`)"
COPY_TEXT = (
    "Repeats by copy length `match_len` (the longest span ending at the token that already "
    "occurred earlier in the window; 1 = the paper's bigram repeat) and by the training count of "
    "the copied span (`span_train_count`, the (min(match_len, K) + 1)-gram: 0 = the span never "
    "occurs in training, so predicting it is copying from the context; docs/copy-length.md). "
    "Brackets: 95% bootstrap intervals over windows; n = scored tokens."
)
COPY_SUBSET_TITLE = "Copy length per subset"
EMERGENCE_TITLE = "Recall emergence: in-context recall along training"
EMERGENCE_TEXT = (
    "Each model at the checkpoints evaluated along its training (and at its end, when the run "
    "trained it), against the training tokens it had seen: the recall gain, its part at "
    "training count 0 (bigrams never seen in training, where only the context can help) and "
    "the perplexity on AR hits and on other tokens, every point of a model on the windows all of "
    "its points scored (`windows`; an earlier checkpoint may be scored on an evenly strided "
    "subset). Brackets: 95% bootstrap intervals over those windows, the same resamples for every "
    "point of a model. Table 1 holds the models alone, on every window "
    "(`queries/recall_emergence.sql` without intervals; docs/design.md, Recall emergence)."
)
PROBES_TITLE = "Probes: induction, zero-shot recall and loss by position"
PROBES_TEXT = (
    "Each model and each checkpoint along its training on the probes of docs/design.md (Probes "
    "of a checkpoint): the induction score on repeated random tokens (mean NLL on the first copy "
    "minus the second, nats; brackets: 95% bootstrap over sequences) and the argmax accuracy on "
    "the second copy; zero-shot key-value recall accuracy (argmax = the value at its query) "
    "averaged over the k probed and at the largest k; the in-context learning score on the "
    "run's windows (mean NLL at the late position minus the early one; negative: later tokens "
    "are predicted better); and the in-context recall gain on the run's text at the same point "
    "(the recall emergence's, with its interval, where there is one). Every model of one "
    "vocabulary reads the same sequences (`queries/probe_scores.sql`, `probe_recall.sql`, "
    "`probe_position.sql`)."
)
SEEDS_TITLE = "Across seeds: the runs of one recipe"
SEEDS_TEXT = (
    "Models named `<recipe>-seed<n>` are runs of the recipe `<recipe>` from other seeds, beside "
    "the model named `<recipe>` itself (docs/design.md, Runs of one recipe). Per recipe with two "
    "runs or more and per step: how many runs have a point there, and each statistic's mean over "
    "them with the least and the greatest run in brackets, the range the figures above draw as "
    "the recipe's band (`seeds.csv`; in SQL, `recipe_of(model)` and `seed_of(model)`)."
)
FIGURE_TITLES = {
    FREQUENCY_CURVE_FIGURE: "frequency curve",
    COPY_LENGTH_FIGURE: "copy-length curve",
    SLICE_BARS_FIGURE: "slice bars",
    RECALL_GAIN_FIGURE: "recall gain",
}


def inline_html(text: str) -> str:
    """One line of the report's Markdown as HTML: `code` and **bold**, everything escaped."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)


def render_markdown(context: dict, t1: Table1Text, tables: dict) -> str:
    parts = ["# AR slicing report", "", *(line + "\n" for line in _intro(context))]
    parts += ["## Table 1: perplexity per slice", "", markdown_table(t1.header, t1.rows), ""]
    parts += [f"![{alt}]({name})\n" for name, alt in FIGURE_TITLES.items()]
    if context.get("emergence"):
        parts += [f"## {EMERGENCE_TITLE}", "", EMERGENCE_TEXT, ""]
        parts += [
            markdown_table(*context["emergence"]),
            "",
            f"![recall emergence]({EMERGENCE_FIGURE})\n",
        ]
    if context.get("probes"):
        parts += [f"## {PROBES_TITLE}", "", PROBES_TEXT, "", markdown_table(*context["probes"])]
        parts += ["", f"![probes]({PROBES_FIGURE})\n"]
        if context.get("probes_training"):
            parts += [f"![probes along training]({PROBES_TRAINING_FIGURE})\n"]
    if context.get("seeds"):
        parts += [f"## {SEEDS_TITLE}", "", SEEDS_TEXT, "", markdown_table(*context["seeds"]), ""]
    copies = context.get("copy_length")
    if copies:
        parts += [f"## {COPY_TITLE}", "", COPY_TEXT, "", markdown_table(*copies["table"]), ""]
        parts += [f"## {COPY_SUBSET_TITLE}", "", markdown_table(*copies["by_subset"]), ""]
    for name, title in QUERY_TITLES.items():
        cols, rows = tables[name]
        table = markdown_table(cols, query_rows_as_text(cols, rows))
        parts += [f"## {title} (`queries/{name}.sql`)", "", table, ""]
    if context.get("mqar"):
        parts += [
            f"## {MQAR_TITLE}",
            "",
            MQAR_TEXT,
            "",
            context["mqar"].markdown,
            f"![MQAR]({MQAR_FIGURE})\n",
        ]
    parts.append(
        "Every table is also in this directory as CSV; `arslice query NAME --run RUN` reruns any query."
    )
    return "\n".join(parts) + "\n"


def render_html(context, t1, tables, figures, passages, order, vmax) -> str:
    reference = context["reference"]
    body = ["<h1>AR slicing report</h1>"]
    body += [f"<p>{inline_html(line)}</p>" for line in _intro(context)]
    body += [
        "<h2>Table 1: perplexity per slice</h2>",
        _scroll(html_table(t1.header, t1.rows, "table1")),
    ]
    body += ["<h2>Figures</h2>"]
    body += [_img(figures[name], alt) for name, alt in FIGURE_TITLES.items()]
    if context.get("emergence"):
        body += [
            f"<h2>{html.escape(EMERGENCE_TITLE)}</h2>",
            f"<p>{inline_html(EMERGENCE_TEXT)}</p>",
        ]
        body += [_scroll(html_table(*context["emergence"], "emergence"))]
        body += [_img(figures[EMERGENCE_FIGURE], "recall emergence")]
    if context.get("probes"):
        body += [f"<h2>{html.escape(PROBES_TITLE)}</h2>", f"<p>{inline_html(PROBES_TEXT)}</p>"]
        body += [_scroll(html_table(*context["probes"], "probes"))]
        body += [_img(figures[PROBES_FIGURE], "probes")]
        if PROBES_TRAINING_FIGURE in figures:
            body += [_img(figures[PROBES_TRAINING_FIGURE], "probes along training")]
    if context.get("seeds"):
        body += [f"<h2>{html.escape(SEEDS_TITLE)}</h2>", f"<p>{inline_html(SEEDS_TEXT)}</p>"]
        body += [_scroll(html_table(*context["seeds"], "seeds"))]
    copies = context.get("copy_length")
    if copies:
        body += [f"<h2>{inline_html(COPY_TITLE)}</h2>", f"<p>{inline_html(COPY_TEXT)}</p>"]
        body += [_scroll(html_table(*copies["table"], "copy_length"))]
        body += [f"<h2>{html.escape(COPY_SUBSET_TITLE)}</h2>"]
        body += [_scroll(html_table(*copies["by_subset"], "copy_length_by_subset"))]
    for name, title in QUERY_TITLES.items():
        cols, rows = tables[name]
        body += [f"<h2>{html.escape(title)} <small>(queries/{name}.sql)</small></h2>"]
        body += [_scroll(html_table(cols, query_rows_as_text(cols, rows), name))]
    if context.get("mqar"):
        from pipeline.mqar import accuracy_table

        header, rows = accuracy_table(context["mqar"].rows)
        body += [f"<h2>{html.escape(MQAR_TITLE)}</h2>", f"<p>{inline_html(MQAR_TEXT)}</p>"]
        body += [_scroll(html_table(header, rows, "mqar")), _img(figures[MQAR_FIGURE], "MQAR")]
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


def _scroll(table: str) -> str:
    """A wide table scrolls inside its own box instead of widening the page."""
    return f'<div class="scroll">{table}</div>'
