"""`arslice run`: the pipeline-config glue, the shipped configs, and a small real run of every stage."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import read_json
from models.checkpoints.registry import ModelSpec
from pipeline.config import printing_summaries
from pipeline.runner.config_file import (
    dumps_toml,
    load_pipeline_config,
    resolve_placeholders,
    stdlib_dir,
    torch_dir,
)
from pipeline.runner.registry import stage_names
from pipeline.runner.run import RunConfig, run_pipeline
from pipeline.runner.stages_run import Pipeline
from tests import REPO
from tests.conftest import small_pipeline_config

STAGES = stage_names()

CONFIGS = REPO / "pipeline" / "configs"


# ---- reading and writing configs ----------------------------------------------------------------


def test_placeholders_are_resolved_everywhere_and_other_braces_kept():
    value = {"a": ["{run_dir}/x", {"b": "{stdlib}"}], "c": "{other} {run_dir}", "d": 3}
    out = resolve_placeholders(value, {"run_dir": "runs/r", "stdlib": "/lib"})
    assert out == {"a": ["runs/r/x", {"b": "/lib"}], "c": "{other} runs/r", "d": 3}


def test_load_resolves_run_dir_and_stdlib(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        'run_dir = "{stdlib}-x"\n[tag]\nout = "{run_dir}/t"\n[tokenize]\nsource = ["{stdlib}"]\n'
    )
    loaded = load_pipeline_config(cfg)
    assert loaded["run_dir"] == stdlib_dir() + "-x"
    assert loaded["tag"]["out"] == stdlib_dir() + "-x/t"
    assert loaded["tokenize"]["source"] == [stdlib_dir()]


def test_torch_placeholder_names_the_pinned_release_and_refuses_another(tmp_path, monkeypatch):
    import importlib.metadata

    from pipeline.runner.config_file import TORCH_CORPUS_VERSION

    # the release `make install` pins is the one the corpus names
    assert f"torch=={TORCH_CORPUS_VERSION}" in (REPO / "Makefile").read_text()
    cfg = tmp_path / "p.toml"
    cfg.write_text('run_dir = "r"\n[tokenize]\nsource = ["{torch}"]\n')
    installed = importlib.metadata.version
    if installed("torch").split("+")[0] == TORCH_CORPUS_VERSION:
        source = load_pipeline_config(cfg)["tokenize"]["source"][0]
        assert source == torch_dir() and (Path(source) / "nn" / "modules" / "linear.py").is_file()

    def other_release(name):
        return "2.12.1+cu126" if name == "torch" else installed(name)

    monkeypatch.setattr(importlib.metadata, "version", other_release)
    with pytest.raises(BadInput) as err:
        load_pipeline_config(cfg)
    message = str(err.value)
    assert str(cfg) in message and "this environment has torch 2.12.1+cu126" in message
    assert f"pip install torch=={TORCH_CORPUS_VERSION}" in message
    # a config that does not read torch's sources does not care which torch is installed
    plain = tmp_path / "plain.toml"
    plain.write_text('run_dir = "r"\n[tokenize]\nsource = ["{stdlib}"]\n')
    assert load_pipeline_config(plain)["tokenize"]["source"] == [stdlib_dir()]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[tag]\nwindow = 3\n", "run_dir"),
        ('run_dir = "r"\n[tags]\nwindow = 3\n', "unknown top-level key.*tags"),
        ('run_dir = "r"\ntag = 3\n', "`tag` must be a table"),
        ('run_dir = "r"\n[tag\n', "not valid TOML"),
    ],
)
def test_bad_configs_are_refused_naming_the_file(tmp_path, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(BadInput, match=message) as err:
        load_pipeline_config(cfg)
    assert str(cfg) in str(err.value)
    with pytest.raises(BadInput, match="no such file"):
        load_pipeline_config(tmp_path / "missing.toml")


toml_keys = st.text(min_size=1, max_size=8)
toml_scalars = (
    st.text(max_size=12)
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
)
toml_values = toml_scalars | st.lists(toml_scalars, max_size=4)
toml_tables = st.recursive(
    st.dictionaries(toml_keys, toml_values, max_size=4),
    lambda inner: st.dictionaries(toml_keys, toml_values | inner, max_size=4),
    max_leaves=12,
)


@given(toml_tables)
@settings(max_examples=200, deadline=None)
def test_dumps_toml_round_trips_through_tomllib(table):
    assert tomllib.loads(dumps_toml(table)) == table


def test_dumps_toml_leaves_none_out():
    assert tomllib.loads(dumps_toml({"a": None, "b": {"c": None, "d": 1}})) == {"b": {"d": 1}}
    assert math.isinf(tomllib.loads(dumps_toml({"x": float("-inf")}))["x"])


# ---- the shipped configs build valid stage configs ---------------------------------------------


def shipped(name: str) -> Pipeline:
    path = CONFIGS / name
    return Pipeline(path, load_pipeline_config(path))


def stdlib_corpus(files: list[str]) -> None:
    """The standard library's own modules and packages, never site-packages, a test suite or a
    package some distributions split off."""
    assert len(files) > 300 and "asyncio/base_events.py" in files and "os.py" in files
    banned = ("site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter")
    assert not [f for f in files if set(f.split("/")[:-1]) & set(banned)]


def torch_corpus(files: list[str]) -> None:
    """torch's own library code, never the one file that differs between its builds
    (version.py), its test harnesses, vendored code or generated pattern tables."""
    assert len(files) > 1200 and "nn/modules/linear.py" in files and "_tensor.py" in files
    assert "_dynamo/variables/builder.py" in files and "_inductor/codegen/triton.py" in files
    assert "version.py" not in files
    left_out = ("testing", "_vendor", "sparse", "utils")  # torch's own top-level packages
    assert not [f for f in files if f.split("/")[0] in left_out]
    assert not [f for f in files if "serialized_patterns" in f.split("/")]


# config -> (its run folder, its attention model, its corpus root, what its corpus is)
DEMOS = {
    # the demo: its attention is the recipe its sweep picks
    "demo.toml": ("runs/demo", "transformer_pp", torch_dir, torch_corpus),
    "demo-stdlib.toml": ("runs/demo-stdlib", "attention", stdlib_dir, stdlib_corpus),
}


# the paper's other Table 1 rows, which only the torch demo trains
PAPER_ROWS_TOO = {"demo.toml": ["h3", "long_conv", "retnet"]}


@pytest.mark.parametrize("config", DEMOS)
def test_demo_config_builds_every_stage_and_matches_the_makefile(config):
    from models.backbone import LanguageModel
    from pipeline.train import BatchOrder, model_config_for

    run, attention, corpus_root, corpus = DEMOS[config]
    p = shipped(config)
    assert p.run_dir == Path(run)
    tok = p.stages["tokenizer"].config_cls
    assert tok.__name__ == "TrainTokenizerConfig"
    parts = p.configs("tokenize")
    assert {k: (c.split_part, c.out) for k, c in parts.items()} == {
        "train": ("train", f"{run}/tokens/train"),
        "val": ("val", f"{run}/tokens/val"),
    }
    assert (
        parts["train"].source == [corpus_root()]
        and parts["train"].tokenizer == f"{run}/tokenizer.json"
    )
    # the tokenizer learns from exactly the training store's corpus
    tok_cfg = p.configs("tokenizer")["tokenizer"]
    assert (tok_cfg.source, tok_cfg.glob, tok_cfg.split_fraction, tok_cfg.split_part) == (
        parts["train"].source,
        parts["train"].glob,
        parts["train"].split_fraction,
        "train",
    )
    from ar_slicing.data.readers import DirectoryReader

    corpus([rel for rel, _ in DirectoryReader(Path(corpus_root()), parts["train"].glob).files()])
    assert p.configs("count")["count"].tokens == [f"{run}/tokens/train"]
    tag = p.configs("tag")["tag"]
    assert (tag.tokens, tag.counts, tag.out) == (
        f"{run}/tokens/val",
        f"{run}/counts",
        f"{run}/tags",
    )

    from ar_slicing.analysis.seeds import recipe_of

    every = p.configs("train")
    trains = {n: c for n, c in every.items() if recipe_of(n) == n}  # one run of each recipe
    # the paper's Table 1 rows (the torch demo's H3 and Long Conv too), one model each
    rows = [attention, "base_conv", "hyena", "rwkv", *PAPER_ROWS_TOO.get(config, [])]
    assert sorted(trains) == sorted(rows)
    assert {c.arch for c in trains.values()} == set(trains)
    # the same training tokens in the same order for every architecture
    orders = {
        BatchOrder(10**6, c.seq_len, c.batch_size, c.seed).digest(c.steps) for c in trains.values()
    }
    assert len(orders) == 1
    # the other runs of a recipe: its settings from another seed
    same = ("arch", "lr", "steps", "seq_len", "batch_size", "d_model", "n_layers",
            "mixer_options", "model_options", "warmup_steps", "saved_dtype", "threads")  # fmt: skip
    for name, c in every.items():
        base = trains[recipe_of(name)]
        assert all(getattr(c, k) == getattr(base, k) for k in same), name
        assert (c.seed != base.seed) == (c is not base), name
    assert all(c.seq_len == tag.window for c in trains.values())  # eval windows fit the models
    # about the same parameter count (within 10% of their mean)
    vocab = 2048
    sizes = {n: LanguageModel(model_config_for(c, vocab)).num_params() for n, c in trains.items()}
    mean = sum(sizes.values()) / len(sizes)
    assert all(abs(s - mean) / mean < 0.10 for s in sizes.values()), sizes

    evals = p.configs("eval")
    # every trained model, and every checkpoint it keeps, from its folder in the run
    models = {n: f"native:{run}/models/{n}" for n in every}
    kept = {
        f"{n}@step{k}": f"{models[n]}/checkpoints/step-{k}"
        for n, c in every.items()
        for k in c.keep_checkpoints
    }
    assert {n: c.model for n, c in evals.items()} == {**models, **kept}
    assert p.configs("report")["report"].reference == attention

    # the Makefile's RUN (sed over `run_dir = "..."`) names the same directory; make passes the
    # config as one shell word (a path with spaces stays one argument)
    out = subprocess.run(
        ["make", "-n", "-B", "tokenizer", f"CONFIG=pipeline/configs/{config}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (
        f"arslice run --config 'pipeline/configs/{config}'" in out.stdout
        and "--stage tokenizer" in out.stdout
    )


def test_the_sweep_trains_each_demo_model_at_three_rates_and_nothing_else_differs():
    from dataclasses import replace

    demo, sweep = shipped("demo.toml"), shipped("demo-sweep.toml")
    for stage in ("tokenizer", "tokenize", "count", "tag", "eval"):
        assert sweep.table(stage) == demo.table(stage), stage
    # the same training but its length: the sweep trains a quarter of the demo's steps, and
    # keeps and ships nothing
    own = {"models", "steps", "keep_checkpoints", "saved_dtype", "prebuilt", "train_here_until"}
    settings = {k: v for k, v in demo.table("train").items() if k not in own}
    assert {k: v for k, v in sweep.table("train").items() if k not in own} == settings
    assert 4 * sweep.table("train")["steps"] == demo.table("train")["steps"]
    swept = sweep.configs("train")
    rates = {0.001: "1e-3", 0.003: "3e-3", 0.01: "1e-2"}
    from ar_slicing.analysis.seeds import recipe_of

    for name, chosen in demo.configs("train").items():
        if recipe_of(name) != name:  # another seed of a recipe swept below
            continue
        runs = {lr: swept[f"{name}-lr{tag}"] for lr, tag in rates.items()}
        # the same model at each rate, and the demo's rate is one of them
        paths = dict(out=chosen.out, tokens=chosen.tokens, val_tokens=chosen.val_tokens)
        paths.update({k: getattr(chosen, k) for k in own - {"models"}})
        assert all(replace(c, lr=chosen.lr, **paths) == chosen for c in runs.values())
        assert chosen.lr in runs
    # both attention recipes, at the same size, and every other row of the paper's Table 1
    assert {c.arch for c in swept.values()} == {
        "attention",
        "transformer_pp",
        "base_conv",
        "hyena",
        "rwkv",
        "h3",
        "long_conv",
        "retnet",
    }
    assert len(swept) == 24


@pytest.mark.parametrize(
    "name, reference",
    [
        ("pile-gpt2.toml", "gpt-neo-125m"),
        ("pile-neox.toml", "pythia-160m"),
        ("pile-hazy.toml", "attn-1b"),
        ("pile-pythia-emergence.toml", "pythia-160m"),
        ("pile-mamba2.toml", "transformerpp-2.7b"),
        ("pile-jrt.toml", "attn-1b-50b"),
    ],
)
def test_pile_configs_build_every_stage(name, reference):
    p = shipped(name)
    assert "pretrained" in p.table("tokenizer")
    parts = p.configs("tokenize")
    assert parts["train"].source != parts["val"].source
    assert all(c.tokenizer == f"{p.run_dir}/tokenizer.json" for c in parts.values())
    tag = p.configs("tag")["tag"]
    assert (tag.window, tag.threshold) == (2048, 1250)
    p.configs("count")["count"]
    assert p.configs("train") == {}
    evals = p.configs("eval")
    assert reference in evals and p.configs("report")["report"].reference == reference
    assert all(c.out == f"{p.run_dir}/losses/{n}" and c.name == n for n, c in evals.items())
    for c in evals.values():
        ModelSpec.parse(c.model)  # a known loader prefix


def test_gpt2_config_evaluates_the_papers_h3_row_beside_attention_and_hyena():
    evals = {n: c.model for n, c in shipped("pile-gpt2.toml").configs("eval").items()}
    assert evals["h3-125m"] == "h3:danfu09/H3-125M" and evals["h3-355m"] == "h3:danfu09/H3-355M"
    assert evals["gpt-neo-125m"].startswith("hf:") and evals["hyena-153m"].startswith("safari:")


def test_hazy_config_evaluates_the_whole_suite():
    """The based README's ids today: attention, Based and Mamba at both scales."""
    p = shipped("pile-hazy.toml")
    assert p.table("tokenizer")["pretrained"] == "gpt2"
    assert {n: c.model for n, c in p.configs("eval").items()} == {
        f"{arch}-{size}": f"based:hazyresearch/{arch}-{size}"
        for arch in ("attn", "based", "mamba")
        for size in ("360m", "1b")
    }


