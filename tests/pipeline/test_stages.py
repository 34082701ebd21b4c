"""The stages' declarations: everything `arslice run`, `make` and `arslice --help` know of a stage
comes from its own module, so a new stage is one file and one line of the registry."""

from __future__ import annotations

import textwrap

import pytest

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import RunLayout
from pipeline.runner import registry
from tests.reliability import tiny_run  # noqa: F401  (a fixture)

# A whole new stage, in one file: it counts the run's tagged tokens, times `scale`.
TOY_STAGE = '''
"""`arslice summary`: a toy stage, the run's tagged tokens times a scale."""

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import Command
from pipeline.wiring import TAGS, Output, Wiring

SUMMARY = Output("summary", lambda layout: [layout.run_dir / "summary" / "meta.json"])


@dataclass(frozen=True)
class SummaryConfig:
    tags: str = field(metadata={"help": "the tags folder"})
    out: str = field(metadata={"help": "the output folder"})
    scale: int = field(default=1, metadata={"help": "what the count is multiplied by"})
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output"})


def summary_settings(cfg):
    return {"scale": cfg.scale}


def run_summary(cfg):
    from ar_slicing.machinery.io import read_json, write_json_atomic
    from ar_slicing.machinery.plan import StagePlan, identity
    from pipeline.stage import Finished, Part, run_parts, run_stage

    def scaled(files):
        tokens = read_json(Path(cfg.tags) / "meta.json")["counts"]["tokens"]
        write_json_atomic(files[0], {"tokens": tokens * cfg.scale})
        return {"tokens": tokens}

    def work(stage, _):
        parts = [Part("summary", (stage.out / "summary.json",))]
        run_parts(stage, parts, lambda part: scaled(part.files))
        return Finished({"stage": "summary"})

    plan = StagePlan("summary", summary_settings(cfg), {"tags": identity(cfg.tags)})
    return run_stage("summary", cfg.out, plan, work, overwrite=cfg.overwrite)


COMMAND = Command(
    SummaryConfig,
    run_summary,
    summary="the run's tagged tokens, scaled (a toy stage)",
    examples="  arslice summary --tags runs/demo/tags --out runs/demo/summary",
    plan_settings=summary_settings,
    inputs=lambda cfg: [("--tags", cfg.tags)],
    pipeline=Wiring(
        table="summary",
        reads=(TAGS,),
        writes=SUMMARY,
        defaults=lambda run, table: {
            "tags": run.layout.tags,
            "out": run.layout.run_dir / "summary",
        },
    ),
)
'''


@pytest.fixture
def toy_stage(tmp_path, monkeypatch):
    (tmp_path / "toy_stage.py").write_text(TOY_STAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.MODULES, "summary", "toy_stage")  # the one line


def test_a_new_stage_is_one_module_and_one_line(toy_stage, tiny_run, tmp_path, capsys):  # noqa: F811
    from pipeline.cli import main, top_level_help
    from pipeline.runner.make_rules import make_rules
    from pipeline.runner.run import RunConfig, run_pipeline

    # arslice --help lists it, with its summary; it is a subcommand with its own --help
    assert "  summary          the run's tagged tokens, scaled (a toy stage)" in top_level_help()
    with pytest.raises(SystemExit) as done:
        main(["summary", "--help"])
    assert done.value.code == 0 and "--scale" in capsys.readouterr().out
    # a pipeline stage, after the stage whose output it reads
    assert registry.stage_names()[-1] == "summary"
    stages = registry.pipeline_stages()
    assert registry.after(stages["summary"], stages) == ["tag"]

    # its table is allowed in a config file, its defaults come from the run layout
    run = tmp_path / "run"
    tags = tiny_run["run"] / "tags"
    config = tmp_path / "c.toml"
    config.write_text(f'run_dir = "{run}"\n[summary]\ntags = "{tags}"\nscale = 2\n')
    result = run_pipeline(RunConfig(config=str(config), stage=["summary"]))
    tokens = read_json(tags / "meta.json")["counts"]["tokens"]
    assert read_json(run / "summary" / "summary.json") == {"tokens": 2 * tokens}
    assert read_json(run / "summary" / "meta.json")["written"] == {
        "summary.json": (run / "summary" / "summary.json").stat().st_size
    }
    assert list(result["wall_time_s"]) == ["summary"]
    # the Makefile's rules name its marker and depend on what it reads
    rules = (run / ".settings" / "stages.mk").read_text()
    assert rules == make_rules(RunLayout(run))
    assert f"MARK_summary := {run}/summary/meta.json" in rules
    assert f"{run}/summary/meta.json: {run}/.settings/summary.json {run}/tags/meta.json" in rules

    # a rerun skips it; other settings are refused before anything runs, naming them
    run_pipeline(RunConfig(config=str(config), stage=["summary"]))
    config.write_text(f'run_dir = "{run}"\n[summary]\ntags = "{tags}"\nscale = 3\n')
    with pytest.raises(ArSliceError, match=r"\[summary\](?s:.*)settings.scale: 2 -> 3"):
        run_pipeline(RunConfig(config=str(config), stage=["summary"]))
    run_pipeline(RunConfig(config=str(config), stage=["summary"], overwrite=True))
    assert read_json(run / "summary" / "summary.json") == {"tokens": 3 * tokens}


