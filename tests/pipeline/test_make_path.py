"""`make` runs what `arslice run` runs: one list decides a config's stages for both (so a config
without a `[count]` table counts through `make` too), every pipeline config the README and
docs/*.md show goes through `make`, and a run directory or a CONFIG path with spaces works (a
run_dir make cannot name is refused in one line)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from ar_slicing.machinery.io import read_json
from pipeline.runner.config_file import dumps_toml
from tests import REPO
from tests.conftest import small_pipeline_config, stdlib_files

STAGES = ["tokenizer", "tokenize", "count", "tag", "train", "eval", "probe", "report"]
NEEDS_HUB = re.compile(r"#.*\bneeds the hub", re.IGNORECASE)


def make(*targets: str, config: Path, cwd: Path = REPO, **variables: str):
    """`make TARGETS CONFIG=config` with the repository's Makefile, run in `cwd` (where the
    config's relative paths point), with this tree's code as `arslice`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    argv = ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), *targets]
    argv += [f"CONFIG={config}", f"ARSLICE={sys.executable} -m pipeline.cli"]
    argv += [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)


def stages_run(done: subprocess.CompletedProcess) -> list[str]:
    """The stages a make run started (each `arslice run --stage X` prints `[1/1] X`)."""
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("[1/1] ")]


# ---- one stage list -----------------------------------------------------------------------------


def test_a_config_without_a_count_table_runs_stage_by_stage(tmp_path):
    """`arslice run --stage tokenizer` (make's first target) checks the stages a whole run has,
    so the counts the whole run makes are not "no such file" to the tag stage's check."""
    from pipeline.runner.run import RunConfig, prepare_pipeline

    text = small_pipeline_config(tmp_path)
    assert text.count("[count]\nworkers = 1\n") == 1
    config = tmp_path / "no-count.toml"
    config.write_text(text.replace("[count]\nworkers = 1\n", ""))
    pipeline, all_configs, chosen = prepare_pipeline(RunConfig(str(config), stage=["tokenizer"]))
    assert pipeline.run_stages() == STAGES and list(all_configs) == STAGES
    assert chosen == ["tokenizer"]

    first = make("tokenizer", config=config)
    assert first.returncode == 0, first.stderr
    assert stages_run(first) == ["tokenizer"]
    counted = make("counts", config=config)
    assert counted.returncode == 0, counted.stderr
    assert stages_run(counted) == ["tokenize", "count"]
    assert read_json(tmp_path / "run" / "counts" / "meta.json")["stage"] == "count"


# ---- the configs the docs show, through make ------------------------------------------------------


def config_examples() -> list[tuple[str, str]]:
    """Every ```toml block of README.md and docs/*.md, as (FILE:LINE, text)."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "```toml":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                found.append((f"{doc.name}:{i + 2}", "\n".join(lines[i + 1 : end]) + "\n"))
    return found


EXAMPLES = config_examples()


def test_the_config_examples_are_found():
    whole = [text for _, text in EXAMPLES if "run_dir" in tomllib.loads(text)]
    assert whole and any("my-run.toml" in text for text in whole)
    assert len(EXAMPLES) >= 3


def _merged(base: dict, part: dict) -> dict:
    """`base` with the tables of `part` merged in (a key of `part` wins)."""
    out = dict(base)
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory, bpe_tokenizer_path) -> Path:
    """Where a whole config example runs: a few standard-library files for `{stdlib}` and a
    tiny transformers model `my-model/` with a tokenizer of its own (what the README's
    `my-run.toml` takes its tokenizer from and evaluates)."""
    from tests.pipeline.test_examples import _tiny_neox

    tree = tmp_path_factory.mktemp("configs")
    (tree / "stdlib").mkdir()
    for path in stdlib_files(40):
        shutil.copy(path, tree / "stdlib" / path.name)
    _tiny_neox(tree / "my-model", bpe_tokenizer_path, 1024)
    return tree


@pytest.mark.parametrize("where,text", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_config_example_runs_through_make(where, text, tiny_tree, tmp_path):
    """A whole config (it names its run_dir) runs `make all` to the report, on a few
    standard-library files for `{stdlib}`. An excerpt is merged into the config it shows a part
    of (the demo's) and goes through make's first step, the check of the whole config before
    any stage (`arslice run --make-rules`: keys, values, inputs, prebuilt models, model specs);
    one that needs the hub must fail there on its hub names only."""
    example = tomllib.loads(text)
    if "run_dir" in example:
        tree = tmp_path / "tree"
        shutil.copytree(tiny_tree, tree)
        config = tree / "example.toml"
        config.write_text(text.replace("{stdlib}", str(tree / "stdlib")))
        done = make("all", config=config, cwd=tree)
        assert done.returncode == 0, (where, done.stderr[-3000:])
        assert stages_run(done) == STAGES, where
        run = tree / example["run_dir"]
        assert (run / "report" / "report.html").is_file()
        assert read_json(run / "counts" / "meta.json")["stage"] == "count"
        return
    demo = tomllib.loads((REPO / "pipeline" / "configs" / "demo.toml").read_text())
    config = tmp_path / "example.toml"
    merged = _merged(demo, example)
    merged["run_dir"] = str(tmp_path / "run")
    merged["train"]["prebuilt"] = str(REPO / merged["train"]["prebuilt"])
    config.write_text(dumps_toml(merged))
    done = make("-n", "all", config=config)
    if NEEDS_HUB.search(text):
        assert done.returncode != 0 and "the Hugging Face hub is not reachable" in done.stderr
        assert "problems, found before anything ran" not in done.stderr, done.stderr
        return
    assert done.returncode == 0, (where, done.stderr[-3000:])
    for stage in STAGES:
        assert f"--stage {stage}" in done.stdout, (where, stage)


# ---- spaces -----------------------------------------------------------------------------------------


@pytest.mark.slow  # (~45 s: a whole small run through make)
def test_a_run_dir_and_a_config_path_with_spaces(tmp_path):
    """Before, make said "Nothing to be done" for a run_dir with spaces (and made nothing) and
    "no such file" for a CONFIG path with spaces."""
    folder = tmp_path / "my configs"
    folder.mkdir()
    config = folder / "small run.toml"
    root = tmp_path / "my runs"
    config.write_text(small_pipeline_config(root))
    first = make("all", config=config)
    assert first.returncode == 0, first.stderr
    assert stages_run(first) == STAGES
    assert (root / "run" / "report" / "report.html").is_file()
    again = make("all", config=config)
    assert again.returncode == 0 and stages_run(again) == [], again.stdout
    # make sees the stage's settings under the run_dir with spaces: an edit reruns the stage
    config.write_text(config.read_text().replace("threshold = 2", "threshold = 3"))
    redone = make("tags", config=config, OVERWRITE="1")
    assert redone.returncode == 0, redone.stderr
    assert stages_run(redone) == ["tag"]
    assert read_json(root / "run" / "tags" / "meta.json")["threshold"] == 3


@pytest.mark.parametrize("mark", [":", ";"])
def test_a_run_dir_make_cannot_name_is_refused_in_one_line(tmp_path, mark):
    config = tmp_path / "run.toml"
    root = tmp_path / f"a{mark}b"
    config.write_text(small_pipeline_config(root))
    done = make("all", config=config)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f'run_dir "{root}/run"' in lines[0], done.stderr
    assert "arslice run --config FILE" in lines[0]
    assert not root.exists()
