"""`arslice probe` as a stage (docs/design.md, "Probes of a checkpoint"): a small run of every
stage, with kept checkpoints and a hand-set GPT-2 that copies; every model and checkpoint the
eval stage evaluates is probed, on the same sequences, with the tables the probes' library gives
on the same model; the copier scores the maximum; reruns skip, other sizes are refused, and a
killed or failed run resumes at the part it had not finished."""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import LEDGER_NAME, PROBE_FILES
from pipeline.config import printing_summaries
from pipeline.probe import ProbeConfig, run_probe
from pipeline.runner.run import RunConfig, run_pipeline
from tests.conftest import small_pipeline_config

torch = pytest.importorskip("torch")

PROBE_TABLE = """
[probe]
induction_length = 8
induction_sequences = 12
recall_pairs = [1, 2, 4]
recall_queries = 12
bootstrap = 50
"""
MODELS = ["attention", "attention@step2", "base_conv", "base_conv@step2", "copier"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory, one_torch_thread):
    """The small pipeline run to its end: two trained models keeping step 2, their checkpoints
    evaluated, and a copying GPT-2 read in rolling windows after token 0 (its prefix)."""
    from tests.handset_models import copying_gpt2

    root = tmp_path_factory.mktemp("probe-run")
    copying_gpt2(400, n_positions=64, special=0).save_pretrained(root / "copier")
    text = small_pipeline_config(root, train="keep_checkpoints = [2]", eval='checkpoints = "all"')
    text += (
        f'\n[eval.models.copier]\nmodel = "hf:{root / "copier"}"\n'
        'windowing = "rolling"\nprefix_token = 0\ndtype = "fp32"\n'
    )
    config = root / "small.toml"
    config.write_text(text + PROBE_TABLE)
    run_pipeline(RunConfig(config=str(config)))
    return {"root": root, "run": root / "run", "config": config}


def table(run: Path, model: str, name: str) -> pl.DataFrame:
    return pl.read_parquet(run / "probes" / model / name)


def test_every_model_and_checkpoint_the_eval_stage_evaluates_is_probed(probed):
    run = probed["run"]
    assert sorted(p.name for p in (run / "probes").iterdir() if p.is_dir()) == MODELS
    marker = read_json(run / "probes/meta.json")["probes"]
    assert sorted(marker) == MODELS
    assert marker["attention@step2"]["checkpoint_of"] == "attention"
    assert marker["attention@step2"]["step"] == 2
    for model in MODELS:
        meta = read_json(run / "probes" / model / "meta.json")
        assert meta["name"] == model
        assert sorted(meta["files"]) == sorted(f for fs in PROBE_FILES.values() for f in fs)
        for name in meta["files"]:
            assert (run / "probes" / model / name).is_file()
        losses = read_json(run / "losses" / model / "meta.json")
        assert meta["spec"] == losses["spec"]
        assert meta.get("checkpoint_of") == losses.get("checkpoint_of")
        assert meta.get("step") == losses.get("step")
    # the fixed windows' models read no prefix; the copier's rolling windows read token 0 first
    assert read_json(run / "probes/attention/meta.json")["prefix_token"] is None
    assert read_json(run / "probes/copier/meta.json")["prefix_token"] == 0


def test_models_of_one_vocabulary_read_the_same_sequences(probed):
    run = probed["run"]
    fixed = [m for m in MODELS if m != "copier"]
    digests = {read_json(run / "probes" / m / "meta.json")["sequences_digest"] for m in fixed}
    assert len(digests) == 1
    first = table(run, fixed[0], "induction.parquet").select("seq_id", "pos", "token")
    recall = table(run, fixed[0], "recall.parquet").select("seq_id", "k", "pos", "token")
    for m in fixed[1:]:
        assert table(run, m, "induction.parquet").select("seq_id", "pos", "token").equals(first)
        assert table(run, m, "recall.parquet").select("seq_id", "k", "pos", "token").equals(recall)
    # the copier reads the same bodies after its prefix: the same drawn ids
    copier = table(run, "copier", "induction.parquet").filter(pl.col("pos") >= 2)
    assert copier.select("seq_id", "pos", "token").equals(first.filter(pl.col("pos") >= 2))
    vocab = read_json(run / "probes/attention/meta.json")
    assert vocab["head_rows"] == 400 and vocab["drawable_ids"] == 399  # less <|endoftext|>


