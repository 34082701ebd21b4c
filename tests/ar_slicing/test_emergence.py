"""Recall emergence (docs/design.md, "Recall emergence"): checkpoints kept by the trainer, evaluated
by `[eval] checkpoints`, and the emergence numbers, against a naive computation over the Parquet
the run wrote; Table 1 is the same with and without checkpoints in the run."""

from __future__ import annotations

import hashlib
import math
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.windows import scored_window_ids, window_subset
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import build_meta, read_json, write_meta
from ar_slicing.machinery.plan import PlanMismatch
from pipeline.runner.config_file import load_pipeline_config
from pipeline.runner.run import RunConfig, run_pipeline
from pipeline.runner.stages_run import Pipeline
from tests.conftest import small_pipeline_config
from tests.pipeline.test_train import MINIMAL, stores, tiny_config  # noqa: F401  (stores: a fixture)
from tests.queries.test_queries import LOSS_SCHEMA, TINY_COUNTS, TINY_DOCS, TINY_SUBSETS, write_run

# ---- the window subset ----------------------------------------------------------------------------


def test_window_subset_follows_its_worked_example():
    assert window_subset(10, 4).tolist() == [0, 2, 5, 7]
    assert window_subset(3, None).tolist() == window_subset(3, 5).tolist() == [0, 1, 2]
    assert scored_window_ids(10, 4, 2).tolist() == [0, 2]  # a partial run: its first two
    assert scored_window_ids(10, None, 3).tolist() == [0, 1, 2]  # as --max-windows always was
    with pytest.raises(ArSliceError, match="at least one window"):
        window_subset(10, 0)


