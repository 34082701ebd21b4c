"""report.html in a real browser (headless Chromium over the DevTools protocol): no console
error, Table 1 readable at 1400 px, and the passage viewer's colour selector recolours tokens.

Needs Debian's `chromium` (`make install-browser`; CI installs it); skipped only without it.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.devtools import Browser, chromium_path
from tests.pipeline.test_report import text_run  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(
    chromium_path() is None, reason="needs chromium (make install-browser)"
)

# Choose an option of the first passage's colour selector, as a click would.
SELECT_JS = """
(s => { s.value = VALUE; s.dispatchEvent(new Event('change')); })
  (document.querySelector('.passage select'))
"""
# Each token of the first passage: its losses (data-l), its background as the browser computed it.
TOKENS_JS = """
Array.from(document.querySelectorAll('.passage')[0].querySelectorAll('span.t[data-l]'))
  .map(s => [s.dataset.l, getComputedStyle(s).backgroundColor])
"""


# How many lines each matched element's text takes (boxes that overlap vertically share a line).
LINES_JS = """
Array.from(document.querySelectorAll('%s')).map(el => {
  const r = document.createRange(); r.selectNodeContents(el);
  let lines = 0, bottom = -Infinity;
  for (const b of Array.from(r.getClientRects()).sort((a, b) => a.top - b.top)) {
    if (b.height === 0) continue;
    if (b.top >= bottom - 1) { lines += 1; bottom = b.bottom; } else bottom = Math.max(bottom, b.bottom);
  }
  return lines;
})
"""


def rgba(css: str) -> tuple[float, float, float, float]:
    """`rgb(r, g, b)` / `rgba(r, g, b, a)` as numbers (a transparent background has a = 0)."""
    values = [float(v) for v in re.findall(r"[\d.]+", css)]
    return (*values[:3], values[3] if len(values) == 4 else 1.0)


def expected_colour(losses: list[float], model: int, reference: int, diff: bool, vmax: float):
    """The colour the viewer promises: red with the loss's share of vmax; for a difference to
    the reference, red (worse) or blue (better) with |difference| / 3 nats."""
    x = losses[model] - losses[reference] if diff else losses[model]
    if x != x:  # NaN
        return (0.0, 0.0, 0.0, 0.0)
    if diff:
        a = min(1.0, abs(x) / 3)
        return (220.0, 40.0, 30.0, a) if x > 0 else (30.0, 90.0, 220.0, a)
    return (220.0, 40.0, 30.0, max(0.0, min(1.0, x / vmax)))


def assert_colours(tokens, model: int, reference: int, diff: bool, vmax: float) -> None:
    for data, css in tokens:
        losses = [float(v) for v in data.split(",")]
        want = expected_colour(losses, model, reference, diff, vmax)
        got = rgba(css)
        if want[3] == 0:
            assert got[3] == 0, (data, css)
            continue
        assert got[:3] == want[:3], (data, css, want)
        assert got[3] == pytest.approx(want[3], abs=0.01), (data, css, want)


def test_report_html_in_chromium(text_run):  # noqa: F811
    from pipeline.report import ReportConfig, run_report

    run, _, _ = text_run
    run_report(ReportConfig(run=str(run), bootstrap=100))
    with Browser(width=1400) as page:
        page.open(run / "report" / "report.html")

        # the Markdown of the intro became HTML: no literal backticks or asterisks
        intro = page.evaluate("Array.from(document.querySelectorAll('p')).map(p => p.innerText)")
        assert not any("`" in p or "**" in p for p in intro), intro
        assert page.evaluate("document.querySelectorAll('p code').length") > 0

        # Table 1 at 1400 px: every cell on one line, and the table as wide as its box at most
        lines = page.evaluate(LINES_JS % "table.table1 td")
        assert lines and set(lines) == {1}, lines
        box = page.evaluate(
            "(b => [b.scrollWidth, b.clientWidth])"
            "(document.querySelector('table.table1').parentElement)"
        )
        assert box[0] <= box[1], box
        cells = page.evaluate("Array.from(document.querySelectorAll('table.table1 td .ci')).length")
        assert cells > 0  # the intervals are there, in their own span

        # the colour selector: each option recolours every token of its passage as promised
        vmax = float(page.evaluate("document.body.dataset.vmax"))
        reference = int(page.evaluate("document.querySelector('.passage').dataset.ref"))
        options = page.evaluate(
            "Array.from(document.querySelector('.passage select').options).map(o => o.value)"
        )
        assert options[:3] == ["0", "1", "2"] and "d1" in options
        before = page.evaluate(TOKENS_JS)
        assert_colours(before, reference, reference, False, vmax)  # the reference's loss first
        for value in ("1", "d1", "2", "0"):
            page.evaluate(SELECT_JS.replace("VALUE", json.dumps(value)))
            after = page.evaluate(TOKENS_JS)
            diff = value.startswith("d")
            assert_colours(after, int(value.lstrip("d")), reference, diff, vmax)
            if value == "1":
                assert [c for _, c in after] != [c for _, c in before]  # tokens recoloured
        # the other passages kept their colours
        others = page.evaluate(
            "Array.from(document.querySelectorAll('.passage')).slice(1).map(p => "
            "p.querySelector('select').value)"
        )
        assert others and set(others) == {str(reference)}
    assert page.errors == []


def test_console_errors_are_caught(tmp_path):
    """The check above can fail: a page with a script error and a console.error is reported."""
    page_file = tmp_path / "broken.html"
    page_file.write_text(
        "<!DOCTYPE html><html><head><meta charset=utf-8><script>console.error('bad thing');"
        "undefinedFunction();</script></head><body></body></html>"
    )
    with Browser() as page:
        page.open(page_file)
        page.evaluate("1")
    assert any("bad thing" in e for e in page.errors), page.errors
    assert any("undefinedFunction" in e for e in page.errors), page.errors
