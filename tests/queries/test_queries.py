"""queries/*.sql and `arslice query` on a run built by hand (tags and losses written here).

The tiny run is docs/design.md's worked example plus a second document, window length 8:

  stream   5 6 7 8 5 6 9 5 6 | 0 | 7 8 7 8 3 | 0        (0 is the tokenizer's EOS)
  window 0 targets pos 1..8: 6 7 8 5 6 9 5 6   repeats of (5,6) at pos 5, 8 (train count 10: AR hits)
  window 1 targets pos 1..7: 0 7 8 7 8 3 0     repeat of (7,8) at pos 5 (never seen in training: AR hit)

15 scored tokens, 3 AR hits. Losses: "attention" 2.0 everywhere; "hyena" +1 on the 3 AR hits and
-0.25 on 4 other tokens (gap +3 on AR, -1 elsewhere: AR share 3 / 2 = 150%); "rwkv 'v4'" (a quote
in its name) 2.5 everywhere (AR share 1.5 / 7.5 = 20%).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ar_slicing.algorithms.tags import tags_schema
from ar_slicing.data.store import write_token_store
from ar_slicing.data.tokenizer import describe
from ar_slicing.errors import ArSliceError, BadInput, TokenizerMismatch
from tests import REPO
from tests.ar_slicing.test_tags import naive_match_len, write_counts
from tests.handmade import write_handmade_meta

QUERIES = REPO / "queries"

TAG_SCHEMA = tags_schema()
LOSS_SCHEMA = pa.schema([("window_id", pa.int32()), ("pos", pa.int32()), ("nll", pa.float32())])


# ---- building a run by hand ----------------------------------------------------------------------


def naive_tags(stream, doc_of, subsets, counts, window, threshold=1250):
    """Tag rows of docs/design.md's definitions, written as plainly as possible (a reference, not fast)."""
    rows, windows = [], []
    n = len(stream)
    match_len = naive_match_len([int(t) for t in stream], doc_of, window, False)
    w = 0
    while w * window < n - 1:
        start = w * window
        n_targets = min(window, n - 1 - start)
        windows.append((w, start, n_targets))
        seen = {}
        for pos in range(1, n_targets + 1):
            i = start + pos
            bigram = (int(stream[i - 1]), int(stream[i]))
            prev_pos = seen.get(bigram)
            c = counts.get(bigram, 0)
            rows.append(
                {
                    "window_id": w,
                    "pos": pos,
                    "doc_id": doc_of[i],
                    "token": bigram[1],
                    "prev": bigram[0],
                    "train_count": c,
                    "prev_pos": prev_pos,
                    "is_repeat": prev_pos is not None,
                    "is_ar_hit": prev_pos is not None and c <= threshold,
                    "subset": subsets[doc_of[i]],
                    "match_len": match_len[i - 1],
                    "span_train_count": c if prev_pos is not None else None,
                }
            )
            seen[bigram] = pos
        w += 1
    return rows, windows


