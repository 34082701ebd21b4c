"""Slice metrics, the bootstrap and `arslice report` on runs built by hand from real text."""

from __future__ import annotations

import csv
import math
from collections import Counter
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

import duckdb
import numpy as np
import pytest

from ar_slicing.analysis.metrics import (
    WindowSums,
    ar_share_of_gap,
    bootstrap,
    intervals,
    point_estimates,
    slice_report,
)
from ar_slicing.errors import ArSliceError
from pipeline.config import printing_summaries
from tests.queries.test_queries import QUOTED, tiny_run, write_run  # noqa: F401  (tiny_run is a fixture)

# ---- metrics ------------------------------------------------------------------------------------


def test_ar_share_of_gap_per_token():
    ref = np.array([2.0, 2.0, 2.0, 2.0, 2.0])
    model = np.array([3.0, 1.75, 1.75, 2.0, 3.0])
    is_ar = np.array([True, False, False, False, True])
    assert ar_share_of_gap(model, ref, is_ar) == pytest.approx(2.0 / 1.5)  # > 100%
    # better on AR hits, worse elsewhere: a negative share
    assert (
        ar_share_of_gap(np.array([1.0, 4.0]), np.array([2.0, 2.0]), np.array([True, False])) == -1.0
    )
    assert math.isnan(ar_share_of_gap(ref, ref, is_ar))


def synthetic_windows(
    n_windows: int, seed: int = 0, tokens_per_window: int = 64
) -> tuple[WindowSums, dict]:
    """Per-token losses of two models over `n_windows` windows, and their per-window sums."""
    rng = np.random.default_rng(seed)
    w = np.repeat(np.arange(n_windows), tokens_per_window)
    is_ar = rng.random(w.size) < 0.1
    window_effect = rng.normal(0, 0.5, n_windows)[w]  # windows differ: tokens are not independent
    ref = np.abs(rng.normal(3.0, 1.0, w.size) + window_effect) * np.where(is_ar, 0.3, 1.0)
    model = ref + np.where(is_ar, 1.5, 0.05) + rng.normal(0, 0.2, w.size)
    nll = np.stack([ref, model], axis=1)  # (N, M)
    masks = [np.ones_like(is_ar), is_ar, ~is_ar]  # the slices all, ar, other
    sums = WindowSums(
        models=["attention", "hyena"],
        window_ids=np.arange(n_windows),
        slices=("all", "ar", "other"),
        n=np.stack([np.bincount(w, weights=t, minlength=n_windows) for t in masks], 1),
        s=np.stack(
            [
                np.stack(
                    [np.bincount(w, weights=nll[:, j] * t, minlength=n_windows) for j in range(2)],
                    1,
                )
                for t in masks
            ],
            1,
        ),
    )
    return sums, {"w": w, "is_ar": is_ar, "nll": nll}