def test_jrt_config_evaluates_the_jrt_suite_on_the_same_windows():
    p = shipped("pile-jrt.toml")
    assert p.table("tokenizer")["pretrained"] == "gpt2"
    models = {n: c.model.removeprefix("based:hazyresearch/") for n, c in p.configs("eval").items()}
    assert models == {
        "attn-1b-50b": "attn-1b-50bn", "JRT-1B-50B": "JRT-1B-50B", "based-1b-50b": "based-1b-50b",
        "mamba-1b-50b": "mamba-1b-50b", "attn-360M-30B": "attn-360M-30B",
        "JRT-360M-30B": "JRT-360M-30B", "mamba-360M-30B": "mamba-360M-30B",
    }  # fmt: skip
    # JRT's prefix costs ~500x a window: every model scores the same first windows
    assert {c.max_windows for c in p.configs("eval").values()} == {1000}
    # the same data as pile-hazy.toml
    hazy = shipped("pile-hazy.toml")
    for stage in ("tokenize", "count", "tag"):
        assert p.configs(stage).keys() == hazy.configs(stage).keys()


def test_mamba2_config_compares_the_same_data_suite_with_pythia_and_mamba():
    p = shipped("pile-mamba2.toml")
    assert {n: c.model for n, c in p.configs("eval").items()} == {
        "transformerpp-2.7b": "hf:state-spaces/transformerpp-2.7b",
        "mamba2-2.7b": "hf:state-spaces/mamba2-2.7b",
        "mamba2attn-2.7b": "hf:state-spaces/mamba2attn-2.7b",
        "pythia-2.8b": "hf:EleutherAI/pythia-2.8b",
        "mamba-2.8b": "hf:state-spaces/mamba-2.8b-hf",
    }
    # Pythia's data and NeoX tokenizer, as pile-neox.toml reads them
    neox = shipped("pile-neox.toml")
    assert p.table("tokenizer") == neox.table("tokenizer")
    for stage in ("tokenize", "count", "tag"):
        mine, theirs = p.configs(stage), neox.configs(stage)
        for name, cfg in mine.items():
            keep = {"out", "tokens", "counts", "tokenizer", "only_bigrams_of"}
            differ = {
                f.name
                for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(theirs[name], f.name) and f.name not in keep
            }
            assert not differ, (stage, name, differ)


