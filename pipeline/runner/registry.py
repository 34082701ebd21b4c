"""Every `arslice` subcommand, by name, and the module declaring it (its `COMMAND`).

The pipeline stages are those whose COMMAND has `pipeline` wiring (`pipeline.wiring`), in the
order listed here; each runs after the stages that write what it reads. `arslice --help`,
`arslice run --stage`, the config file's tables and the Makefile's stage rules all come from
here and the declarations, so **a new stage is one module and one line below**. A module is
imported only when its command is chosen (or when all of them are listed).
"""

from __future__ import annotations

import importlib

from ar_slicing.errors import ArSliceError

MODULES: dict[str, str] = {
    "train-tokenizer": "pipeline.train_tokenizer",
    "tokenize": "pipeline.tokenize",
    "count": "pipeline.count",
    "tag": "pipeline.tag",
    "train": "pipeline.train",
    "eval": "pipeline.eval",
    "probe": "pipeline.probe",
    "report": "pipeline.report",
    "query": "pipeline.query",
    "verify": "pipeline.verify",
    "mqar": "pipeline.mqar",
    "export-models": "pipeline.export_models",
    "run": "pipeline.runner.run",
}


def command(name: str):
    """The `Command` the subcommand `name` declares."""
    module_name = MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise ArSliceError(f"arslice {name}: module {module_name} is not installed") from None
        raise
    return module.COMMAND


def commands() -> dict:
    """Every subcommand's `Command`, by name, in the order listed."""
    return {name: command(name) for name in MODULES}


def pipeline_stages() -> dict:
    """The pipeline stages' commands by stage name (their table), in running order."""
    stages = {c.pipeline.table: c for c in commands().values() if c.pipeline is not None}
    for name, stage in stages.items():  # the order listed must let each read what it needs
        later = [s for s in list(stages)[list(stages).index(name) :] if s in after(stage, stages)]
        if later:
            raise ArSliceError(f"stage {name} reads what {', '.join(later)} writes: list it later")
    return stages


def after(stage, stages: dict) -> list[str]:
    """The stages of `stages` that write what `stage` reads (its make rule depends on them)."""
    reads = {o.name for o in stage.pipeline.reads}
    return [name for name, s in stages.items() if s.pipeline.writes.name in reads]


def stage_names() -> list[str]:
    """`arslice run --stage`'s choices, in running order."""
    return list(pipeline_stages())