@given(n_windows=st.integers(1, 5000), n=st.integers(1, 5000))
@settings(max_examples=200, deadline=None)
def test_window_subset_is_evenly_strided_over_every_window(n_windows, n):
    ids = window_subset(n_windows, n)
    assert len(ids) == min(n, n_windows)
    assert ids[0] == 0 and ids[-1] < n_windows and np.all(np.diff(ids) > 0)
    if n < n_windows:  # a fixed stride through the whole store, not its first windows
        gaps = set(np.diff(ids).tolist())
        assert gaps <= {n_windows // n, -(-n_windows // n)}
        assert ids[-1] >= n_windows - -(-n_windows // n)


# ---- training keeps checkpoints ---------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_kept_checkpoints_load_and_change_no_byte_of_the_final_model(stores, tmp_path):  # noqa: F811
    import torch

    from models.checkpoints.registry import load_model
    from pipeline.train import build_model, model_config_for, train

    shared = dict(steps=9, checkpoint_every=4, **MINIMAL)
    plain = train(tiny_config(stores, tmp_path / "plain", **shared))
    kept = train(tiny_config(stores, tmp_path / "kept", keep_checkpoints=[6, 0, 3], **shared))
    out = tmp_path / "kept"
    # the final model's bytes are the trainer's own, with or without kept checkpoints
    assert sha256(out / "model.safetensors") == sha256(tmp_path / "plain" / "model.safetensors")
    assert kept["final_val_loss"] == plain["final_val_loss"]
    assert kept["checkpoints"] == [0, 3, 6] and kept["step"] == 9
    assert kept["plan"]["settings"]["keep_checkpoints"] == [0, 3, 6]
    assert "keep_checkpoints" not in plain["plan"]["settings"]  # (older plans stay the same)
    for step in (0, 3, 6):
        folder = out / "checkpoints" / f"step-{step}"
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json",
            "meta.json",
            "model.safetensors",
        ]
        record = read_json(folder / "meta.json")
        assert (record["step"], record["tokens_seen"]) == (step, step * 4 * 32)
        assert kept["ledger"][f"kept {step:08d}"]["facts"] == {"step": step}
        assert f"checkpoints/step-{step}/model.safetensors" in kept["written"]
    # native:<dir>/checkpoints/step-<n> loads, with the model folder's tokenizer
    loaded = load_model(f"native:{out}/checkpoints/step-3")
    assert loaded.tokenizer_fingerprint == stores[0].fingerprint
    # step 0 is the initial weights: the seed's model, before any update
    torch.manual_seed(0)
    vocab = stores[0].vocab_size
    fresh = build_model(model_config_for(tiny_config(stores, out, **shared), vocab), "cpu")
    initial = load_model(f"native:{out}/checkpoints/step-0").model.state_dict()
    assert all(torch.equal(initial[k], v) for k, v in fresh.state_dict().items())
    weights = {
        s: sha256(out / "checkpoints" / f"step-{s}" / "model.safetensors") for s in (0, 3, 6)
    }
    assert len(set(weights.values())) == 3  # the model moved between them

    # a run interrupted after its checkpoint at step 4 resumes to the same bytes, kept ones too
    import pipeline.train as train_module

    def interrupted(stage, model, optimizer, progress, _real=train_module.checkpoint):
        _real(stage, model, optimizer, progress)
        raise KeyboardInterrupt

    again = tmp_path / "again"
    cfg = tiny_config(stores, again, keep_checkpoints=[0, 3, 6], **shared)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_module, "checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    assert not (again / "meta.json").exists() and (again / "checkpoints/step-3").is_dir()
    resumed = train(cfg)
    assert resumed["counts"]["resumed_from_step"] == 4
    for s, digest in weights.items():
        assert sha256(again / "checkpoints" / f"step-{s}" / "model.safetensors") == digest
    assert sha256(again / "model.safetensors") == sha256(out / "model.safetensors")

    # another set of kept steps is another plan: refused, naming it
    with pytest.raises(PlanMismatch, match=r"settings.keep_checkpoints: \[0, 3, 6\] -> \[3\]"):
        train(tiny_config(stores, out, keep_checkpoints=[3], **shared))
    with pytest.raises(ArSliceError, match="--keep-checkpoints 9: a kept step must be from 0 to 8"):
        train(tiny_config(stores, tmp_path / "late", keep_checkpoints=[2, 9], **shared))


# ---- a small real run: trained models, their checkpoints, evaluated -----------------------------


def emergence_config(root: Path, *, checkpoints: bool = True, windows: int | None = 5) -> str:
    """The small pipeline, training 4 steps and keeping steps 0 and 2 of each model; `checkpoints`:
    `[eval] checkpoints = "all"`, each scored on `windows` windows (None: every window)."""
    text = small_pipeline_config(root, train="keep_checkpoints = [0, 2]")
    text = text.replace("steps = 3\n", "steps = 4\n")
    if checkpoints:
        extra = 'checkpoints = "all"\n'
        if windows is not None:
            extra += f"checkpoint_windows = {windows}\n"
        text = text.replace("[eval]\n", "[eval]\n" + extra)
    return text


QUERY_CSVS = ("table1", "slice_perplexity", "gap_vs_reference", "frequency_curve", "recall_gain")
QUERY_CSVS += ("by_subset", "copy_length")


@pytest.fixture(scope="module")
def emergence_run(tmp_path_factory):
    """A small real run: the report without checkpoints, then with `checkpoints = "all"` on a
    5-window subset (the CSVs of the first report are kept in `before`)."""
    root = tmp_path_factory.mktemp("emergence")
    config = root / "small.toml"
    config.write_text(emergence_config(root, checkpoints=False))
    run_pipeline(RunConfig(config=str(config)))
    run = root / "run"
    before = {name: (run / "report" / f"{name}.csv").read_bytes() for name in QUERY_CSVS}
    config.write_text(emergence_config(root))
    run_pipeline(RunConfig(config=str(config)))
    return {"root": root, "config": config, "run": run, "before": before}


def test_eval_of_every_kept_checkpoint(emergence_run):
    from ar_slicing import open_run

    run = emergence_run["run"]
    names = ["attention@step0", "attention@step2", "base_conv@step0", "base_conv@step2"]
    assert open_run(run).checkpoints == tuple(names)
    assert open_run(run).models == ("attention", "base_conv")
    n_windows = len(pq.read_table(run / "tags/windows.parquet"))
    tokens_per_step = 4 * 32  # batch_size x seq_len
    for name in names:
        model, step = name.split("@step")
        meta = read_json(run / "losses" / name / "meta.json")
        assert meta["spec"] == f"native:{run}/models/{model}/checkpoints/step-{step}"
        assert (meta["checkpoint_of"], meta["step"]) == (model, int(step))
        assert meta["tokens_seen"] == int(step) * tokens_per_step
        assert (meta["window_subset"], meta["windows_evaluated"], meta["partial"]) == (5, 5, False)
        # the plan keys the checkpoint by its step and tokens seen, and records the subset
        settings = meta["plan"]["settings"]
        assert settings["checkpoint"] == {
            "of": model,
            "step": int(step),
            "tokens_seen": int(step) * tokens_per_step,
        }
        assert settings["window_subset"] == 5
        scored = pl.read_parquet(run / "losses" / name / "losses-*.parquet")["window_id"]
        assert sorted(set(scored.to_list())) == window_subset(n_windows, 5).tolist()
    # the models themselves: every window, their step recorded, their plans as before
    final = read_json(run / "losses/attention/meta.json")
    assert (final["step"], final["tokens_seen"], final["windows_evaluated"]) == (
        4,
        4 * tokens_per_step,
        n_windows,
    )
    assert "checkpoint" not in final["plan"]["settings"]
    assert "window_subset" not in final["plan"]["settings"]
    marker = read_json(run / "losses/meta.json")["losses"]
    assert marker["attention@step2"]["checkpoint_of"] == "attention"
    from pipeline.cli import main

    assert main(["verify", "--run", str(run), "--no-scan-tokens"]) == 0


def test_table1_and_every_query_are_the_same_with_checkpoints_in_the_run(emergence_run):
    """Checkpoints are not models of Table 1, and their window subset restricts no view."""
    run = emergence_run["run"]
    for name, before in emergence_run["before"].items():
        assert (run / "report" / f"{name}.csv").read_bytes() == before, name
    assert (run / "report/emergence.png").is_file() and (run / "report/emergence.csv").is_file()
    text = (run / "report/report.md").read_text()
    assert "## Recall emergence" in text and "attention@step2" in text
    from ar_slicing import open_run

    opened = open_run(run)
    assert opened.sql("SELECT DISTINCT model FROM losses ORDER BY 1")["model"].to_list() == [
        "attention",
        "base_conv",
    ]
    assert opened.sql("SELECT count(*) AS n FROM models")["n"][0] == 2


def naive_emergence(run: Path) -> dict[tuple[str, str], dict]:
    """Each point's numbers computed plainly from the Parquet the run wrote: the tags joined with
    each losses folder, each model's points restricted to the windows all of them scored."""
    tags = pl.read_parquet(run / "tags/tags-*.parquet")
    points = {}
    for folder in sorted((run / "losses").iterdir()):
        if not folder.is_dir():
            continue
        meta = read_json(folder / "meta.json")
        model = meta.get("checkpoint_of") or folder.name
        losses = pl.read_parquet(folder / "losses-*.parquet")
        points[(model, folder.name)] = (meta, losses)
    out = {}
    for model in {m for m, _ in points}:
        mine = {k: v for k, v in points.items() if k[0] == model}
        if len(mine) < 2:
            continue
        shared = set.intersection(*(set(v[1]["window_id"].to_list()) for v in mine.values()))
        for key, (meta, losses) in mine.items():
            t = tags.filter(pl.col("window_id").is_in(sorted(shared))).join(
                losses, on=["window_id", "pos"]
            )
            bucket = [0 if c <= 0 else len(str(c)) for c in t["train_count"].to_list()]
            t = t.with_columns(pl.Series("bucket", bucket))
            gains, weights = [], []
            count0 = math.nan
            for b in sorted(set(bucket)):
                rep = t.filter((pl.col("bucket") == b) & pl.col("is_repeat"))["nll"].to_numpy()
                non = t.filter((pl.col("bucket") == b) & ~pl.col("is_repeat"))["nll"].to_numpy()
                if len(rep) and len(non):
                    gain = non.astype(float).mean() - rep.astype(float).mean()
                    gains.append(gain * len(rep))
                    weights.append(len(rep))
                    if b == 0:
                        count0 = gain
            hit = t.filter(pl.col("is_ar_hit"))["nll"].to_numpy().astype(float)
            other = t.filter(~pl.col("is_ar_hit"))["nll"].to_numpy().astype(float)
            out[key] = {
                "step": meta["step"],
                "tokens_seen": meta["tokens_seen"],
                "n_windows": len(shared),
                "n_tokens": len(t),
                "recall_gain": sum(gains) / sum(weights) if weights else math.nan,
                "recall_gain_count0": count0,
                "ppl_ar": math.exp(hit.mean()) if len(hit) else math.nan,
                "ppl_other": math.exp(other.mean()),
            }
    return out


def same(a, b) -> bool:
    return (a is None and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-9)


def test_emergence_numbers_match_a_naive_computation(emergence_run):
    from ar_slicing import open_run

    run = emergence_run["run"]
    opened = open_run(run)
    frame = opened.emergence(bootstrap=50)
    naive = naive_emergence(run)
    assert sorted(zip(frame["model"], frame["checkpoint"])) == sorted(naive)
    assert frame["final"].to_list() == [False, False, True] * 2  # by model, then step
    for row in frame.iter_rows(named=True):
        want = naive[(row["model"], row["checkpoint"])]
        for key, value in want.items():
            assert same(row[key], value), (row["checkpoint"], key, row[key], value)
        assert row["n_windows"] == 5
        assert row["recall_gain_lo"] <= row["recall_gain"] <= row["recall_gain_hi"]
    # the SQL file gives the same point estimates
    sql = opened.query("recall_emergence")
    for row in sql.iter_rows(named=True):
        want = naive[(row["model"], row["checkpoint"])]
        for key in ("recall_gain", "recall_gain_count0", "ppl_ar", "ppl_other", "n_tokens"):
            assert same(row[key], want[key]), (row["checkpoint"], key)
    # the API's lazy frame holds exactly the compared tokens
    lazy = opened.checkpoint_token_losses().collect()
    assert lazy.height == sum(w["n_tokens"] for w in naive.values())
    assert set(lazy["window_id"].to_list()) == set(
        window_subset(len(pq.read_table(run / "tags/windows.parquet")), 5).tolist()
    )


def test_emergence_on_every_window_is_table1s_recall_gain_at_the_final_point(emergence_run):
    """With no subset, a model's final point is its Table 1 row: the same gain and the same
    interval (the same windows, resampled the same way)."""
    from ar_slicing import open_run

    root = emergence_run["root"] / "all-windows"
    shutil.copytree(emergence_run["root"], root, ignore=shutil.ignore_patterns("all-windows"))
    config = root / "small.toml"
    config.write_text(emergence_config(root, windows=None))
    run_pipeline(RunConfig(config=str(config), stage=["eval"], redo_changed=True))
    opened = open_run(root / "run")
    table1 = opened.table1(bootstrap=40, seed=3)
    frame = opened.emergence(bootstrap=40, seed=3).filter(pl.col("final"))
    for row in frame.iter_rows(named=True):
        t1 = table1.filter(pl.col("model") == row["model"]).row(0, named=True)
        for end in ("", "_lo", "_hi"):
            assert row[f"recall_gain{end}"] == pytest.approx(t1[f"recall_gain{end}"], abs=1e-12)


def test_another_window_subset_is_refused_naming_it(emergence_run, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(emergence_run["root"], root, ignore=shutil.ignore_patterns("all-windows"))
    config = root / "small.toml"
    config.write_text(emergence_config(root, windows=7))
    with pytest.raises(PlanMismatch) as err:
        run_pipeline(RunConfig(config=str(config), stage=["eval"]))
    assert "losses/attention@step0" in str(err.value)
    assert "settings.window_subset: 5 -> 7" in str(err.value)


# ---- bad `checkpoints` values, named with their table and key ----------------------------------


def eval_configs(tmp_path: Path, text: str):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return Pipeline(path, load_pipeline_config(path)).configs("eval")


TRAINED = (
    'run_dir = "r"\n[train]\nsteps = 10\nkeep_checkpoints = [2, 4]\n'
    '[train.models.attention]\narch = "attention"\n'
    '[train.models.rwkv]\narch = "rwkv"\nkeep_checkpoints = [4]\n'
)


def test_checkpoints_tables_of_trained_and_hub_models(tmp_path):
    configs = eval_configs(
        tmp_path,
        TRAINED + "[eval]\ncheckpoints = [4]\ncheckpoint_windows = 9\n"
        '[eval.models.p]\nmodel = "hf:org/p"\ncheckpoints = ["step0", "step10"]\n'
        "tokens_per_step = 100\ncheckpoint_windows = 3\n",
    )
    assert list(configs) == ["attention", "rwkv", "p", "attention@step4", "rwkv@step4",
                             "p@step0", "p@step10"]  # fmt: skip
    a = configs["attention@step4"]
    assert (a.model, a.checkpoint_of, a.step, a.tokens_seen, a.window_subset, a.out) == (
        "native:r/models/attention/checkpoints/step-4", "attention", 4, None, 9,
        "r/losses/attention@step4",
    )  # fmt: skip
    p = configs["p@step10"]
    assert (p.model, p.checkpoint_of, p.step, p.tokens_seen, p.window_subset) == (
        "hf:org/p@step10", "p", 10, 1000, 3,
    )  # fmt: skip
    assert configs["p"].model == "hf:org/p" and configs["p"].checkpoint_of is None
    everything = eval_configs(tmp_path, TRAINED + '[eval]\ncheckpoints = "all"\n')
    assert [n for n in everything if "@" in n] == [
        "attention@step2",
        "attention@step4",
        "rwkv@step4",
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            TRAINED + '[eval]\ncheckpoints = "some"\n',
            r'\[eval\]: checkpoints = "some" must be "all" or a list of training steps',
        ),
        (
            TRAINED + "[eval]\ncheckpoints = [2]\n",
            r"\[eval\]: checkpoints = \[2\]: step\(s\) 2 not kept by \[train.models.rwkv\] "
            r"\(keep_checkpoints = \[4\]\)",
        ),
        (
            TRAINED + "[eval]\ncheckpoints = [4]\ncheckpoint_windows = 0\n",
            r"\[eval\]: checkpoint_windows = 0 must be a whole number >= 1",
        ),
        (
            'run_dir = "r"\n[eval]\ncheckpoints = "all"\n[eval.models.p]\nmodel = "hf:org/p"\n',
            r"\[eval\]: checkpoints applies to the trained models",
        ),
        (
            'run_dir = "r"\n[eval.models.p]\nmodel = "hf:org/p"\ncheckpoints = [512]\n'
            "tokens_per_step = 1\n",
            r"\[eval.models.p\]: checkpoints = \[512\] must be a list of the hub model's "
            r'revisions, such as \["step512", "step1000"\]',
        ),
        (
            'run_dir = "r"\n[eval.models.p]\nmodel = "hf:org/p"\ncheckpoints = ["main"]\n'
            "tokens_per_step = 1\n",
            r'\[eval.models.p\]: checkpoints: "main" is not a training step\'s revision',
        ),
        (
            'run_dir = "r"\n[eval.models.p]\nmodel = "hf:org/p"\ncheckpoints = ["step1"]\n',
            r"\[eval.models.p\]: checkpoints needs tokens_per_step = <tokens one training step",
        ),
        (
            'run_dir = "r"\n[eval.models.p]\nmodel = "hf:org/p@step3"\ncheckpoints = ["step1"]\n'
            "tokens_per_step = 1\n",
            r'\[eval.models.p\]: model = "hf:org/p@step3" already names a revision',
        ),
    ],
)
def test_a_bad_checkpoints_value_names_its_table_and_key(tmp_path, text, message):
    with pytest.raises(BadInput, match=message):
        eval_configs(tmp_path, text)