def test_pythia_emergence_config_evaluates_ten_revisions_of_each_model():
    p = shipped("pile-pythia-emergence.toml")
    evals = p.configs("eval")
    steps = [0, 512, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 143000]
    for size in ("160m", "410m"):
        model = f"pythia-{size}"
        assert evals[model].model == f"hf:EleutherAI/pythia-{size}"
        assert evals[model].checkpoint_of is None and evals[model].window_subset is None
        points = {n: c for n, c in evals.items() if c.checkpoint_of == model}
        assert sorted(c.step for c in points.values()) == steps
        for step in steps:
            c = points[f"{model}@step{step}"]
            assert c.model == f"hf:EleutherAI/pythia-{size}@step{step}"
            assert c.tokens_seen == step * 1024 * 2048 and c.window_subset == 16384
    # Pythia-160M's nine PolyPythias runs, each at the same revisions: runs of its recipe
    from ar_slicing.analysis.seeds import recipe_of, seed_of

    for seed in range(1, 10):
        model = f"pythia-160m-seed{seed}"
        assert (recipe_of(model), seed_of(model)) == ("pythia-160m", seed)
        assert evals[model].model == f"hf:EleutherAI/{model}"
        points = {n: c for n, c in evals.items() if c.checkpoint_of == model}
        assert sorted(c.step for c in points.values()) == steps
        assert points[f"{model}@step512"].model == f"hf:EleutherAI/{model}@step512"
    assert len(evals) == 2 * 11 + 9 * 11
    # the same data as pile-neox.toml
    neox = shipped("pile-neox.toml")
    for stage in ("tokenize", "count", "tag"):
        mine, theirs = p.configs(stage), neox.configs(stage)
        for name, cfg in mine.items():
            keep = {"out", "tokens", "counts", "tokenizer", "only_bigrams_of"}
            differ = {
                f.name
                for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(theirs[name], f.name) and f.name not in keep
            }
            assert not differ, (stage, name, differ)