def write_run(
    run: Path,
    documents,
    subsets,
    counts: dict,
    window: int,
    losses: dict[str, list[float]],
    tokenizer,
    tokenizer_json: str | None = None,
    architectures: dict[str, str] | None = None,
    shard_rows: int = 1_000_000,
    loss_meta: dict[str, dict] | None = None,
):
    """A run directory with a real token store, counts, tags and per-model losses; returns tag rows."""
    info = describe(tokenizer, "test-bpe")
    store = write_token_store(
        run / "tokens" / "val",
        documents,
        tokenizer_info=info,
        subsets=subsets,
        tokenizer_json=tokenizer_json,
    )
    stream = np.asarray(store.tokens)
    doc_rows = store.doc_index_of(np.arange(len(stream)))
    doc_of = [int(store.doc_ids[r]) for r in doc_rows]

    counts_dir = write_counts(run / "counts", Counter(counts), info["fingerprint"])

    rows, windows = naive_tags(stream, doc_of, subsets, counts, window)
    tags = run / "tags"
    tags.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "window_id": pa.array([w[0] for w in windows], pa.int32()),
                "start": pa.array([w[1] for w in windows], pa.int64()),
                "n_targets": pa.array([w[2] for w in windows], pa.int32()),
            }
        ),
        tags / "windows.parquet",
    )
    for k, lo in enumerate(range(0, len(rows), shard_rows)):
        pq.write_table(
            pa.Table.from_pylist(rows[lo : lo + shard_rows], TAG_SCHEMA),
            tags / f"tags-{k:05d}.parquet",
        )
    write_handmade_meta(
        tags,
        "tag",
        counts={"tokens": len(rows)},
        tokens=str(store.path.resolve()),
        counts_dir=str(counts_dir.resolve()),
        fingerprint=info["fingerprint"],
        window=window,
        threshold=1250,
        reset_at_doc_boundary=False,
        span_order=1,  # span_train_count = the bigram's count
    )
    for name, nll in losses.items():
        out = run / "losses" / name
        out.mkdir(parents=True)
        assert len(nll) == len(rows)
        # Shuffled row order: the contract keys losses by (window_id, pos), not by position.
        order = np.random.default_rng(len(name)).permutation(len(rows))
        pq.write_table(
            pa.table(
                {
                    "window_id": pa.array([rows[i]["window_id"] for i in order], pa.int32()),
                    "pos": pa.array([rows[i]["pos"] for i in order], pa.int32()),
                    "nll": pa.array([nll[i] for i in order], pa.float32()),
                }
            ),
            out / "losses-00000.parquet",
        )
        arch = (architectures or {}).get(name, name)
        write_handmade_meta(
            out,
            "eval",
            name=name,
            spec=f"native:{name}",
            architecture=arch,
            n_params=1000 * (1 + len(name)),
            dtype="float32",
            device="cpu",
            batch_size=4,
            tokens=len(rows),
            tokens_per_s=100.0,
            fingerprint=info["fingerprint"],
            windowing="fixed",
            **(loss_meta or {}).get(name, {}),
        )
    # what `arslice run` writes once every model is evaluated: a file, not a model folder
    write_handmade_meta(run / "losses", "eval-all")
    return rows


TINY_DOCS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [7, 8, 7, 8, 3]]
TINY_SUBSETS = ["Github", "ArXiv"]
TINY_COUNTS = {
    (5, 6): 10,
    (6, 7): 5,
    (8, 5): 150,
    (6, 9): 1,
    (9, 5): 20000,
    (6, 0): 3,
    (0, 7): 1250,
    (8, 7): 99,
    (8, 3): 100,
    (3, 0): 1000,
}  # (7, 8) never occurs in training
QUOTED = "rwkv 'v4'"
# (window, pos) of the AR hits and of the 4 other tokens where hyena is 0.25 better.
TINY_AR = {(0, 5), (0, 8), (1, 5)}
HYENA_BETTER = {(0, 2), (0, 4), (1, 2), (1, 7)}


def tiny_losses(rows):
    keys = [(r["window_id"], r["pos"]) for r in rows]
    return {
        "attention": [2.0] * len(keys),
        "hyena": [3.0 if k in TINY_AR else 1.75 if k in HYENA_BETTER else 2.0 for k in keys],
        QUOTED: [2.5] * len(keys),
    }


@pytest.fixture
def tiny_run(tmp_path, bpe_tokenizer_path):
    return build_tiny_run(tmp_path / "run", bpe_tokenizer_path)


def build_tiny_run(run: Path, tokenizer_path: Path) -> Path:
    """The tiny run (module docstring) in `run`, with the tokenizer at `tokenizer_path`."""
    from tokenizers import Tokenizer

    bpe_tokenizer = Tokenizer.from_file(str(tokenizer_path))
    assert bpe_tokenizer.token_to_id("<|endoftext|>") == 0
    rows, _ = naive_tags(  # the tags only, to derive the losses from
        [5, 6, 7, 8, 5, 6, 9, 5, 6, 0, 7, 8, 7, 8, 3, 0],
        [0] * 10 + [1] * 6,
        TINY_SUBSETS,
        TINY_COUNTS,
        8,
    )
    write_run(
        run,
        TINY_DOCS,
        TINY_SUBSETS,
        TINY_COUNTS,
        8,
        tiny_losses(rows),
        bpe_tokenizer,
        tokenizer_json=tokenizer_path.read_text(),
        architectures={"attention": "attention", "hyena": "hyena", QUOTED: "rwkv"},
    )
    return run