def test_the_copier_scores_the_maximum_and_answers_every_query(probed):
    run = probed["run"]
    score = table(run, "copier", "induction_score.parquet").row(0, named=True)
    # uniform where nothing repeats (ln 400), certain on the second copy
    assert score["first_nll"] == pytest.approx(math.log(400), abs=1e-3)
    assert score["second_nll"] == pytest.approx(0.0, abs=1e-3)
    assert score["score"] == pytest.approx(math.log(400), abs=2e-3)
    assert score["second_accuracy"] == 1.0
    by_k = table(run, "copier", "recall_by_k.parquet")
    assert by_k["k"].to_list() == [1, 2, 4]
    assert by_k["accuracy"].to_list() == [1.0, 1.0, 1.0]
    assert by_k["chance_nll"].to_list() == pytest.approx([math.log(400)] * 3)
    # the trained models (3 steps) know nothing of random tokens: about 0, far from the copier
    for m in ("attention", "base_conv"):
        trained = table(run, m, "induction_score.parquet").row(0, named=True)
        assert abs(trained["score"]) < 0.1
        assert trained["score_lo"] <= trained["score"] <= trained["score_hi"]


def test_the_stage_writes_what_the_library_gives_on_the_same_model(probed):
    from ar_slicing.analysis.probes import (
        ProbeSizes,
        induction_score,
        recall_by_k,
        run_probes,
        tokenizer_probe_vocabulary,
    )
    from ar_slicing.data.store import TokenStore
    from models import load_model
    from pipeline.eval.forward import score_rows

    run = probed["run"]
    loaded = load_model(f"native:{run / 'models/attention'}")
    store = TokenStore.open(run / "tokens/val")
    vocab = tokenizer_probe_vocabulary(store.load_tokenizer(), head_rows=loaded.vocab_size)
    dtype = read_json(run / "probes/attention/meta.json")["plan"]["settings"]["dtype"]
    score = functools.partial(score_rows, loaded, device="cpu", dtype=dtype)
    sizes = ProbeSizes(8, 12, (1, 2, 4), 12)
    tables = run_probes(score, vocab, sizes, seed=0)
    assert pq.read_table(run / "probes/attention/induction.parquet").equals(tables.induction)
    assert pq.read_table(run / "probes/attention/recall.parquet").equals(tables.recall)
    summary = table(run, "attention", "induction_score.parquet").row(0, named=True)
    assert summary == induction_score(tables.induction, 50, 0)
    assert table(run, "attention", "recall_by_k.parquet").equals(
        recall_by_k(tables.recall, 400, 50, 0)
    )


def test_loss_by_position_is_the_run_s_own_losses_by_position(probed):
    """The mean NLL per window position, per slice, as SQL over the tags and losses computes it."""
    run = probed["run"]
    for model in ("base_conv", "attention@step2"):
        got = table(run, model, "position.parquet")
        want = duckdb.sql(
            f"""SELECT t.pos, count(*) AS tokens, avg(l.nll::DOUBLE) AS mean_nll,
                       count(*) FILTER (WHERE t.is_ar_hit) AS ar_tokens
                FROM read_parquet('{run}/tags/tags-*.parquet') t
                JOIN read_parquet('{run}/losses/{model}/losses-*.parquet') l
                USING (window_id, pos) GROUP BY t.pos ORDER BY t.pos"""
        ).pl()
        every = got.filter(pl.col("slice") == "all").sort("pos")
        assert every["pos"].to_list() == want["pos"].to_list()
        assert every["tokens"].to_list() == want["tokens"].to_list()
        assert every["mean_nll"].to_numpy() == pytest.approx(want["mean_nll"].to_numpy())
        ar = got.filter(pl.col("slice") == "ar")
        assert ar["tokens"].sum() == want["ar_tokens"].sum() > 0
        icl = table(run, model, "icl.parquet").filter(pl.col("slice") == "all").row(0, named=True)
        assert (icl["early"], icl["late"]) == (1, 8)  # window 32: 50/2048 and 500/2048 of it
        at = dict(zip(every["pos"].to_list(), every["mean_nll"].to_list()))
        # every window of the run reaches pos 8 but the last: the score's windows, nearly all
        assert icl["score"] == pytest.approx(at[8] - at[1], abs=0.05)


