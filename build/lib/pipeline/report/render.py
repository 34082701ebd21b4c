"""report.md and report.html from the computed tables, figures and passages."""

from __future__ import annotations

import base64
import html

from pipeline.report.passages import passage_html
from pipeline.report.tables import Table1, html_table, markdown_table, query_rows_as_text

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
