"""The stage contract: one plan rule for every stage, checks before anything runs, nothing left
behind by early errors, and make rerunning exactly what a config edit changed.

Each test here is one way the pipeline used to give wrong or stale results without a word."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import tomllib

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import read_json
from pipeline.runner.run import RunConfig, run_pipeline
from tests.conftest import small_pipeline_config
from tests.reliability import REPO, cli, run_subprocess, tiny_run  # noqa: F401  (a fixture)
from tests.tiny_models import save_neox


def make(*targets: str, config: Path, **variables: str) -> subprocess.CompletedProcess:
    """`make TARGETS CONFIG=config` in the repository, with this tree's code as `arslice`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = ["make", "--no-print-directory", *targets, f"CONFIG={config}"]
    argv += [f"ARSLICE={sys.executable} -m pipeline.cli"]
    argv += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)


def stages_run(done: subprocess.CompletedProcess) -> list[str]:
    """The stages a make run started (each prints `[k/n] STAGE`)."""
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("[1/1] ")]


# ---- 1, 2: editing the config, and make ------------------------------------------------------


@pytest.mark.slow  # (~80 s: every stage run four times)
def test_editing_the_config_reruns_exactly_what_it_changed(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run = tmp_path / "run"
    first = make("all", config=cfg)
    assert first.returncode == 0, first.stderr
    assert stages_run(first) == [
        "tokenizer",
        "tokenize",
        "count",
        "tag",
        "train",
        "eval",
        "probe",
        "report",
    ]
    assert make("all", config=cfg).stdout.count("[1/1]") == 0  # nothing is stale

    # a new [eval.models] table: that model is evaluated and probed, the report rebuilt, nothing
    # else
    upstream = {p: p.read_bytes() for p in run.glob("*/meta.json") if p.parent.name != "report"}
    vocab_size = read_json(run / "tokens/val/meta.json")["tokenizer"]["vocab_size"]
    model = save_neox(tmp_path / "mine", vocab_size, max_position_embeddings=64)
    cfg.write_text(cfg.read_text() + f'\n[eval.models.mine]\nmodel = "hf:{model}"\n')
    second = make("all", config=cfg)
    assert second.returncode == 0, second.stderr
    assert stages_run(second) == ["eval", "probe", "report"]
    assert read_json(run / "losses/mine/meta.json")["spec"] == f"hf:{model}"
    assert "mine" in (run / "report/table1.csv").read_text()
    assert {p: p.read_bytes() for p in upstream if p.parent.name not in ("losses", "probes")} == {
        p: b for p, b in upstream.items() if p.parent.name not in ("losses", "probes")
    }

    # another threshold on finished tags: refused before anything runs, naming both values,
    # and config.toml still says what the tags were made with
    cfg.write_text(cfg.read_text().replace("threshold = 2", "threshold = 3"))
    refused = make("all", config=cfg)
    assert refused.returncode != 0 and "settings.threshold: 2 -> 3" in refused.stderr
    assert "Traceback" not in refused.stderr and stages_run(refused) == []
    assert tomllib.loads((run / "config.toml").read_text())["tag"]["threshold"] == 2
    assert read_json(run / "tags/meta.json")["threshold"] == 2

    # OVERWRITE=1 redoes what changed: the tags, then the report; the losses depend only on the
    # windows, so no model is evaluated again
    losses = (run / "losses/attention/meta.json").read_bytes()
    third = make("all", config=cfg, OVERWRITE="1")
    assert third.returncode == 0, third.stderr
    assert stages_run(third) == ["tag", "eval", "probe", "report"]
    assert read_json(run / "tags/meta.json")["threshold"] == 3
    assert (run / "losses/attention/meta.json").read_bytes() == losses
    assert "skipped" in third.stdout
    assert tomllib.loads((run / "config.toml").read_text())["tag"]["threshold"] == 3


def test_a_run_refuses_changed_settings_before_writing_anything(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run_pipeline(RunConfig(config=str(cfg), stage=["tokenizer", "tokenize", "count", "tag"]))
    recorded = (tmp_path / "run/config.toml").read_bytes()
    cfg.write_text(small_pipeline_config(tmp_path, tag="threshold = 100"))
    with pytest.raises(ArSliceError, match=r"\[tag\](?s:.*)settings.threshold: 2 -> 100"):
        run_pipeline(RunConfig(config=str(cfg)))
    assert (tmp_path / "run/config.toml").read_bytes() == recorded
    # the same with --stage tag alone, and through the CLI: rc 2, no traceback
    done = run_subprocess("run", "--config", cfg, "--stage", "tag")
    assert done.returncode == 2 and "threshold: 2 -> 100" in done.stderr
    assert "Traceback" not in done.stderr


# ---- 3: report refuses inputs that do not belong together -------------------------------------


def test_report_refuses_losses_of_other_windows(tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run_pipeline(RunConfig(config=str(cfg)))
    # re-tag the same store in windows of another length, keeping the old losses
    cfg.write_text(small_pipeline_config(tmp_path, tag="window = 16"))
    run_pipeline(RunConfig(config=str(cfg), stage=["tag"], overwrite=True))
    with pytest.raises(BadInput, match=r"window length: losses 32, tags 16(?s:.*)--overwrite"):
        run_pipeline(RunConfig(config=str(cfg), stage=["report"], overwrite=True))


# ---- 4, 5: checks before anything runs --------------------------------------------------------


@pytest.mark.parametrize(
    "edit, message",
    [
        (None, "no such file"),
        ({"tag": "treshold = 3"}, r"\[tag\].*unknown key\(s\) treshold"),
        ({"train.models.attention": 'arch = "hyenna"'}, r'`arch = "hyenna"` is not one of'),
        ({"tag": 'threshold = "8"'}, r"`threshold = \"8\"` must be an integer"),
        ({"tokenize": 'source = [""]'}, "an empty path"),
        ({"report": "bootstrap = -1"}, "--bootstrap -1"),
    ],
)
def test_dry_run_checks_every_stage_and_writes_nothing(tmp_path, edit, message):
    cfg = tmp_path / "p.toml"
    if edit is not None:
        cfg.write_text(small_pipeline_config(tmp_path, **edit))
    done = run_subprocess("run", "--config", cfg, "--dry-run")
    assert done.returncode == 2, done.stdout
    assert __import__("re").search(message, done.stderr), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
    # a real run finds the same before its first stage
    done = run_subprocess("run", "--config", cfg)
    assert done.returncode == 2 and not (tmp_path / "run").exists()


def test_dry_run_of_a_good_config_prints_every_stage(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    done = run_subprocess("run", "--config", cfg, "--dry-run")
    assert done.returncode == 0, done.stderr
    for stage in ("tokenizer", "tokenize", "count", "tag", "train", "eval", "probe", "report"):
        assert f"# [{stage}]" in done.stdout
    assert not (tmp_path / "run").exists()


def test_an_empty_source_is_not_the_current_directory(tmp_path, bpe_tokenizer_path):
    out = tmp_path / "store"
    done = run_subprocess(
        "tokenize", "--source", "", "--tokenizer", bpe_tokenizer_path, "--out", out
    )
    assert done.returncode == 2 and "an empty path" in done.stderr and not out.exists()


# ---- 6: empty inputs, and a store tagged against its own counts -------------------------------


def test_a_source_without_documents_is_an_error(tmp_path, bpe_tokenizer_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    out = tmp_path / "store"
    assert cli("tokenize", "--source", src, "--tokenizer", bpe_tokenizer_path, "--out", out) == 2
    assert not out.exists()


def test_tagging_the_training_store_against_its_own_counts_warns(tiny_run, tmp_path, capsys):  # noqa: F811
    run = tiny_run["run"]
    out = tmp_path / "tags"
    args = ["--tokens", run / "tokens/train", "--counts", run / "counts", "--out", out]
    assert cli("tag", *args, "--workers", "1") == 0
    assert "warning: the counts" in capsys.readouterr().out
    assert "tokens/val" in read_json(out / "meta.json")["warnings"][0]


# ---- 7: nothing left behind by an early error -------------------------------------------------


def test_early_errors_leave_no_output(tiny_run, tmp_path):  # noqa: F811
    run = tiny_run["run"]
    store = tmp_path / "store"
    assert (
        cli("tokenize", "--source", tmp_path / "missing", "--tokenizer", "x", "--out", store) == 2
    )
    assert not store.exists()
    for spec in ("hf:" + str(tmp_path / "no-such-model"), "native:" + str(tmp_path / "nothing")):
        out = tmp_path / "losses" / spec.split(":")[0]
        assert cli("eval", "--model", spec, "--tags", run / "tags", "--out", out) == 2
        assert not out.exists()
    # a window longer than the model's positions: refused after loading, nothing written
    long_tags = tmp_path / "long-tags"
    args = ["--tokens", run / "tokens/val", "--counts", run / "counts", "--out", long_tags]
    assert cli("tag", *args, "--window", "512", "--workers", "1") == 0
    out = tmp_path / "losses/long"
    model = f"native:{tiny_run['model']}"
    assert cli("eval", "--model", model, "--tags", long_tags, "--out", out, "--device", "cpu") == 2
    assert not out.exists()


# ---- 8: results.duckdb ------------------------------------------------------------------------


def dump(path: Path) -> dict:
    """Every view's and table's definition and rows, in a stable order."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        objects = con.execute(
            "SELECT table_name, table_type FROM information_schema.tables ORDER BY table_name"
        ).fetchall()
        out = {}
        for name, kind in objects:
            rows = con.execute(f'SELECT * FROM "{name}"').fetchall()
            out[name] = (kind, sorted(map(repr, rows)))
        return out
    finally:
        con.close()


def test_results_duckdb_is_the_same_on_a_rerun(tiny_run, tmp_path):  # noqa: F811
    from ar_slicing.analysis.results import build_results, find_run

    run = tmp_path / "run"
    shutil.copytree(tiny_run["run"], run)
    assert cli("report", "--run", run, "--bootstrap", "20") == 0
    db = run / "results.duckdb"
    first = db.read_bytes()
    # a rerun, --overwrite included, keeps the file: its inputs did not change
    assert cli("report", "--run", run, "--bootstrap", "20", "--overwrite") == 0
    assert db.read_bytes() == first
    # rebuilt from the same inputs, it holds the same views and tables, row for row (DuckDB
    # writes a random database id into every new file, so its bytes differ there)
    before = dump(db)
    build_results(find_run(run))
    assert dump(db) == before and len(before) >= 6


def test_results_follow_an_evaluation_redone_with_another_batch_size(tiny_run, tmp_path):  # noqa: F811
    """The same plan (losses do not depend on the batch size), but the models table copies the
    batch size and speed from the losses' meta.json: the file is rebuilt."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run["run"], run)
    assert cli("report", "--run", run, "--bootstrap", "20") == 0

    def batch_size() -> int:
        con = duckdb.connect(str(run / "results.duckdb"), read_only=True)
        try:
            return con.execute("SELECT batch_size FROM models").fetchone()[0]
        finally:
            con.close()

    assert batch_size() == 16
    model = f"native:{tiny_run['model']}"
    redo = ["eval", "--model", model, "--tags", run / "tags", "--out", run / "losses/attention",
            "--device", "cpu", "--batch-size", "8", "--chunk-windows", "16", "--overwrite"]  # fmt: skip
    assert cli(*redo) == 0
    assert cli("report", "--run", run, "--bootstrap", "20") == 0
    assert batch_size() == 8


# ---- 10: hints that point one level off --------------------------------------------------------


def test_hints_name_the_folder_meant(tiny_run, tmp_path):  # noqa: F811
    run = tiny_run["run"]
    done = run_subprocess("eval", "--model", f"native:{tiny_run['model']}", "--tags", run,
                          "--out", tmp_path / "x")  # fmt: skip
    assert done.returncode == 2 and f"its tags are {run / 'tags'}" in done.stderr
    assert "rerun `arslice tag`" not in done.stderr
    done = run_subprocess("report", "--run", run / "losses")
    assert done.returncode == 2 and f"pass --run {run}" in done.stderr
    assert "--out" not in done.stderr