def _config(run: Path, model: str, out: Path, **kw) -> ProbeConfig:
    spec = read_json(run / "losses" / model / "meta.json")["spec"]
    values = dict(
        model=spec,
        tags=str(run / "tags"),
        losses=str(run / "losses" / model),
        out=str(out),
        name=model,
        device="cpu",
        induction_length=8,
        induction_sequences=12,
        recall_pairs=[1, 2, 4],
        recall_queries=12,
        bootstrap=50,
    )
    values.update(kw)
    return ProbeConfig(**values)


def _files(out: Path) -> dict:
    return {p.name: pq.read_table(p) for p in sorted(out.glob("*.parquet"))}


def test_a_rerun_skips_other_sizes_are_refused_and_overwrite_redoes(probed, tmp_path, capsys):
    run = probed["run"]
    out = tmp_path / "attention"
    shutil.copytree(run / "probes/attention", out)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    # the stage's own output, moved: the same plan (dtype resolved as the run resolved it)
    dtype = read_json(out / "meta.json")["plan"]["settings"]["dtype"]
    assert run_probe(_config(run, "attention", out, dtype=dtype))["skipped"] is True
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")} == before
    with pytest.raises(ArSliceError, match=r"settings.induction_length: 8 -> 9(?s:.*)--overwrite"):
        run_probe(_config(run, "attention", out, dtype=dtype, induction_length=9))
    redone = run_probe(
        _config(run, "attention", out, dtype=dtype, induction_length=9, overwrite=True)
    )
    assert "skipped" not in redone
    assert pl.read_parquet(out / "induction.parquet")["pos"].max() == 18