def test_eval_flags_of_a_checkpoint_need_checkpoint_of(tmp_path):
    from pipeline.eval import EvalConfig, run_eval

    cfg = EvalConfig(model="native:x", tags="t", out=str(tmp_path / "o"), window_subset=4)
    with pytest.raises(ArSliceError, match="--window-subset describe a training checkpoint"):
        run_eval(cfg)
    cfg = EvalConfig(model="native:x", tags="t", out="o", checkpoint_of="a", window_subset=0)
    with pytest.raises(ArSliceError, match="--window-subset 0: must be at least 1"):
        run_eval(cfg)


# ---- docs/design.md's worked example -------------------------------------------------------------


def test_design_documents_worked_example(tmp_path, bpe_tokenizer):
    """Checkpoint c on a subset of one of the two windows (window 0), the final model f on both:
    recall_gain(c) = 4.0 - 3.0 = 1.0, recall_gain(f) = 3.5 - 2.0 = 1.5; no count-0 gain."""
    from ar_slicing import open_run

    run = tmp_path / "run"
    c_loss = {(0, 1): 4.0, (0, 5): 3.0, (0, 8): 3.0}
    f_loss = {(0, 1): 3.5, (0, 5): 1.5, (0, 8): 2.5}
    rows = write_run(run, TINY_DOCS, TINY_SUBSETS, TINY_COUNTS, 8, {}, bpe_tokenizer)
    keys = [(r["window_id"], r["pos"]) for r in rows]
    # f scores both windows (window 1 as badly as it likes: not compared)
    write_losses(run / "losses/f", keys, [f_loss.get(k, 9.0) for k in keys], step=6, tokens=60)
    window0 = [k for k in keys if k[0] == 0]
    write_losses(run / "losses/f@step1", window0, [c_loss.get(k, 5.0) for k in window0],
                 step=1, tokens=10, of="f", subset=1)  # fmt: skip
    frame = open_run(run).emergence(bootstrap=0)
    assert frame["checkpoint"].to_list() == ["f@step1", "f"]
    assert frame["recall_gain"].to_list() == pytest.approx([1.0, 1.5])
    assert frame["recall_gain_count0"].to_list() == [None, None]
    assert frame["n_windows"].to_list() == [1, 1] and frame["tokens_seen"].to_list() == [10, 60]
    assert frame["ppl_ar"].to_list() == pytest.approx([math.exp(3.0), math.exp(2.0)])


