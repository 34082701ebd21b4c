"""Runs of one recipe (docs/design.md, "Runs of one recipe"): models named `<recipe>-seed<n>`
group with `<recipe>`; the report gives the spread across the runs point by point (seeds.csv,
its section) and the figures draw it as a band; results.duckdb names the recipe in SQL as the
Python rule does."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import duckdb
import numpy as np
import pytest

from ar_slicing.analysis.seeds import MACROS_SQL, recipe_of, recipes, seed_of, spread_rows
from pipeline.runner.run import RunConfig, run_pipeline
from tests.conftest import small_pipeline_config

torch = pytest.importorskip("torch")

NAMES = ["pythia-160m", "pythia-160m-seed1", "pythia-160m-seed12", "pythia-160m-data-seed3",
         "seed7", "a-seed", "x-seedling", "mamba2-seed0", "attention@step2"]  # fmt: skip


def test_the_sql_macros_and_the_python_rule_agree_on_every_name():
    con = duckdb.connect()
    for statement in MACROS_SQL:
        con.execute(statement)
    got = con.execute(
        "SELECT m, recipe_of(m), seed_of(m) FROM unnest($names) AS t(m)", {"names": NAMES}
    ).fetchall()
    assert got == [(n, recipe_of(n), seed_of(n)) for n in NAMES]
    assert [recipe_of(n) for n in NAMES[:4]] == ["pythia-160m"] * 3 + ["pythia-160m-data"]
    assert [seed_of(n) for n in NAMES[:3]] == [None, 1, 12]
    assert recipe_of("seed7") == "seed7" and recipe_of("x-seedling") == "x-seedling"
    assert recipes(["h", "t-seed2", "t", "h", "t-seed1"]) == {
        "h": ["h"],
        "t": ["t-seed2", "t", "t-seed1"],
    }


def test_the_spread_is_the_runs_mean_least_and_greatest_at_each_step():
    rows = [
        {"model": "t", "step": 2, "tokens_seen": 8, "g": 0.5, "h": math.nan},
        {"model": "t-seed1", "step": 2, "tokens_seen": 8, "g": -0.25, "h": 1.0},
        {"model": "t-seed2", "step": 2, "tokens_seen": 8, "g": 2.0, "h": math.nan},
        {"model": "t", "step": 4, "tokens_seen": 16, "g": 1.0, "h": math.nan},
        {"model": "t-seed2", "step": None, "tokens_seen": None, "g": 9.0, "h": 9.0},
        {"model": "u", "step": 2, "tokens_seen": 8, "g": 3.0, "h": 3.0},
    ]
    out = spread_rows(rows, ("g", "h"))
    assert [(r["recipe"], r["step"], r["runs"], r["models"]) for r in out] == [
        ("t", 2, 3, "t,t-seed1,t-seed2"),
        ("t", 4, 1, "t"),
    ]
    first = out[0]
    assert (first["g"], first["g_min"], first["g_max"]) == (0.75, -0.25, 2.0)
    assert (first["h"], first["h_min"], first["h_max"]) == (1.0, 1.0, 1.0)  # the runs with one
    assert math.isnan(out[1]["h"]) and out[1]["tokens_seen"] == 16


def test_a_band_spans_the_runs_where_two_or_more_share_a_point():
    from pipeline.plotting import pyplot
    from pipeline.report.figures import _runs

    plt = pyplot()
    fig, ax = plt.subplots()
    runs = {"a": [(1, 0.1), (2, 0.2), (3, 0.0)], "b": [(1, 0.3), (2, 0.5)], "c": [(2, 0.4)]}
    _runs(ax, runs, "C0", "t")
    assert len(ax.lines) == 3
    (band,) = ax.collections
    xy = band.get_paths()[0].vertices
    for x, lo, hi in ((1, 0.1, 0.3), (2, 0.2, 0.5)):
        ys = xy[np.isclose(xy[:, 0], x), 1]
        assert ys.min() == pytest.approx(lo) and ys.max() == pytest.approx(hi)
    assert xy[:, 0].max() == pytest.approx(2)  # step 3 has one run: no band there
    fig2, ax2 = plt.subplots()
    _runs(ax2, {"a": runs["a"]}, "C0", "a")
    assert len(ax2.lines) == 1 and not ax2.collections
    plt.close(fig)
    plt.close(fig2)


@pytest.fixture(scope="module")
def seeded_run(tmp_path_factory, one_torch_thread):
    """The small pipeline with attention trained from seeds 0 and 1 (`attention`,
    `attention-seed1`) beside BaseConv, each keeping step 2, checkpoints evaluated and probed."""
    root = tmp_path_factory.mktemp("seeds")
    text = small_pipeline_config(root, train="keep_checkpoints = [2]", eval='checkpoints = "all"')
    text = text.replace(
        "[train.models.base_conv]", '[train.models.attention-seed1]\narch = "attention"\n'
        "seed = 1\n\n[train.models.base_conv]"
    )  # fmt: skip
    text += "\n[probe]\ninduction_length = 8\ninduction_sequences = 6\nrecall_pairs = [1, 2]\n"
    text += "recall_queries = 6\nbootstrap = 0\n"
    config = root / "small.toml"
    config.write_text(text)
    run_pipeline(RunConfig(config=str(config)))
    return root / "run"


def _csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_report_gives_the_spread_of_the_emergence_and_the_probes(seeded_run):
    report = seeded_run / "report"
    points = _csv(report / "emergence.csv")
    probes = _csv(report / "probes.csv")
    seeds = _csv(report / "seeds.csv")
    assert [(r["recipe"], r["step"], r["runs"]) for r in seeds] == [
        ("attention", "2", "2"),
        ("attention", "3", "2"),
    ]  # base_conv is one run: no row
    for row in seeds:
        at = [p for p in points if p["model"] in ("attention", "attention-seed1")
              and p["step"] == row["step"]]  # fmt: skip
        assert len(at) == 2 and row["models"] == "attention,attention-seed1"
        for key in ("recall_gain", "recall_gain_count0"):
            values = [float(p[key]) for p in at]
            assert float(row[key]) == pytest.approx(
                np.mean(values), rel=1e-9
            )  # (the CSVs hold 12 digits)
            assert float(row[f"{key}_min"]) == min(values)
            assert float(row[f"{key}_max"]) == max(values)
        mine = [p for p in probes if p["of_model"] in ("attention", "attention-seed1")
                and p["step"] == row["step"]]  # fmt: skip
        assert len(mine) == 2
        scores = [float(p["induction_score"]) for p in mine]
        assert float(row["induction_score"]) == pytest.approx(
            np.mean(scores), rel=1e-9
        )  # (the CSVs hold 12 digits)
        assert float(row["induction_score_max"]) == max(scores)
    # the two seeds are other models: their points differ
    a, b = (
        [p["recall_gain"] for p in points if p["model"] == m]
        for m in ("attention", "attention-seed1")
    )
    assert a != b
    md = (report / "report.md").read_text()
    section = md.split("## Across seeds: the runs of one recipe")[1].split("\n## ")[0]
    assert "| attention | 2 | 2 |" in section and "base_conv" not in section
    assert "Across seeds" in (report / "report.html").read_text()
    con = duckdb.connect(str(seeded_run / "results.duckdb"), read_only=True)
    got = con.execute(
        "SELECT model, recipe_of(model), seed_of(model) FROM models ORDER BY model"
    ).fetchall()
    assert got == [("attention", "attention", None), ("attention-seed1", "attention", 1),
                   ("base_conv", "base_conv", None)]  # fmt: skip


def test_a_run_without_seeds_writes_no_spread(tmp_path):
    from pipeline.report.stage import _seeds

    points = [{"model": "a", "step": 2, "tokens_seen": 8, "recall_gain": 0.1,
               "recall_gain_count0": 0.0}]  # fmt: skip
    assert _seeds(tmp_path, points, []) is None
    assert not (tmp_path / "seeds.csv").exists()