def test_tokenizer_reads_the_training_corpus_unless_it_names_its_own(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        'run_dir = "r"\n[tokenizer]\nvocab_size = 300\n'
        '[tokenize]\nsource = ["a", "b"]\nglob = ["*.py", "x/*.py"]\nsplit_fraction = 0.2\n'
        '[tokenize.train]\nglob = "*.txt"\n[tokenize.val]\nmax_docs = 3\n'
    )
    tok = Pipeline(cfg, load_pipeline_config(cfg)).configs("tokenizer")["tokenizer"]
    assert (tok.source, tok.glob, tok.split_fraction, tok.split_part, tok.max_docs) == (
        ["a", "b"],
        ["*.txt"],
        0.2,
        "train",
        None,
    )
    cfg.write_text(
        'run_dir = "r"\n[tokenizer]\nvocab_size = 300\nsource = ["c"]\n'
        '[tokenize]\nsource = ["a"]\nglob = "*.py"\nsplit_fraction = 0.2\n'
    )
    tok = Pipeline(cfg, load_pipeline_config(cfg)).configs("tokenizer")["tokenizer"]
    assert (tok.source, tok.glob, tok.split_fraction) == (["c"], ["**/*.txt"], None)


def test_unknown_stage_keys_name_the_table(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('run_dir = "r"\n[tag]\nwindw = 8\n')
    p = Pipeline(cfg, load_pipeline_config(cfg))
    with pytest.raises(ArSliceError, match=r"\[tag\].*windw"):
        p.configs("tag")["tag"]
    cfg.write_text('run_dir = "r"\n[train]\nsteps = 3\n')
    with pytest.raises(BadInput, match=r"\[train.models.<name>\]"):
        Pipeline(cfg, load_pipeline_config(cfg)).configs("train")
    cfg.write_text('run_dir = "r"\n[eval.models.x]\ndevice = "cpu"\n')
    with pytest.raises(
        BadInput,
        match=r"needs `model.*\(hf:\.\.\., zoology:\.\.\., .*native:\.\.\.(, [a-z0-9]+:\.\.\.)*\)",
    ):
        Pipeline(cfg, load_pipeline_config(cfg)).configs("eval")


# ---- a small real run of every stage -----------------------------------------------------------


def test_every_stage_runs_writes_its_markers_and_reruns_skip(tmp_path, capsys):
    cfg = tmp_path / "small.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run_dir = tmp_path / "run"
    with printing_summaries():  # what `arslice run` wraps it in
        result = run_pipeline(RunConfig(config=str(cfg)))
    assert list(result["wall_time_s"]) == list(STAGES)

    markers = [
        "tokenizer.json",
        "tokens/train/meta.json",
        "tokens/val/meta.json",
        "counts/meta.json",
        "tags/meta.json",
        "models/meta.json",
        "losses/meta.json",
        "report/meta.json",
        "report/report.html",
    ]
    assert all((run_dir / m).is_file() for m in markers)
    # the resolved config: placeholders filled, otherwise the file as written
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert written == load_pipeline_config(cfg) and written["tokenize"]["source"] == [stdlib_dir()]
    # stage fields reached the stages
    assert read_json(run_dir / "tags/meta.json")["window"] == 32
    models = read_json(run_dir / "models/meta.json")["models"]
    assert sorted(models) == ["attention", "base_conv"]
    assert models["attention"]["spec"] == f"native:{run_dir}/models/attention"
    # how many passes over the training store each model made: steps x batch / rows
    attention = read_json(run_dir / "models/attention/meta.json")
    rows = attention["counts"]["rows_per_epoch"]
    assert models["attention"]["epochs"] == attention["epochs"] == pytest.approx(3 * 4 / rows)
    digests = {
        read_json(run_dir / "models" / n / "meta.json")["batch_order_digest"] for n in models
    }
    assert len(digests) == 1
    losses = read_json(run_dir / "losses/meta.json")["losses"]
    assert sorted(losses) == ["attention", "base_conv"]
    assert all(
        v["tokens"] == read_json(run_dir / "tags/meta.json")["counts"]["tokens"]
        for v in losses.values()
    )
    out = capsys.readouterr().out
    assert f"report: {(run_dir / 'report' / 'report.html').resolve()}" in out

    # a rerun skips every stage and leaves the outputs as they were (a skipped stage's meta.json
    # is touched, so make sees it up to date, but not rewritten)
    weights = run_dir / "models/attention/model.safetensors"
    data = [weights, *sorted((run_dir / "tags").glob("tags-*.parquet")), run_dir / "tokenizer.json"]
    before = {p: p.stat().st_mtime_ns for p in data}
    metas = {p: p.read_bytes() for p in run_dir.glob("*/meta.json")}
    run_pipeline(RunConfig(config=str(cfg)))
    assert capsys.readouterr().out == ""  # from Python: nothing printed on the way
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert {p: p.read_bytes() for p in metas} == metas
    with printing_summaries():
        run_pipeline(RunConfig(config=str(cfg)))
    out = capsys.readouterr().out
    assert "skipped" in out and out.startswith(f"[1/{len(STAGES)}] tokenizer\n")
    # every stage's skip in the one wording, naming its output
    said = [line for line in out.splitlines() if " is complete" in line]
    labels = ["train-tokenizer", "tokenize", "tokenize", "count", "tag", "train attention",
              "train base_conv", "eval attention", "eval base_conv", "probe attention",
              "probe base_conv", "report"]  # fmt: skip
    assert [line.split(": ")[0] for line in said] == labels, said
    assert all(
        re.fullmatch(
            r"[\w -]+: \S+ is complete( \([^)]*\))?; skipped \(--overwrite to redo\)", line
        )
        for line in said
    ), said
    before[run_dir / "tags/meta.json"] = (run_dir / "tags/meta.json").stat().st_mtime_ns

    # --overwrite on one stage redoes that stage only
    run_pipeline(RunConfig(config=str(cfg), stage=["tag"], overwrite=True))
    assert (run_dir / "tags/meta.json").stat().st_mtime_ns != before[run_dir / "tags/meta.json"]
    assert weights.stat().st_mtime_ns == before[weights]


def test_models_trained_side_by_side_are_the_ones_trained_in_turn(tmp_path, capsys):
    cfg = tmp_path / "small.toml"
    cfg.write_text(small_pipeline_config(tmp_path))
    run_dir = tmp_path / "run"
    run_pipeline(RunConfig(config=str(cfg), stage=["tokenizer", "tokenize", "train"]))
    weights = {
        n: (run_dir / "models" / n / "model.safetensors").read_bytes()
        for n in ("attention", "base_conv")
    }
    cfg.write_text(small_pipeline_config(tmp_path, train="side_by_side = 2"))
    with printing_summaries():  # (what arslice wraps a command in; the workers print too)
        run_pipeline(RunConfig(config=str(cfg), stage=["train"], overwrite=True))
    out = capsys.readouterr().out
    assert "2 models, 2 side by side" in out
    for name, before in weights.items():
        assert (run_dir / "models" / name / "model.safetensors").read_bytes() == before, name
    # a failing model fails the stage
    cfg.write_text(
        small_pipeline_config(
            tmp_path, train="side_by_side = 2", **{"train.models.base_conv": "lr = 1e9"}
        )
    )
    with pytest.raises(ArSliceError, match="loss became"):
        run_pipeline(RunConfig(config=str(cfg), stage=["train"], overwrite=True))
    cfg.write_text(small_pipeline_config(tmp_path, train="side_by_side = 0"))
    with pytest.raises(BadInput, match="side_by_side = 0"):
        run_pipeline(RunConfig(config=str(cfg), stage=["train"]))


def test_pretrained_tokenizer_is_copied(tmp_path, bpe_tokenizer_path, bpe_tokenizer):
    from ar_slicing.data.tokenizer import fingerprint, load_tokenizer

    cfg = tmp_path / "p.toml"
    cfg.write_text(
        f'run_dir = "{tmp_path}/run"\n[tokenizer]\npretrained = "{bpe_tokenizer_path}"\n'
    )
    run_pipeline(RunConfig(config=str(cfg), stage=["tokenizer"]))
    assert fingerprint(load_tokenizer(tmp_path / "run" / "tokenizer.json")) == fingerprint(
        bpe_tokenizer
    )
    cfg.write_text(f'run_dir = "{tmp_path}/run"\n[tokenizer]\npretrained = "x"\nvocab_size = 3\n')
    with pytest.raises(BadInput, match="vocab_size cannot be used"):
        run_pipeline(RunConfig(config=str(cfg), stage=["tokenizer"], overwrite=True))
