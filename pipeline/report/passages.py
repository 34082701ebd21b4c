"""The passage viewer: validation windows token by token, coloured by each model's loss."""

from __future__ import annotations

import html
import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)


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
    from ar_slicing.analysis.sql import run_named_query

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


def load_passages(con, checked, windows: list[tuple[int, str]], models: list[str]) -> list[Passage]:
    """The `windows` of the run `checked` (`ar_slicing.analysis.results.CheckedRun`), token by token."""
    from ar_slicing.data.tokenizer import fingerprint, load_tokenizer
    from ar_slicing.machinery.layout import TOKENIZER_NAME

    tokenizer = None
    for candidate in [
        checked.tokens_dir / TOKENIZER_NAME if checked.tokens_dir else None,
        checked.layout.tokenizer,
    ]:
        if candidate is not None and candidate.is_file():
            tokenizer = load_tokenizer(candidate)
            expected = checked.tags_meta.get("fingerprint")
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