def run_sql(run: Path, name: str, params=None, cwd: Path | None = None):
    """Run queries/NAME.sql unchanged with Python's duckdb; rows as dicts."""
    from ar_slicing.analysis.results import ensure_results

    ensure_results(run)
    old = os.getcwd()
    os.chdir(cwd or Path("/"))  # the database must not depend on the working directory
    try:
        con = duckdb.connect(str(run / "results.duckdb"), read_only=True)
        cur = con.execute((QUERIES / f"{name}.sql").read_text(), params or {})
        cols = [d[0] for d in cur.description]
        out = [dict(zip(cols, r)) for r in cur.fetchall()]
        con.close()
    finally:
        os.chdir(old)
    return out


# ---- the tags themselves match docs/design.md's worked example -----------------------------------------


def test_tiny_run_tags_follow_the_worked_example(tiny_run):
    from ar_slicing.analysis.results import ensure_results

    ensure_results(tiny_run)
    con = duckdb.connect(str(tiny_run / "results.duckdb"), read_only=True)
    repeats = con.execute(
        "SELECT window_id, pos, prev_pos, is_ar_hit FROM tags WHERE is_repeat ORDER BY ALL"
    ).fetchall()
    assert repeats == [(0, 5, 1, True), (0, 8, 5, True), (1, 5, 3, True)]
    assert con.execute("SELECT count(*) FROM tags").fetchone()[0] == 15
    assert con.execute("SELECT * FROM windows ORDER BY window_id").fetchall() == [
        (0, 0, 8),
        (1, 8, 7),
    ]
    assert con.execute("SELECT count(*) FROM token_losses").fetchone()[0] == 45
    models = con.execute(
        "SELECT model, architecture, n_params FROM models ORDER BY model"
    ).fetchall()
    assert [m[0] for m in models] == ["attention", "hyena", QUOTED]
    assert (
        con.execute("SELECT count FROM counts WHERE prev = 9 AND next = 5").fetchone()[0] == 20000
    )
    info = dict(con.execute("SELECT key, value FROM run_info").fetchall())
    assert info["default_reference"] == "attention"
    assert info["run_dir"] == str(tiny_run.resolve())


# ---- every query against values computed by hand -------------------------------------------------


def test_slice_perplexity_by_hand(tiny_run):
    got = {r["model"]: r for r in run_sql(tiny_run, "slice_perplexity")}
    assert list(got) == ["attention", "hyena", QUOTED]
    # model: (mean all, mean AR, mean other)
    expected = {
        "attention": (2.0, 2.0, 2.0),
        "hyena": ((15 * 2.0 + 3 * 1.0 - 4 * 0.25) / 15, 3.0, (12 * 2.0 - 4 * 0.25) / 12),
        QUOTED: (2.5, 2.5, 2.5),
    }
    for model, (m_all, m_ar, m_other) in expected.items():
        r = got[model]
        assert (r["n_tokens"], r["n_ar_hits"]) == (15, 3)
        assert r["pct_ar_hits"] == pytest.approx(20.0)
        assert r["mean_nll_all"] == pytest.approx(m_all)
        assert r["mean_nll_ar"] == pytest.approx(m_ar)
        assert r["mean_nll_other"] == pytest.approx(m_other)
        assert r["ppl_all"] == pytest.approx(math.exp(m_all))
        assert r["ppl_ar"] == pytest.approx(math.exp(m_ar))
        assert r["ppl_other"] == pytest.approx(math.exp(m_other))
    assert got["hyena"]["architecture"] == "hyena"