def test_a_failed_run_resumes_at_the_part_it_had_not_finished(probed, tmp_path, monkeypatch):
    run = probed["run"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    cfg = functools.partial(_config, run, "base_conv", dtype="fp32")
    run_probe(cfg(whole))

    import ar_slicing.analysis.probes as probes

    def interrupted(parts):
        raise KeyboardInterrupt("stopped after the induction probe")

    monkeypatch.setattr(probes, "recall_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_probe(cfg(resumed))
    monkeypatch.undo()
    assert not (resumed / "meta.json").exists()
    assert b'"part": "induction"' in (resumed / LEDGER_NAME).read_bytes()
    assert not (resumed / "recall.parquet").exists()
    kept = (resumed / "induction.parquet").stat().st_mtime_ns

    run_probe(cfg(resumed))
    assert (resumed / "induction.parquet").stat().st_mtime_ns == kept  # not computed again
    assert _files(resumed).keys() == _files(whole).keys()
    for name, t in _files(whole).items():
        assert _files(resumed)[name].equals(t), name
    assert read_json(resumed / "meta.json")["sequences_digest"] is not None


@pytest.mark.slow
def test_a_killed_process_resumes_to_the_same_files(probed, tmp_path):
    from pipeline.cli import main as cli_main
    from tests.reliability import kill_when

    run = probed["run"]
    cfg = _config(run, "attention", tmp_path / "x", dtype="fp32", recall_queries=4096)
    args = ["--model", cfg.model, "--tags", cfg.tags, "--losses", cfg.losses, "--device", "cpu"]
    args += ["--dtype", "fp32", "--induction-length", "8", "--induction-sequences", "12"]
    args += ["--recall-pairs", "1", "2", "4", "--recall-queries", "4096", "--bootstrap", "50"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert cli_main(["probe", *args, "--out", str(whole)]) == 0
    ledger = killed / LEDGER_NAME

    def recorded() -> bool:
        return ledger.exists() and b'"part": "induction"' in ledger.read_bytes()

    was_killed, stderr = kill_when(["probe", *args, "--out", killed], recorded)
    assert was_killed and not (killed / "meta.json").exists(), stderr
    assert cli_main(["probe", *args, "--out", str(killed)]) == 0
    for name, t in _files(whole).items():
        assert _files(killed)[name].equals(t), name


def test_losses_not_finished_are_refused_naming_them(probed, tmp_path):
    run = probed["run"]
    losses = tmp_path / "losses"
    losses.mkdir()
    cfg = dataclasses.replace(_config(run, "attention", tmp_path / "out"), losses=str(losses))
    with pytest.raises(BadInput, match=rf"losses {losses}: incomplete .*arslice eval"):
        run_probe(cfg)
    assert not (tmp_path / "out").exists()


def test_losses_of_other_windows_are_refused_naming_both(probed, tmp_path):
    import json

    run = probed["run"]
    losses = tmp_path / "losses"
    shutil.copytree(run / "losses/attention", losses)
    meta = json.loads((losses / "meta.json").read_text())
    meta["window"] = 16
    (losses / "meta.json").write_text(json.dumps(meta))
    cfg = dataclasses.replace(_config(run, "attention", tmp_path / "out"), losses=str(losses))
    with pytest.raises(BadInput, match=r"windows of 16 tokens, but tags .* hold \d+ of 32"):
        run_probe(cfg)
    assert not (tmp_path / "out").exists()


def test_a_sequence_longer_than_the_model_reads_is_refused(probed, tmp_path):
    run = probed["run"]
    cfg = _config(run, "copier", tmp_path / "out", induction_length=40)  # reads 80 tokens > 64
    with pytest.raises(BadInput, match="reads 80 tokens.*at most 64.*induction_length"):
        run_probe(cfg)
    assert not (tmp_path / "out").exists()


def test_the_run_prints_each_model_s_scores(probed, capsys):
    with printing_summaries():
        run_pipeline(RunConfig(config=str(probed["config"]), stage=["probe"]))
    out = capsys.readouterr().out
    assert "probe copier: " in out and "is complete; skipped (--overwrite to redo)" in out
    assert np.isfinite(table(probed["run"], "copier", "induction_score.parquet")["score"][0])


def test_the_report_shows_the_probes_beside_the_recall_gain(probed):
    import csv

    run = probed["run"]
    report = run / "report"
    with open(report / "probes.csv") as f:
        rows = {r["model"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == MODELS
    with open(report / "emergence.csv") as f:
        points = {r["checkpoint"]: r for r in csv.DictReader(f)}
    for model in MODELS:
        score = table(run, model, "induction_score.parquet")["score"][0]
        assert float(rows[model]["induction_score"]) == pytest.approx(score, rel=1e-8)
        by_k = table(run, model, "recall_by_k.parquet")
        assert float(rows[model]["recall_accuracy"]) == pytest.approx(by_k["accuracy"].mean())
        if model in points:  # a point of the recall emergence: its gain, with its interval
            for key in ("recall_gain", "recall_gain_lo", "recall_gain_hi"):
                assert rows[model][key] == points[model][key]
    assert rows["attention@step2"]["step"] == "2" and rows["attention@step2"]["of_model"] == (
        "attention"
    )
    # the copier is no point of the emergence: its gain is recall_gain.csv's, without interval
    with open(report / "recall_gain.csv") as f:
        gain = next(
            r for r in csv.DictReader(f) if r["model"] == "copier" and r["bucket_label"] == "all"
        )
    assert rows["copier"]["recall_gain"] == gain["gain"] and rows["copier"]["recall_gain_lo"] == ""
    md = (report / "report.md").read_text()
    section = md.split("## Probes: induction, zero-shot recall and loss by position")[1]
    assert "![probes](probes.png)" in section
    assert "![probes along training](probes_training.png)" in section
    assert all(f"| {m} |" in section for m in MODELS)
    assert (report / "probes.png").read_bytes()[:4] == b"\x89PNG"
    assert (report / "probes_training.png").read_bytes()[:4] == b"\x89PNG"
    assert 'alt="probes along training"' in (report / "report.html").read_text()


def test_without_resamples_no_interval_and_any_order_of_k(probed, tmp_path):
    run = probed["run"]
    out = tmp_path / "out"
    run_probe(_config(run, "attention", out, bootstrap=0, recall_pairs=[4, 1, 2]))
    meta = read_json(out / "meta.json")
    assert (
        meta["induction_score"]["score_lo"] is None and meta["induction_score"]["score"] is not None
    )
    by_k = pl.read_parquet(out / "recall_by_k.parquet")
    assert by_k["k"].to_list() == [1, 2, 4]
    assert meta["recall_accuracy"] == dict(zip(["1", "2", "4"], by_k["accuracy"].to_list()))
    assert "NaN" not in (out / "meta.json").read_text()


# ---- arslice verify over the probes -------------------------------------------------------------


def _verified(run: Path) -> tuple[bool, str]:
    """(passed, every line verify printed) of `arslice verify --no-scan-tokens` on `run`."""
    import contextlib
    import io

    from pipeline.verify import VerifyConfig, verify_run

    out = io.StringIO()
    with contextlib.redirect_stdout(out), printing_summaries():
        try:
            verify_run(VerifyConfig(run=str(run), scan_tokens=False))
        except ArSliceError:
            return False, out.getvalue()
    return True, out.getvalue()


@pytest.fixture
def probed_copy(probed, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(probed["run"], run)
    return run


def test_verify_recomputes_every_probe_summary_from_its_rows(probed_copy):
    ok, out = _verified(probed_copy)
    assert ok, out
    for model in MODELS:
        d = probed_copy / "probes" / model
        assert f"ok    {d / 'induction_score.parquet'}: the score its rows give" in out
        assert f"ok    {d / 'recall_by_k.parquet'}: the accuracy and NLL its rows give" in out
    # (the copier reads its sequences after its prefix token: other sequences, checked alone)
    assert "probes of one vocabulary and sizes read the same sequences (4 folders)" in out


def _rewrite(path: Path, change) -> None:
    table = pl.read_parquet(path)
    pq.write_table(change(table).to_arrow().cast(pq.read_schema(path)), path)


@pytest.mark.parametrize(
    ("broken", "change", "message"),
    [
        (
            "induction.parquet",
            lambda t: t.with_columns(
                pl.when(pl.col("copy") == 2).then(pl.col("nll") + 0.5).otherwise(pl.col("nll"))
                .alias("nll")
            ),
            "induction_score.parquet: the score its rows give (and meta.json's)",
        ),
        (
            "recall.parquet",
            lambda t: t.with_columns(pl.col("token").alias("argmax")),  # every query right
            "recall_by_k.parquet: the accuracy and NLL its rows give",
        ),
        (
            "recall.parquet",
            lambda t: pl.concat([t, t.head(1)]),
            "recall.parquet: rows keyed by (seq_id, pos): row",
        ),
        (
            "induction.parquet",
            lambda t: t.with_columns(pl.lit(True).alias("scored")),
            "scored is not every position but the first of each copy",
        ),
        (
            "induction_curve.parquet",
            lambda t: t.with_columns(pl.col("mean_nll") * 1.001),
            "induction_curve.parquet: the curve its rows give: column mean_nll differs",
        ),
    ],
)  # fmt: skip
def test_verify_names_a_probe_file_whose_rows_and_summaries_disagree(
    probed_copy, broken, change, message
):
    path = probed_copy / "probes" / "base_conv@step2" / broken
    _rewrite(path, change)
    ok, out = _verified(probed_copy)
    assert not ok
    fails = [line for line in out.splitlines() if line.startswith("  FAIL")]
    assert fails and all(str(path.parent) in line for line in fails), fails
    assert any(message in line for line in fails), fails


def test_verify_names_a_missing_probe_file_and_sequences_that_differ(probed_copy):
    import json

    (probed_copy / "probes" / "copier" / "recall_by_k.parquet").unlink()
    meta_file = probed_copy / "probes" / "attention" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["sequences_digest"] = "0" * 16
    meta_file.write_text(json.dumps(meta))
    ok, out = _verified(probed_copy)
    assert not ok
    assert "copier: every probe file present: missing ['recall_by_k.parquet']" in out
    assert "sequences differ: 000000000000…: attention;" in out