def test_every_stage_reads_only_what_an_earlier_stage_writes():
    stages = registry.pipeline_stages()
    names = list(stages)
    assert names == ["tokenizer", "tokenize", "count", "tag", "train", "eval", "probe", "report"]
    for name, stage in stages.items():
        assert all(names.index(b) < names.index(name) for b in registry.after(stage, stages))
    assert {n: registry.after(s, stages) for n, s in stages.items()} == {
        "tokenizer": [],
        "tokenize": ["tokenizer"],
        "count": ["tokenize"],
        "tag": ["tokenize", "count"],
        "train": ["tokenize"],
        "eval": ["tag", "train"],
        "probe": ["tag", "train", "eval"],
        "report": ["tag", "eval", "probe"],
    }


def test_a_stage_listed_before_what_it_reads_is_refused(toy_stage, monkeypatch):
    modules = {"summary": "toy_stage", **registry.MODULES}  # first: before the tags it reads
    monkeypatch.setattr(registry, "MODULES", modules)
    with pytest.raises(ArSliceError, match="stage summary reads what tag writes: list it later"):
        registry.pipeline_stages()


def test_the_make_rules_are_the_ones_the_stage_table_gave(tmp_path):
    """The rules derived from the declarations name the same markers and dependencies as the
    hand-written stage table did."""
    from pipeline.runner.make_rules import make_rules

    run = tmp_path / "r"
    body = make_rules(RunLayout(run)).split("\n\n", 1)[1]
    expected = textwrap.dedent(f"""\
        MARK_tokenizer := {run}/tokenizer.json
        MARK_tokenize := {run}/tokens/train/meta.json {run}/tokens/val/meta.json
        MARK_count := {run}/counts/meta.json
        MARK_tag := {run}/tags/meta.json
        MARK_train := {run}/models/meta.json
        MARK_eval := {run}/losses/meta.json
        MARK_probe := {run}/probes/meta.json
        MARK_report := {run}/report/meta.json
        """)
    assert body.startswith(expected)
    assert (
        f"{run}/tags/meta.json: {run}/.settings/tag.json {run}/tokens/train/meta.json "
        f"{run}/tokens/val/meta.json {run}/counts/meta.json\n\t$(STAGE) tag\n"
    ) in body
    assert (
        f"{run}/tokens/train/meta.json {run}/tokens/val/meta.json &: "
        f"{run}/.settings/tokenize.json {run}/tokenizer.json\n\t$(STAGE) tokenize\n"
    ) in body


def test_reading_the_declarations_imports_no_heavy_library():
    """`arslice --help` imports every stage module for its summary: each keeps torch,
    transformers, tokenizers, pyarrow, duckdb, polars and matplotlib inside the functions that
    use them, so listing the commands stays fast."""
    import subprocess
    import sys

    heavy = {"torch", "transformers", "tokenizers", "pyarrow", "duckdb", "polars", "matplotlib"}
    code = (
        "import sys\n"
        "from pipeline.cli import top_level_help\n"
        "top_level_help()\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