def test_gap_vs_reference_by_hand_including_share_over_100_percent(tiny_run):
    got = {r["model"]: r for r in run_sql(tiny_run, "gap_vs_reference", {"reference": "attention"})}
    hy = got["hyena"]
    assert hy["reference"] == "attention"
    assert hy["delta_log_ppl_all"] == pytest.approx(2 / 15)
    assert hy["delta_log_ppl_ar"] == pytest.approx(1.0)
    assert hy["delta_log_ppl_other"] == pytest.approx(-1 / 12)
    assert hy["delta_ppl_ar"] == pytest.approx(math.exp(3.0) - math.exp(2.0))
    assert hy["ar_share_of_gap"] == pytest.approx(1.5)  # 150%: AR explains more than the whole gap
    assert got[QUOTED]["ar_share_of_gap"] == pytest.approx(0.2)
    assert got[QUOTED]["delta_ppl_all"] == pytest.approx(math.exp(2.5) - math.exp(2.0))
    assert got["attention"]["delta_log_ppl_all"] == 0
    assert got["attention"]["ar_share_of_gap"] is None  # 0 / 0


def test_gap_parameter_is_bound_not_formatted(tiny_run):
    """A reference name holding a quote works; one that smuggles SQL matches nothing."""
    got = {r["model"]: r for r in run_sql(tiny_run, "gap_vs_reference", {"reference": QUOTED})}
    assert got["attention"]["delta_log_ppl_all"] == pytest.approx(-0.5)
    assert got["hyena"]["ar_share_of_gap"] == pytest.approx((3.0 - 1.5) / (32 - 37.5))
    assert run_sql(tiny_run, "gap_vs_reference", {"reference": "x' OR '1'='1"}) == []


def test_frequency_curve_by_hand(tiny_run):
    got = run_sql(tiny_run, "frequency_curve")
    # bucket of every target's training count, written out: 0 | 1-9 | 10-99 | 100-999 | 1000-9999 | 10^4-
    bucket = {0: 0, 1: 1, 3: 1, 5: 1, 10: 2, 99: 2, 100: 3, 150: 3, 1000: 4, 1250: 4, 20000: 5}
    labels = {0: "0", 1: "1-9", 2: "10-99", 3: "100-999", 4: "1000-9999", 5: "10000-99999"}
    rows, _ = naive_tags(
        [5, 6, 7, 8, 5, 6, 9, 5, 6, 0, 7, 8, 7, 8, 3, 0],
        [0] * 10 + [1] * 6,
        TINY_SUBSETS,
        TINY_COUNTS,
        8,
    )
    losses = tiny_losses(rows)
    expected = {}
    for model, nll in losses.items():
        groups: dict = {}
        for r, x in zip(rows, nll):
            groups.setdefault((bucket[r["train_count"]], r["is_repeat"]), []).append(x)
        for (b, rep), xs in groups.items():
            expected[(model, b, rep)] = (len(xs), sum(xs) / len(xs))
    assert len(got) == len(expected)
    for r in got:
        n, mean = expected[(r["model"], r["bucket"], r["is_repeat"])]
        assert r["n_tokens"] == n
        assert r["mean_nll"] == pytest.approx(mean)
        assert r["ppl"] == pytest.approx(math.exp(mean))
        assert r["bucket_label"] == labels[r["bucket"]]
    # the repeats: (5,6) twice with count 10 and (7,8) once with count 0
    hy = {(r["bucket"]): r["n_tokens"] for r in got if r["model"] == "hyena" and r["is_repeat"]}
    assert hy == {0: 1, 2: 2}
    assert [r["count_lo"] for r in got if r["model"] == "hyena" and not r["is_repeat"]] == [
        0,
        1,
        10,
        100,
        1000,
        10000,
    ]