def naive_statistics(nll: np.ndarray, is_ar: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics straight from per-token arrays (model 0 the reference)."""
    out = {}
    for t, mask in (("all", np.ones_like(is_ar)), ("ar", is_ar), ("other", ~is_ar)):
        mean = nll[mask].mean(axis=0)
        out[f"mean_nll_{t}"] = mean
        out[f"ppl_{t}"] = np.exp(mean)
        out[f"delta_{t}"] = mean - mean[0]
    out["ar_share"] = np.array(
        [
            np.nan if j == 0 else ar_share_of_gap(nll[:, j], nll[:, 0], is_ar)
            for j in range(nll.shape[1])
        ]
    )
    return out


def test_point_estimates_equal_per_token_definitions():
    sums, raw = synthetic_windows(30)
    got = point_estimates(sums, 0)
    want = naive_statistics(raw["nll"], raw["is_ar"])
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-10, equal_nan=True)
    assert got["pct_ar"] == pytest.approx(100 * raw["is_ar"].mean())


def test_bootstrap_equals_a_naive_resampling_loop():
    """Each replicate = the metrics of the tokens of windows drawn with replacement (same draws)."""
    sums, raw = synthetic_windows(25, seed=1)
    reps = bootstrap(sums, 0, n_replicates=40, seed=7)
    draws = np.random.default_rng(7).integers(0, 25, size=(40, 25))
    for b in range(40):
        rows = np.concatenate([np.flatnonzero(raw["w"] == k) for k in draws[b]])
        want = naive_statistics(raw["nll"][rows], raw["is_ar"][rows])
        for key, value in want.items():
            np.testing.assert_allclose(reps[key][b], value, rtol=1e-9, equal_nan=True)


def test_bootstrap_is_deterministic_and_seeded():
    sums, _ = synthetic_windows(40)
    a = bootstrap(sums, 0, 100, seed=3)
    b = bootstrap(sums, 0, 100, seed=3)
    c = bootstrap(sums, 0, 100, seed=4)
    np.testing.assert_array_equal(a["ppl_all"], b["ppl_all"])
    assert not np.array_equal(a["ppl_all"], c["ppl_all"])


def test_bootstrap_interval_contains_the_estimate_and_narrows_with_more_windows():
    widths = {}
    for n in (20, 500):
        sums, _ = synthetic_windows(n, seed=n)
        rep = slice_report(sums, "attention", n_bootstrap=500, seed=0)
        for row in rep.rows():
            for key in ("ppl_all", "ppl_ar", "ppl_other", "delta_all", "delta_ar"):
                assert row[f"{key}_lo"] <= row[key] <= row[f"{key}_hi"], (n, row["model"], key)
            if row["model"] == "hyena":
                assert row["ar_share_lo"] <= row["ar_share"] <= row["ar_share_hi"]
                widths[n] = {
                    k: row[f"{k}_hi"] - row[f"{k}_lo"] for k in ("ppl_all", "ppl_ar", "ar_share")
                }
    for key in widths[20]:
        # ~sqrt(500/20) = 5x narrower; ask for at least 2.5x
        assert widths[500][key] * 2.5 < widths[20][key], (key, widths)


def test_intervals_ignore_the_reference_nan_share():
    sums, _ = synthetic_windows(10)
    reps = bootstrap(sums, 0, 50, seed=0)
    lo, hi = intervals(reps)["ar_share"]
    assert math.isnan(lo[0]) and math.isnan(hi[0])
    assert lo[1] < hi[1]


# ---- a run from real text ---------------------------------------------------------------------------


MODELS = {"attention": "attention", "hyena": "hyena", QUOTED: "rwkv"}


@pytest.fixture
def text_run(tmp_path, stdlib_texts, bpe_tokenizer, bpe_tokenizer_path):
    """Validation: 6 stdlib files (~2k tokens each, window 128); counts: 30 other files; 3 models."""
    enc = [bpe_tokenizer.encode(t).ids for t in stdlib_texts]
    val = [ids[:1500] for ids in enc[:6]]
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    train_stream = [t for ids in enc[10:] for t in [*ids, eos]]
    counts = Counter(pairwise(train_stream))
    run = tmp_path / "text-run"
    # losses written after the tags are known: AR hits easy for attention, hard for hyena
    from tests.queries.test_queries import naive_tags

    stream = [t for ids in val for t in [*ids, eos]]
    doc_of = [d for d, ids in enumerate(val) for _ in range(len(ids) + 1)]
    subsets = ["Github", "Github", "ArXiv", "ArXiv", "Pile-CC", None]
    rows, _ = naive_tags(stream, doc_of, subsets, counts, 128)
    rng = np.random.default_rng(0)
    is_ar = np.array([r["is_ar_hit"] for r in rows])
    base = rng.gamma(2.0, 1.5, len(rows))
    losses = {
        "attention": np.where(is_ar, 0.2 * base, base),
        "hyena": np.where(is_ar, 1.1 * base, 1.02 * base),
        QUOTED: np.where(is_ar, 0.6 * base, 1.01 * base),
    }
    write_run(
        run,
        val,
        subsets,
        dict(counts),
        128,
        {k: v.tolist() for k, v in losses.items()},
        bpe_tokenizer,
        tokenizer_json=bpe_tokenizer_path.read_text(),
        architectures=MODELS,
        shard_rows=3000,  # several tag shards
    )
    return run, rows, {k: v.astype(np.float32).astype(np.float64) for k, v in losses.items()}


class HtmlFacts(HTMLParser):
    def __init__(self):
        super().__init__()
        self.text: list[str] = []
        self.imgs: list[str] = []
        self.external: list[str] = []
        self.passages: list[int] = []
        self.spans: list[list[dict]] = []
        self.options: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        for key in ("src", "href"):
            if key in a and not a[key].startswith(("data:", "#")):
                self.external.append(a[key])
        if tag == "div" and a.get("class") == "passage":
            self.passages.append(int(a["data-window"]))
            self.spans.append([])
        if tag == "span" and "t" in (a.get("class") or "").split():
            self.spans[-1].append(a)

    def handle_data(self, data):
        self.text.append(data)


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_report_files_tables_and_html(text_run, capsys):
    import matplotlib.image as mpimg

    from pipeline.cli import main

    run, rows, losses = text_run
    assert main(["report", "--run", str(run), "--bootstrap", "200"]) == 0
    printed = capsys.readouterr().out
    out = run / "report"
    assert printed.strip().endswith(str(out / "report.html"))
    for model in MODELS:
        assert model in printed
    names = [
        "report.md",
        "report.html",
        "frequency_curve.png",
        "slice_bars.png",
        "recall_gain.png",
        "copy_length.png",
        "copy_length.csv",
        "table1.csv",
        "recall_gain.csv",
        "slice_perplexity.csv",
        "gap_vs_reference.csv",
        "frequency_curve.csv",
        "by_subset.csv",
        "examples.csv",
        "meta.json",
    ]
    for name in names:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (run / "results.duckdb").is_file()
    for name in ("frequency_curve.png", "slice_bars.png", "recall_gain.png", "copy_length.png"):
        img = mpimg.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01  # not a blank canvas

    # Table 1 equals the per-token definitions, and its intervals contain the estimates
    is_ar = np.array([r["is_ar_hit"] for r in rows])
    t1 = {r["model"]: r for r in read_csv(out / "table1.csv")}
    assert list(t1) == ["attention", "hyena", QUOTED]  # reference first
    ref = losses["attention"]
    for model, nll in losses.items():
        r = t1[model]
        assert float(r["ppl_all"]) == pytest.approx(math.exp(nll.mean()), rel=1e-8)
        assert float(r["ppl_ar"]) == pytest.approx(math.exp(nll[is_ar].mean()), rel=1e-8)
        assert float(r["ppl_other"]) == pytest.approx(math.exp(nll[~is_ar].mean()), rel=1e-8)
        assert float(r["delta_ar"]) == pytest.approx(
            nll[is_ar].mean() - ref[is_ar].mean(), abs=1e-8
        )
        for key in ("ppl_all", "ppl_ar", "ppl_other"):
            assert float(r[f"{key}_lo"]) <= float(r[key]) <= float(r[f"{key}_hi"])
        if model != "attention":
            share = ((nll - ref)[is_ar]).sum() / (nll - ref).sum()
            assert float(r["ar_share"]) == pytest.approx(share, rel=1e-8)
            assert float(r["ar_share_lo"]) <= float(r["ar_share"]) <= float(r["ar_share_hi"])
    assert t1["hyena"]["architecture"] == "hyena" and t1["attention"]["ar_share"] == ""
    # the recall gain column: the naive per-bucket definition, inside its own interval
    from tests.queries.test_recall_gain import naive_recall_gain

    for model, nll in losses.items():
        gain, _ = naive_recall_gain(rows, nll)
        r = t1[model]
        assert float(r["recall_gain"]) == pytest.approx(gain, rel=1e-8)
        assert float(r["recall_gain_lo"]) <= gain <= float(r["recall_gain_hi"])
    assert "in-context recall gain (nats): attention " in printed
    # the SQL gap table agrees with the Python metrics
    gap = {r["model"]: r for r in read_csv(out / "gap_vs_reference.csv")}
    assert float(gap["hyena"]["ar_share_of_gap"]) == pytest.approx(
        float(t1["hyena"]["ar_share"]), rel=1e-8
    )

    md = (out / "report.md").read_text()
    assert "| model | architecture | parameters | ppl all |" in md
    for model in MODELS:
        assert f"| {model}" in md
    assert "attention (reference)" in md

    # the HTML: parses, self-contained, every model, passages of the right length
    facts = HtmlFacts()
    facts.feed((out / "report.html").read_text())
    facts.close()
    text = "".join(facts.text)
    for model in MODELS:
        assert model in text
    assert len(facts.imgs) == 4 and all(s.startswith("data:image/png;base64,") for s in facts.imgs)
    assert facts.external == []
    assert len(facts.passages) == 3
    for w, spans in zip(facts.passages, facts.spans):
        mine = [r for r in rows if r["window_id"] == w]
        assert len(spans) == len(mine) + 1  # the context token, then one span per target
        assert all(len(s["data-l"].split(",")) == 3 for s in spans[1:])  # a loss per model
        assert [s["class"] == "t ar" for s in spans[1:]] == [r["is_ar_hit"] for r in mine]
        assert any(r["is_ar_hit"] for r in mine)


def test_passages_decode_token_by_token_and_mark_ar_hits(text_run, bpe_tokenizer):
    from ar_slicing.analysis.results import ensure_results
    from pipeline.report import choose_windows, load_passages

    run, rows, losses = text_run
    checked, _ = ensure_results(run)
    con = duckdb.connect(str(checked.layout.results), read_only=True)
    windows = choose_windows(con, "attention", 2)
    assert len(windows) == 2
    # the worst window of any model on AR hits comes first
    excess = {}
    is_ar = np.array([r["is_ar_hit"] for r in rows])
    wid = np.array([r["window_id"] for r in rows])
    for m in ("hyena", QUOTED):
        d = (losses[m] - losses["attention"]) * is_ar
        for w in np.unique(wid):
            excess[(m, w)] = d[wid == w].sum()
    assert windows[0][0] == max(excess, key=excess.get)[1]
    passages = load_passages(con, checked, windows, ["attention", "hyena", QUOTED])
    for p in passages:
        assert "".join(p.pieces) == bpe_tokenizer.decode(p.tokens, skip_special_tokens=False)
        mine = [r for r in rows if r["window_id"] == p.window_id]
        assert [t["is_ar_hit"] for t in p.tags] == [r["is_ar_hit"] for r in mine]
        got = np.array(p.nll["hyena"])
        want = np.array(
            [losses["hyena"][i] for i, r in enumerate(rows) if r["window_id"] == p.window_id]
        )
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_decode_pieces_keeps_multibyte_characters_whole(bpe_tokenizer):
    from pipeline.report import decode_pieces

    text = "naïve café → 数据 ok"
    ids = bpe_tokenizer.encode(text).ids
    pieces = decode_pieces(bpe_tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_report_skips_when_up_to_date_and_reruns_identically(text_run, capsys):
    from pipeline.report import ReportConfig, run_report

    run, _, _ = text_run
    out = run / "report"
    run_report(ReportConfig(run=str(run), bootstrap=50))
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "meta.json"}
    mtime = (out / "report.html").stat().st_mtime_ns
    capsys.readouterr()
    with printing_summaries():
        run_report(ReportConfig(run=str(run), bootstrap=50))
    assert "up to date" in capsys.readouterr().out
    assert (out / "report.html").stat().st_mtime_ns == mtime
    run_report(ReportConfig(run=str(run), bootstrap=50, overwrite=True))
    second = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "meta.json"}
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], name  # deterministic, PNGs included
    # other settings: refused, naming them, until --overwrite
    with pytest.raises(ArSliceError, match="settings.seed: 0 -> 1"):
        run_report(ReportConfig(run=str(run), bootstrap=50, seed=1))
    run_report(ReportConfig(run=str(run), bootstrap=50, seed=1, overwrite=True))
    assert (out / "table1.csv").read_bytes() != first["table1.csv"]


def test_report_reference_choice_with_a_quoted_name(tiny_run, capsys):  # noqa: F811
    from pipeline.report import ReportConfig, run_report

    meta = run_report(ReportConfig(run=str(tiny_run), reference=QUOTED, bootstrap=0))
    assert capsys.readouterr() == ("", "")  # called from Python, a stage prints nothing
    assert meta["reference"] == QUOTED
    t1 = {r["model"]: r for r in read_csv(tiny_run / "report" / "table1.csv")}
    assert list(t1)[0] == QUOTED
    assert float(t1["attention"]["delta_all"]) == pytest.approx(-0.5)
    assert float(t1["hyena"]["ar_share"]) == pytest.approx((3.0 - 1.5) / (32 - 37.5))
    assert "ppl_all_lo" not in t1["hyena"]  # no bootstrap, no intervals

    meta = run_report(ReportConfig(run=str(tiny_run), bootstrap=0, overwrite=True))
    assert meta["reference"] == "attention"  # the default: the attention model
    t1 = {r["model"]: r for r in read_csv(tiny_run / "report" / "table1.csv")}
    assert float(t1["hyena"]["ar_share"]) == pytest.approx(1.5)  # 150%
    assert "150.0%" in (tiny_run / "report" / "report.md").read_text()


def test_report_refuses_an_unknown_reference(tiny_run, capsys):  # noqa: F811
    from pipeline.cli import main

    assert main(["report", "--run", str(tiny_run), "--reference", "gpt-7"]) == 2
    err = capsys.readouterr().err
    assert "gpt-7" in err and "attention" in err and "Traceback" not in err


def test_default_reference():
    from ar_slicing.analysis.results import default_reference

    assert (
        default_reference(
            [("b-hyena", None, "hyena"), ("a", None, "rwkv"), ("c", None, "attention")]
        )
        == "c"
    )
    assert (
        default_reference([("h", "h", "HyenaLM"), ("p", "pythia-70m", "GPTNeoXForCausalLM")]) == "p"
    )
    assert default_reference([("z", None, "hyena"), ("y", None, "rwkv")]) == "y"


def test_report_of_a_single_model(tiny_run, capsys):  # noqa: F811
    """No gap to explain: Table 1 has the reference only, passages fall back to the most AR hits."""
    import shutil

    from pipeline.report import ReportConfig, run_report

    shutil.rmtree(tiny_run / "losses" / "attention")
    shutil.rmtree(tiny_run / "losses" / QUOTED)
    meta = run_report(ReportConfig(run=str(tiny_run), bootstrap=100, passages=3))
    assert meta["reference"] == "hyena" and meta["counts"]["passages"] == 2
    t1 = read_csv(tiny_run / "report" / "table1.csv")
    assert [r["model"] for r in t1] == ["hyena"]
    assert float(t1[0]["ppl_ar"]) == pytest.approx(math.exp(3.0))
    assert read_csv(tiny_run / "report" / "examples.csv") == []
    facts = HtmlFacts()
    facts.feed((tiny_run / "report" / "report.html").read_text())
    assert facts.passages == [0, 1]  # window 0 has 2 AR hits, window 1 has 1


def test_report_names_models_left_out_or_on_fewer_windows(tiny_run, capsys):  # noqa: F811
    """An interrupted evaluation is left out and a partial one restricts every number: the
    console and report.md both name the models concerned."""
    from ar_slicing.machinery.io import read_json, write_json_atomic
    from pipeline.report import ReportConfig, run_report
    from tests.queries.test_queries import make_partial

    make_partial(tiny_run, "hyena", 1)
    meta_path = tiny_run / "losses" / QUOTED / "meta.json"
    plan = {"stage": "eval", "settings": {}, "inputs": {}}
    write_json_atomic(meta_path.with_name(".plan.json"), plan)
    meta_path.unlink()  # interrupted: its finished chunks stay, meta.json is never written
    assert read_json(meta_path.with_name(".plan.json")) == plan
    with printing_summaries():
        meta = run_report(ReportConfig(run=str(tiny_run), bootstrap=0))
    printed = capsys.readouterr().out
    md = (tiny_run / "report" / "report.md").read_text()
    for text in (printed, md):
        assert "hyena (1 window)" in text and "windows 0..0" in text
        assert f"losses/{QUOTED} is left out: incomplete (no meta.json)" in text
    assert meta["counts"]["models"] == 2 and meta["skipped"] == {f"losses/{QUOTED}": 1}


@pytest.mark.parametrize("n_models", [4, 5])
def test_every_panel_of_figure_1_shows_its_tick_labels(monkeypatch, n_models):
    """With four or five models in a 2 x 3 grid, the first panels sit above an empty slot: a
    shared x axis would hide their tick labels, so each panel labels its own."""
    from pipeline.report import figures

    shown = []
    monkeypatch.setattr(figures, "_png", lambda fig: shown.append(fig) or b"")
    columns = ["model", "bucket", "is_repeat", "mean_nll"]
    rows = [
        (f"m{i}", bucket, repeat, 5.0 - bucket)
        for i in range(n_models)
        for bucket in (0, 1, 2, 3)
        for repeat in (True, False)
    ]
    figures.frequency_curve_png(columns, rows, reference="m0")
    (fig,) = shown
    fig.canvas.draw()
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == n_models
    for ax in panels:
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_visible()]
        assert labels[:3] == ["0", "1", "10"], (ax.get_title(), labels)