def add_tiny_checkpoint(run: Path) -> None:
    """A checkpoint of the tiny run's attention model (tests/queries/test_queries.py), step 1 with 10
    tokens seen, scored on a subset of one of its two windows (window 0)."""
    keys = [(0, pos) for pos in range(1, 9)]
    nll = [4.0 if pos in (5, 8) else 5.0 for _, pos in keys]
    write_losses(run / "losses/attention@step1", keys, nll, step=1, tokens=10, of="attention",
                 subset=1)  # fmt: skip


def write_losses(out: Path, keys, nll, *, step, tokens, of=None, subset=None):
    """A losses folder written by hand, its meta.json as eval writes a model's (`of`: a
    checkpoint's) with its window subset of the two windows."""
    out.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "window_id": pa.array([k[0] for k in keys], pa.int32()),
                "pos": pa.array([k[1] for k in keys], pa.int32()),
                "nll": pa.array(nll, pa.float32()),
            },
            schema=LOSS_SCHEMA,
        ),
        out / "losses-00000.parquet",
    )
    extra = {"checkpoint_of": of, "window_subset": subset} if of else {}
    write_meta(
        out,
        build_meta(
            "eval", config={}, inputs={}, counts={}, wall_time_s=0, name=out.name,
            spec=f"native:{out.name}", architecture="attention", tokens=len(keys),
            window=8, windows_total=2, windows_evaluated=1 if subset else 2, partial=False,
            step=step, tokens_seen=tokens, **extra,
        ),
    )  # fmt: skip