def test_by_subset_by_hand(tiny_run):
    got = {(r["model"], r["subset"]): r for r in run_sql(tiny_run, "by_subset")}
    # Github: window 0 (8 targets) + window 1 pos 1 (the EOS ending doc 0); ArXiv: window 1 pos 2..7.
    gh, ax = got[("hyena", "Github")], got[("hyena", "ArXiv")]
    assert (gh["n_tokens"], gh["n_ar_hits"]) == (9, 2)
    assert (ax["n_tokens"], ax["n_ar_hits"]) == (6, 1)
    # hyena on Github: AR (0,5),(0,8) = 3.0; better (0,2),(0,4) = 1.75; 5 others at 2.0
    assert gh["mean_nll_all"] == pytest.approx((2 * 3.0 + 2 * 1.75 + 5 * 2.0) / 9)
    assert gh["mean_nll_other"] == pytest.approx((2 * 1.75 + 5 * 2.0) / 7)
    assert ax["mean_nll_ar"] == pytest.approx(3.0)
    assert ax["pct_ar_hits"] == pytest.approx(100 / 6)
    assert got[(QUOTED, "ArXiv")]["ppl_all"] == pytest.approx(math.exp(2.5))


def test_examples_by_hand(tiny_run):
    got = run_sql(tiny_run, "examples", {"reference": "attention", "limit": 10})
    hy = [
        (r["window_id"], r["n_ar_hits"], r["excess_nll_ar"]) for r in got if r["model"] == "hyena"
    ]
    assert hy == [(0, 2, pytest.approx(2.0)), (1, 1, pytest.approx(1.0))]
    assert {r["model"] for r in got} == {"hyena", QUOTED}  # never the reference itself
    first = next(r for r in got if r["model"] == "hyena")
    assert (first["start"], first["n_targets"]) == (0, 8)
    assert first["mean_nll_ar"] == pytest.approx(3.0)
    assert first["reference_mean_nll_ar"] == pytest.approx(2.0)
    limited = run_sql(tiny_run, "examples", {"reference": "attention", "limit": "1"})
    assert [(r["model"], r["window_id"]) for r in limited] == [("hyena", 0), (QUOTED, 0)]


def test_every_query_file_runs_and_is_tested():
    names = sorted(p.stem for p in QUERIES.glob("*.sql"))
    assert names == [
        "by_subset",
        "copy_length",  # tests/ar_slicing/test_copy_length.py
        "examples",
        "frequency_curve",
        "gap_vs_reference",
        "probe_position",  # tests/queries/test_probe_queries.py
        "probe_recall",  # tests/queries/test_probe_queries.py
        "probe_scores",  # tests/queries/test_probe_queries.py
        "recall_emergence",  # tests/ar_slicing/test_emergence.py
        "recall_gain",  # tests/queries/test_recall_gain.py
        "slice_perplexity",
    ]


# ---- results.duckdb --------------------------------------------------------------------------------


def test_results_db_works_from_another_cwd_and_follows_a_moved_run(tiny_run, tmp_path):
    from ar_slicing.analysis.results import ensure_results

    _, built = ensure_results(tiny_run)
    assert built
    _, built = ensure_results(tiny_run)
    assert not built  # up to date: reused
    before = run_sql(tiny_run, "slice_perplexity", cwd=tmp_path)
    moved = tmp_path / "elsewhere" / "run-moved"
    moved.parent.mkdir()
    tiny_run.rename(moved)
    # tags/meta.json names the store and counts by their old absolute paths: the run layout finds them
    checked, built = ensure_results(moved)
    assert built
    assert checked.counts_dir == moved.resolve() / "counts"
    assert checked.tokens_dir == moved.resolve() / "tokens" / "val"
    assert run_sql(moved, "slice_perplexity", cwd=tmp_path) == before
    con = duckdb.connect(str(moved / "results.duckdb"), read_only=True)
    assert con.execute("SELECT sum(count) FROM counts").fetchone()[0] == sum(TINY_COUNTS.values())


