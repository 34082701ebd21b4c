"""`arslice run`: run the stages of a pipeline config file, in order (what `make` calls).

A pipeline config is a TOML file whose top-level `run_dir` names the run directory and whose
tables hold each stage's own config fields (the same names as its command-line flags)::

    run_dir = "runs/demo"

    [tokenizer]                 # train-tokenizer fields, or `pretrained = "gpt2"` to copy one;
    vocab_size = 4096           # it reads what [tokenize] puts in the training store unless it
                                # names its own `source` (and glob, split_fraction, ...)

    [tokenize]                  # tokenize fields shared by both stores ...
    source = ["{stdlib}"]
    [tokenize.val]              # ... and per-store overrides (tables `train` and `val`)
    max_docs = 100

    [count]
    [tag]
    window = 512

    [train]                     # train fields shared by every model ...
    steps = 600
    side_by_side = 2            # (a pipeline key) train two models at once, one process each
    prebuilt = "demo-models"    # take each model from there when it was made so (--train-here:
                                # train it here; `arslice export-models` writes such a folder)
    [train.models.attention]    # ... one table per model, keyed by its name
    arch = "attention"

    [eval]                      # eval fields shared by every model; every trained model is
    batch_size = 8              # evaluated, plus any `[eval.models.<name>]` with a `model` spec
    [eval.models.pythia-160m]
    model = "hf:EleutherAI/pythia-160m"

    [report]
    reference = "attention"

Strings may use `{run_dir}` and `{stdlib}` (this Python's standard-library directory). Paths
that follow the run layout (`ar_slicing.machinery.layout`: `tokens/train`, `counts`, `tags`,
`models/<name>`, `losses/<name>`, ...) are filled in when a table leaves them out.

Before the first stage starts, every stage's config is resolved and checked (keys, types,
choices, values, sources, model specs), and every chosen stage whose complete output was made
with other settings is named, all at once; nothing is written until all of that passes. Then
the resolved config goes to `<run_dir>/config.toml` and each stage's resolved settings to
`<run_dir>/.settings/<stage>.json` (rewritten only when they change, so the Makefile's stage
targets, which depend on them, rerun exactly the stages whose settings changed), and the
stages run. The markers over a stage of many configs are written here, under the plan like every
output: `<run_dir>/models/meta.json` (after every model is trained) and `<run_dir>/losses/meta.json`
(after every model is evaluated).

Which tables there are, what each fills in and in which order the stages run come from the
stages' own declarations (`pipeline.runner.registry`, `pipeline.wiring`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.layout import REPORT_HTML_NAME
from pipeline.config import Command, print_config, say
from pipeline.runner.checks import check, conflicts
from pipeline.runner.config_file import load_pipeline_config
from pipeline.runner.registry import stage_names
from pipeline.runner.stages_run import Pipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    config: str = field(
        metadata={"help": "pipeline config file (TOML), e.g. pipeline/configs/demo.toml"}
    )
    stage: list[str] = field(
        default_factory=stage_names,
        metadata={"help": "stages to run (always in pipeline order)", "choices": stage_names},
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "redo the chosen stages even where their outputs are complete"},
    )
    redo_changed: bool = field(
        default=False,
        metadata={
            "help": "redo the chosen stages whose settings or inputs changed instead of refusing "
            "(complete outputs of the same plan are still skipped; what `make OVERWRITE=1` passes)"
        },
    )
    train_here: bool = field(
        default=False,
        metadata={
            "help": "train every model of [train] here, taking none from a folder of prebuilt "
            "models (`prebuilt` is dropped from [train] and its model tables; what "
            "`make ... DEMO_TRAIN=1` passes)"
        },
    )
    train_missing: bool = field(
        default=False,
        metadata={
            "help": "train here only the [train] models that the folder of prebuilt models does "
            "not hold made exactly so (settings, token streams, files); the others are left out "
            "of the run: what `make demo-models` passes, so a model added to the config is "
            "trained and the folder's others are kept (the token stores must be there)"
        },
    )
    make_rules: bool = field(
        default=False,
        metadata={
            "help": "check the config, write each stage's settings and the Makefile's stage rules "
            "(<run_dir>/.settings/), and stop: what the Makefile does first"
        },
    )


def prepare_pipeline(cfg: RunConfig) -> tuple[Pipeline, dict, list[str]]:
    """The pipeline of `cfg.config`, every stage's configs checked, and the chosen stages."""
    stages = stage_names()
    unknown = sorted(set(cfg.stage) - set(stages))
    if unknown:
        raise ArSliceError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(stages)}")
    config = load_pipeline_config(cfg.config)
    if cfg.train_missing:
        from pipeline.train.prebuilt import only_models_to_make

        config = only_models_to_make(Pipeline(Path(cfg.config), config).configs("train"), config)
    if cfg.train_here or cfg.train_missing:
        from pipeline.train.prebuilt import without_prebuilt

        config = without_prebuilt(config)
    pipeline = Pipeline(Path(cfg.config), config, overwrite=cfg.overwrite)
    chosen = [s for s in pipeline.run_stages() if s in cfg.stage]
    return pipeline, check(pipeline, chosen), chosen


