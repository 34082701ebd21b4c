"""The probes in results.duckdb, queries/probe_*.sql and `open_run().probes()`, on the tiny run
(tests/queries/test_queries.py) with probes folders written by hand: docs/design.md's worked
examples of the induction score (n = 3, score 2.475) and of zero-shot recall (k = 2, accuracy
0.5, NLL 1.1), and the loss by position of the run's own losses."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from ar_slicing.analysis.api import open_run
from ar_slicing.analysis.probes import (
    icl_score,
    induction_curve,
    induction_score,
    induction_table,
    loss_by_position,
    recall_by_distance,
    recall_by_k,
    recall_table,
)
from ar_slicing.analysis.probes.sequences import InductionSequences, RecallSequences
from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import RunLayout
from ar_slicing.machinery.plan import identity
from pipeline.probe import token_losses
from tests.handmade import write_handmade_meta
from tests.queries.test_queries import QUOTED, run_sql, tiny_run  # noqa: F401  (a fixture)

V = 16  # the head's rows: the recall baselines are 1/16 and ln 16


def worked_induction(shift: float = 0.0):
    """docs/design.md's induction example: n = 3 after prefix 0, x = (7, 2, 9) and (4, 8, 5);
    every NLL raised by `shift` (a second model)."""
    tokens = np.array([[0, 7, 2, 9, 7, 2, 9], [0, 4, 8, 5, 4, 8, 5]])
    nll = np.array([[4.0, 3.0, 3.5, 3.2, 0.5, 0.1], [4.1, 2.0, 4.0, 3.0, 1.5, 0.5]]) + shift
    argmax = np.where(np.arange(6) >= 4, tokens[:, 1:], 1)  # right on pos 5, 6 only
    return induction_table(InductionSequences(tokens, 0, n=3), nll, argmax)


def worked_recall():
    """docs/design.md's recall example: k = 2, pairs 5 -> 8 and 3 -> 6, asked pair 2 then pair
    1; argmax 6 and 3 at the query values, NLL 0.2 and 2.0 there."""
    tokens = np.array([[0, 5, 8, 3, 6, 3, 6, 5, 8]])
    seqs = RecallSequences(tokens, 0, k=2, order=np.array([[1, 0]]))
    nll = np.array([[5.0, 5.0, 5.0, 5.0, 1.0, 0.2, 1.0, 2.0]])
    argmax = np.array([[1, 1, 1, 1, 1, 6, 1, 3]])
    return recall_table([(seqs, nll, argmax)])


def write_probes(
    run, name: str, checkpoint_of: str | None = None, step: int | None = None, shift=0.0
):
    """probes/<name>/ as `arslice probe` lays it out, from the tables above and the run's own
    losses of `name`, with the meta.json fields the results read."""
    layout = RunLayout(run)
    out = layout.probes(name)
    out.mkdir(parents=True)
    induction, recall = worked_induction(shift), worked_recall()
    per_token = token_losses(layout.tags, layout.losses(name))
    files = {
        "induction.parquet": induction,
        "induction_score.parquet": pl.DataFrame([induction_score(induction, 20, 0)]),
        "induction_curve.parquet": induction_curve(induction),
        "recall.parquet": recall,
        "recall_by_k.parquet": recall_by_k(recall, V, 20, 0),
        "recall_by_distance.parquet": recall_by_distance(recall),
        "position.parquet": loss_by_position(per_token),
        "icl.parquet": icl_score(per_token, 8, 20, 0),
    }
    for file, t in files.items():
        pq.write_table(t.to_arrow() if isinstance(t, pl.DataFrame) else t, out / file)
    along = {"checkpoint_of": checkpoint_of, "step": step} if checkpoint_of else {}
    write_handmade_meta(
        out,
        "probe",
        name=name,
        spec=f"native:{name}",
        prefix_token=0,
        head_rows=V,
        drawable_ids=V - 1,
        sequences_digest="s" * 64,
        plan={
            "stage": "probe",
            "settings": {},
            "inputs": {"losses": identity(layout.losses(name))},
        },
        **along,
    )


@pytest.fixture
def probed_run(tiny_run):  # noqa: F811
    write_probes(tiny_run, "attention")
    write_probes(tiny_run, "hyena", shift=1.0)
    return tiny_run


def test_probe_scores_give_the_worked_examples(probed_run):
    rows = {r["model"]: r for r in run_sql(probed_run, "probe_scores")}
    assert sorted(rows) == ["attention", "hyena"]
    att = rows["attention"]
    assert att["induction_score"] == pytest.approx(2.475)
    assert (att["first_nll"], att["second_nll"]) == pytest.approx((3.125, 0.65))
    assert 2.0 <= att["induction_score_lo"] <= att["induction_score_hi"] <= 2.95
    assert att["second_accuracy"] == 1.0
    assert att["recall_accuracy"] == pytest.approx(0.5)
    assert (att["max_k"], att["recall_accuracy_max_k"]) == (2, pytest.approx(0.5))
    # every NLL one higher: the same score (a difference), the first-copy loss one higher
    assert rows["hyena"]["induction_score"] == pytest.approx(2.475)
    assert rows["hyena"]["first_nll"] == pytest.approx(4.125)
    # window 8: the ICL positions are 1 and 2 (50/2048 and 500/2048 of it, rounded half up);
    # attention's losses are 2.0 everywhere, so its score is 0 on every slice holding both
    assert (att["icl_early"], att["icl_late"]) == (1, 2)
    assert att["icl_all"] == pytest.approx(0.0)


def test_probe_recall_by_k_with_its_baselines(probed_run):
    rows = run_sql(probed_run, "probe_recall", {"model": "*"})
    assert [(r["model"], r["k"]) for r in rows] == [("attention", 2), ("hyena", 2)]
    r = rows[0]
    assert (r["queries"], r["accuracy"], r["nll"]) == (2, 0.5, pytest.approx(1.1))
    assert r["pair_value_nll"] == pytest.approx(5.0)
    assert (r["chance_accuracy"], r["chance_nll"]) == (1 / V, pytest.approx(np.log(V)))
    assert (r["guess_accuracy"], r["guess_nll"]) == (0.5, pytest.approx(np.log(2)))
    only = run_sql(probed_run, "probe_recall", {"model": "hyena"})
    assert [x["model"] for x in only] == ["hyena"]
    by_distance = open_run(probed_run).probes("recall_by_distance")
    att = by_distance.filter(pl.col("model") == "attention").sort("distance")
    assert att["distance"].to_list() == [2, 6] and att["accuracy"].to_list() == [1.0, 0.0]


def test_probe_position_is_the_mean_loss_at_each_position(probed_run):
    rows = run_sql(probed_run, "probe_position", {"slice": "all"})
    hyena = {r["pos"]: r for r in rows if r["model"] == "hyena"}
    # by hand from the tiny run's losses (tests/queries/test_queries.py): pos 5 holds the AR
    # hits of both windows, the repeats of (5,6) and (7,8), each 2.0 + 1
    assert hyena[5]["tokens"] == 2
    assert hyena[5]["mean_nll"] == pytest.approx(3.0)
    default = open_run(probed_run).probes("position")  # (its documented default: all)
    assert default.to_dicts() == rows
    assert open_run(probed_run).probes("recall").height == 2  # (every model by default)
    ar = run_sql(probed_run, "probe_position", {"slice": "ar"})
    assert sum(r["tokens"] for r in ar if r["model"] == "hyena") == 3


def test_the_api_gives_the_probes(probed_run):
    run = open_run(probed_run)
    assert run.probed == ("attention", "hyena")
    scores = run.probes()
    assert scores["model"].to_list() == ["attention", "hyena"]
    assert scores["induction_score"].to_list() == pytest.approx([2.475, 2.475])
    curve = run.probes("induction_curve").filter(pl.col("model") == "attention")
    assert dict(zip(curve["pos"], curve["mean_nll"]))[5] == pytest.approx(1.0)
    assert run.probes("induction").height == 2 * 2 * 6
    assert run.probes("position", slice="other")["model"].unique().sort().to_list() == [
        "attention",
        "hyena",
    ]
    with pytest.raises(BadInput, match=r"probes\('nope'\): no such table; one of scores"):
        run.probes("nope")


def test_a_checkpoint_s_probes_carry_its_step(tiny_run, tmp_path):  # noqa: F811
    """Probes of losses since redone are left out; a run without probes has empty tables."""
    assert open_run(tiny_run).probes().is_empty()
    assert open_run(tiny_run).probes("recall").is_empty()
    write_probes(tiny_run, "attention", checkpoint_of="attention", step=7)
    rows = run_sql(tiny_run, "probe_scores")
    assert [(r["model"], r["of_model"], r["step"]) for r in rows] == [("attention", "attention", 7)]
    # the losses redone: the probes made from the old ones are no longer the run's
    meta = RunLayout(tiny_run).losses("attention") / "meta.json"
    meta.write_text(meta.read_text().replace('"stage"', '"redone": true, "stage"', 1))
    assert run_sql(tiny_run, "probe_scores") == []


def test_the_read_only_api_may_read_the_probes(probed_run):
    run = open_run(probed_run, read_only_files=True)
    assert run.probes()["model"].to_list() == ["attention", "hyena"]
    assert run.probes("recall_by_k").height == 2