def test_results_db_is_rebuilt_when_an_input_is_redone_or_grows(tiny_run, caplog):
    """results.duckdb's plan: a losses folder redone under another plan, or given another part,
    is another input; a file that recorded no plan (an older version's) is rebuilt too."""
    from ar_slicing.analysis.results import ensure_results, recorded_plan, results_plan
    from ar_slicing.machinery.io import read_json, write_json_atomic

    checked, built = ensure_results(tiny_run)
    db = tiny_run / "results.duckdb"
    assert built and recorded_plan(db) == results_plan(checked)
    hyena = tiny_run / "losses" / "hyena"
    meta = read_json(hyena / "meta.json")
    write_json_atomic(hyena / "meta.json", {**meta, "plan": {"stage": "eval", "settings": {}}})
    with caplog.at_level("INFO", logger="ar_slicing.analysis.results"):
        _, built = ensure_results(tiny_run)
    assert built and f"{db} is out of date with the run's inputs; rebuilding it" in caplog.text
    assert "inputs.losses.hyena.identity" in caplog.text
    _, built = ensure_results(tiny_run)
    assert not built

    part = pq.read_table(hyena / "losses-00000.parquet")  # the same rows in two parts
    pq.write_table(part.slice(0, 5), hyena / "losses-00000.parquet")
    pq.write_table(part.slice(5), hyena / "losses-00001.parquet")
    _, built = ensure_results(tiny_run)
    assert built
    assert run_sql(tiny_run, "gap_vs_reference", {"reference": "attention"})[1]["n_tokens"] == 15

    con = duckdb.connect(str(db))
    con.execute("DELETE FROM run_info WHERE key = 'plan'")
    con.close()
    _, built = ensure_results(tiny_run)
    assert built and recorded_plan(db) is not None


def test_mismatched_losses_are_refused(tiny_run):
    from ar_slicing.analysis.results import ensure_results

    shard = tiny_run / "losses" / "hyena" / "losses-00000.parquet"
    t = pq.read_table(shard)
    pq.write_table(t.slice(0, 10), shard)
    with pytest.raises(BadInput, match=r"losses .*hyena.*10 rows.*15"):
        ensure_results(tiny_run)


def test_losses_of_another_tokenizer_are_refused(tiny_run):
    from ar_slicing.analysis.results import ensure_results
    from ar_slicing.machinery.io import read_json, write_json_atomic

    meta_path = tiny_run / "losses" / "hyena" / "meta.json"
    meta = read_json(meta_path)
    meta["fingerprint"] = "0" * 64
    write_json_atomic(meta_path, meta)
    with pytest.raises(TokenizerMismatch, match="hyena"):
        ensure_results(tiny_run)


def test_incomplete_losses_are_skipped(tiny_run):
    from ar_slicing.analysis.results import ensure_results

    (tiny_run / "losses" / "hyena" / "meta.json").unlink()
    checked, _ = ensure_results(tiny_run)
    assert list(checked.models) == ["attention", QUOTED]
    assert "hyena" in checked.skipped_losses


def make_partial(run: Path, model: str, windows: int) -> None:
    """Make `model`'s losses those of `arslice eval --max-windows WINDOWS`."""
    from ar_slicing.machinery.io import read_json, write_json_atomic

    shard = run / "losses" / model / "losses-00000.parquet"
    t = pq.read_table(shard)
    pq.write_table(t.filter(pa.compute.less(t["window_id"], windows)), shard)
    meta_path = shard.parent / "meta.json"
    meta = read_json(meta_path)
    write_json_atomic(meta_path, {**meta, "partial": True, "windows_evaluated": windows})


def test_partial_losses_restrict_every_view_to_common_windows(tiny_run):
    """A model evaluated on window 0 only (`eval --max-windows 1`): all models compared on window 0."""
    make_partial(tiny_run, "hyena", 1)
    got = {r["model"]: r for r in run_sql(tiny_run, "gap_vs_reference", {"reference": "attention"})}
    assert got["hyena"]["n_tokens"] == 8
    # window 0: AR gap +2 (pos 5, 8), other gap -0.5 (pos 2, 4): share 2 / 1.5
    assert got["hyena"]["ar_share_of_gap"] == pytest.approx(2 / 1.5)


# ---- `arslice query` ---------------------------------------------------------------------------------


def arslice(*argv: str) -> int:
    from pipeline.cli import main

    return main(list(argv))