def run_pipeline(cfg: RunConfig) -> dict:
    """Run `cfg.stage` of the pipeline config `cfg.config`, in pipeline order."""
    from ar_slicing.machinery.io import require_writable
    from ar_slicing.machinery.ownership import output_lock
    from ar_slicing.machinery.plan import PlanMismatch, redoing_changed

    pipeline, all_configs, chosen = prepare_pipeline(cfg)
    if not (cfg.overwrite or cfg.redo_changed):
        lines = conflicts(pipeline, chosen, all_configs)
        if lines:
            raise PlanMismatch(
                f"{cfg.config}: these outputs were made with other settings than the config "
                "asks for:\n  " + "\n  ".join(lines) + "\n  pass --overwrite or --redo-changed "
                "to redo them (make: OVERWRITE=1), or restore the settings; nothing was run"
            )
    require_writable(
        pipeline.run_dir, f"{cfg.config}: run_dir {pipeline.run_dir}", "point run_dir elsewhere"
    )
    # (the run's own files; each stage locks its output itself. `make -j` runs several
    # `arslice run --stage X` at once: they wait here for each other a moment, not refuse)
    with output_lock(pipeline.run_dir, wait=True):
        changed = pipeline.write_settings(all_configs)
        if not cfg.make_rules:
            pipeline.write_resolved_config()
    if cfg.make_rules:
        if changed:
            log.info("settings changed for: %s", ", ".join(changed))
        return {"run_dir": str(pipeline.run_dir), "settings_changed": changed}
    timings = {}
    results = {}
    for k, stage in enumerate(chosen, 1):
        say(f"[{k}/{len(chosen)}] {stage}")
        t0 = time.time()
        if cfg.redo_changed:
            with redoing_changed():
                results[stage] = pipeline.run_stage(stage, all_configs[stage])
        else:
            results[stage] = pipeline.run_stage(stage, all_configs[stage])
        timings[stage] = round(time.time() - t0, 1)
        say(f"== {stage} done in {timings[stage]:.1f} s")
    if "report" in chosen:
        html = pipeline.layout.report / REPORT_HTML_NAME
        say(f"report: {html.resolve() if html.exists() else html}")
    return {"run_dir": str(pipeline.run_dir), "wall_time_s": timings, "results": results}


def dry_run(cfg: RunConfig) -> None:
    """`arslice run --dry-run`: every stage's resolved and checked configs, nothing written."""
    pipeline, all_configs, chosen = prepare_pipeline(cfg)
    for stage in chosen:
        for c in all_configs[stage]:
            print(f"# [{stage}] {c.name}")
            print_config(c.config)
    lines = conflicts(pipeline, chosen, all_configs)
    if lines:
        print(
            "# outputs made with other settings (a run would refuse them):\n# " + "\n# ".join(lines)
        )


COMMAND = Command(
    RunConfig,
    run_pipeline,
    dry_run=dry_run,
    summary="run stages of a pipeline config file (what `make` calls)",
    examples="""\
  arslice run --config pipeline/configs/demo.toml                 # every stage, skipping complete ones
  arslice run --config pipeline/configs/demo.toml --stage train eval
  arslice run --config pipeline/configs/demo.toml --dry-run       # check every stage, print the configs
  arslice run --config pipeline/configs/demo.toml --redo-changed  # redo what the config changed
  arslice run --config pipeline/configs/demo.toml --stage train --train-here  # train, take none prebuilt
  arslice run --config pipeline/configs/pile-gpt2.toml --stage report --overwrite  # needs the Pile""",
)
