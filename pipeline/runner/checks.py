"""What `arslice run` checks before anything runs: every stage's configs (keys, types,
values, sources, inputs, model specs, hub names), a run directory holding only the project's
files, and the complete outputs made with other settings (under the plan's own comparison)."""

from __future__ import annotations

import contextlib

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.layout import file_meta_path
from pipeline.config import missing_inputs
from pipeline.runner.registry import after
from pipeline.runner.stages_run import Pipeline, StageConfig


def check(pipeline: Pipeline, chosen: list[str] | None = None) -> dict[str, list[StageConfig]]:
    """Resolve and check the configs of every stage of the run (`Pipeline.run_stages`: what a
    whole run runs, so a run of some stages checks what the whole run would). A stage the run of
    some stages (`chosen`) does not run and the config has no table for is checked only as far
    as it would run with its defaults: one that would not (its table is needed, or what it reads
    comes from no stage) is left out, so a config for some stages still runs them. Returns the
    configs by stage; refuses every problem found, in one message."""
    from ar_slicing.machinery import hub

    def optional(stage: str) -> bool:
        return chosen is not None and stage not in chosen and stage not in pipeline.config

    stages = pipeline.run_stages()
    problems = _Problems()
    all_configs: dict[str, list[StageConfig]] = {}
    for stage in stages:
        if optional(stage):
            try:
                all_configs[stage] = pipeline.resolve(stage)
            except ArSliceError:
                continue
        else:
            with problems.noted():
                all_configs[stage] = pipeline.resolve(stage)
    made = [str(c.output) for configs in all_configs.values() for c in configs]
    for stage in [s for s in all_configs if optional(s)]:
        if any(_problems_of(c, made) for c in all_configs[stage]):
            del all_configs[stage]
    made = [str(c.output) for configs in all_configs.values() for c in configs]
    refused = [s for s in stages if s not in all_configs and not optional(s)]
    for c in (c for configs in all_configs.values() for c in configs):
        table = f"{pipeline.config_path} {c.context}"
        with problems.noted(table):
            if c.command.validate is not None:
                c.command.validate(c.config)
            if set(after(pipeline.stages[c.stage], pipeline.stages)) & set(refused):
                continue  # (what it reads comes from a stage already refused: said once, there)
            problems.add(*(f"{table}: {m}" for m in missing_inputs(c.command, c.config, made)))
    with problems.noted():
        hub.require(hub_names(all_configs))
    with problems.noted():
        refuse_foreign(pipeline, all_configs)
    problems.refuse(f"{pipeline.config_path}: {{n}} problems, found before anything ran:")
    return all_configs


def _problems_of(c: StageConfig, made: list[str]) -> list[str]:
    """What refuses `c` before it runs: its validation and its missing inputs."""
    try:
        if c.command.validate is not None:
            c.command.validate(c.config)
    except ArSliceError as e:
        return [str(e)]
    return missing_inputs(c.command, c.config, made)


def hub_names(all_configs: dict[str, list[StageConfig]]) -> list[tuple[str, str, str]]:
    """What the configs name on the hub (tokenizers, models, datasets), as `hub.require` takes
    them: so an unreachable hub stops the run before anything is written."""
    return [
        name
        for configs in all_configs.values()
        for c in configs
        if c.command.hub_names is not None
        for name in c.command.hub_names(c.config, c.context)
    ]


def refuse_foreign(pipeline: Pipeline, all_configs: dict[str, list[StageConfig]]) -> None:
    """Refuse a run directory (or a stage output the configs name) holding files the project
    did not write: a run writes nowhere it could overwrite or remove a user's file."""
    from ar_slicing.machinery.ownership import ForeignFiles, foreign_in_run

    outputs, files = {}, []
    for stage, configs in all_configs.items():
        one_file = pipeline.stages[stage].pipeline.writes.single_file
        for c in configs:
            if not one_file:
                outputs[c.output] = stage
            elif c.output.exists() and not file_meta_path(c.output).is_file():
                files.append(c.output)  # a one-file output: its meta.json beside it
    found = sorted({*foreign_in_run(pipeline.layout, outputs), *files})
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ForeignFiles(
            f"{pipeline.config_path}: run_dir {pipeline.run_dir} holds {found[0]}{more}, which "
            "this project did not write; nothing was written. Point run_dir at a new folder (or "
            "one an earlier `arslice run` made), or move those files out"
        )


def conflicts(pipeline: Pipeline, chosen, all_configs: dict[str, list[StageConfig]]) -> list[str]:
    """For each chosen stage whose complete output was made with other settings than the
    config now asks for: a line per differing setting (empty when every plan agrees), compared
    as the stage's own plan check compares them (`ar_slicing.machinery.plan.settings_differences`)."""
    from ar_slicing.machinery.plan import settings_differences

    lines = []
    for stage in chosen:
        one_file = pipeline.stages[stage].pipeline.writes.single_file
        for c in all_configs[stage]:
            settings = c.command.plan_settings(c.config) if c.command.plan_settings else {}
            differ = settings_differences(c.output, settings, single_file=one_file)
            if differ:
                lines += [f"[{stage}] {c.output}:", *(f"    {d}" for d in differ)]
    return lines


class _Problems:
    """What a check found, to be refused all at once: one problem as it was raised, several as
    one message listing each (with the config table it came from)."""

    def __init__(self):
        self.found: list[tuple[str, ArSliceError]] = []

    def add(self, *messages: str) -> None:
        self.found += [(m, BadInput(m)) for m in messages]

    @contextlib.contextmanager
    def noted(self, context: str = ""):
        """Note an ArSliceError raised in the block, and go on."""
        try:
            yield
        except ArSliceError as e:
            text = str(e)
            shown = text if not context or text.startswith(context) else f"{context}: {text}"
            self.found.append((shown, e))

    def refuse(self, heading: str) -> None:
        if len(self.found) == 1:
            shown, error = self.found[0]
            if shown == str(error):
                raise error
            raise type(error)(shown) from None  # the same kind, named with its config table
        if self.found:
            raise BadInput(
                heading.format(n=len(self.found)) + "\n  " + "\n  ".join(m for m, _ in self.found)
            )