def test_cli_query_table_csv_json(tiny_run, capsys):
    assert arslice("query", "gap_vs_reference", "--run", str(tiny_run)) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["model", "reference", "n_tokens"]
    hyena = next(line for line in lines if line.startswith("hyena"))
    assert "1.5000" in hyena.split()  # the AR share, as a fraction
    assert any(line.startswith(QUOTED) for line in lines)

    assert arslice("query", "gap_vs_reference", "--run", str(tiny_run), "--format", "csv") == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["model"] for r in rows] == ["attention", "hyena", QUOTED]
    assert float(rows[1]["ar_share_of_gap"]) == pytest.approx(1.5)
    assert rows[0]["ar_share_of_gap"] == ""

    assert arslice("query", "gap_vs_reference", "--run", str(tiny_run), "--format", "json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data[2]["model"] == QUOTED and data[2]["ar_share_of_gap"] == pytest.approx(0.2)
    assert data[0]["ar_share_of_gap"] is None


def test_cli_query_binds_a_reference_with_a_quote(tiny_run, capsys):
    argv = ["query", "gap_vs_reference", "--run", str(tiny_run), "--param", f"reference={QUOTED}"]
    assert arslice(*argv, "--format", "json") == 0
    data = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert data["attention"]["reference"] == QUOTED
    assert data["attention"]["delta_log_ppl_all"] == pytest.approx(-0.5)


def test_cli_query_repeated_params(tiny_run, capsys):
    argv = ["query", "examples", "--run", str(tiny_run), "--format", "json"]
    assert arslice(*argv, "--param", f"reference={QUOTED}", "--param", "limit=1") == 0
    data = json.loads(capsys.readouterr().out)
    # both flags count: rwkv as the reference (so it is left out) and one window per model; against
    # rwkv (2.5) attention gains 0.5 per AR hit, so its "worst" window is the one with fewer hits
    assert [(r["model"], r["window_id"]) for r in data] == [("attention", 1), ("hyena", 0)]
    assert data[0]["excess_nll_ar"] == pytest.approx(-0.5)
    # default limit (10) and the run's default reference (attention)
    assert arslice("query", "examples", "--run", str(tiny_run), "--format", "json") == 0
    assert len(json.loads(capsys.readouterr().out)) == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["query", "nope", "--run", "RUN"], "no query 'nope'.*available: by_subset"),
        (["query", "slice_perplexity", "--run", "RUN", "--param", "x=1"], "has no parameter x"),
        (
            ["query", "gap_vs_reference", "--run", "RUN", "--param", "reference=gpt"],
            "not a model of this run",
        ),
        (["query", "examples", "--run", "RUN", "--param", "limit"], "expected NAME=VALUE"),
        (["query", "slice_perplexity", "--run", "/nonexistent/run"], "no such directory"),
    ],
)
def test_cli_query_errors_are_clear(tiny_run, capsys, argv, message):
    import re

    argv = [str(tiny_run) if a == "RUN" else a for a in argv]
    assert arslice(*argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_query_module_helpers():
    from ar_slicing.analysis.sql import load_query
    from pipeline.query import parse_params

    q = load_query("examples")
    assert q.required == {"reference", "limit"}
    assert q.defaults == {"limit": "10"}
    assert load_query("slice_perplexity").required == set()
    assert parse_params(["a=b=c", "reference=x y"]) == {"a": "b=c", "reference": "x y"}
    with pytest.raises(ArSliceError):
        parse_params(["=x"])


def test_naive_tags_agree_with_a_counter_reference():
    """The hand-built tags used here: repeats are exactly the bigrams seen earlier in the window."""
    rng = np.random.default_rng(3)
    stream = rng.integers(0, 6, size=200).tolist()
    rows, windows = naive_tags(stream, [0] * 200, ["x"], {}, 16)
    assert sum(w[2] for w in windows) == 199
    for w, start, n in windows:
        bigrams = [(stream[i - 1], stream[i]) for i in range(start + 1, start + n + 1)]
        mine = [r["is_repeat"] for r in rows if r["window_id"] == w]
        assert mine == [Counter(bigrams[:k])[b] > 0 for k, b in enumerate(bigrams)]
