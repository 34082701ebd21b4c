"""The stages of one pipeline config: each stage's configs resolved from its table by its own
declaration (`pipeline.wiring`), and run in order, one loop for every stage, with the marker over
the outputs of a stage of many configs (`models/meta.json`, `losses/meta.json`) kept under the
same plan rule as every output. `pipeline.runner.run` is the `arslice run` command over it."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import atomic_path, build_meta, read_json, write_bytes_atomic
from ar_slicing.machinery.layout import META_NAME, RunLayout
from pipeline.config import Command, config_from_mapping, config_to_dict
from pipeline.runner.config_file import dumps_toml
from pipeline.runner.registry import pipeline_stages
from pipeline.wiring import Fanned, Run


@dataclass(frozen=True)
class StageConfig:
    """One config a stage runs with, and where it came from."""

    stage: str
    name: str  # the stage's own name, a store's or a model's
    context: str  # the config table: "[tag]", "[tokenize.val]", "[train.models.x]"
    command: Command  # the stage's, or the one its table's form chose (a tokenizer to copy)
    config: Any
    output: Path  # what it writes


def build_config(
    command: Command,
    table: Mapping[str, Any],
    defaults: Mapping[str, Any],
    context: str,
    overwrite: bool,
) -> Any:
    """`command`'s config from a TOML table, filling in `defaults` the table leaves out.

    A default is only used when the stage's config has a field of that name; `overwrite` is
    forced on when the run is asked to redo the stage.
    """
    names = {f.name for f in dataclasses.fields(command.config_cls)}
    values = {k: _value(v) for k, v in defaults.items() if k in names and k not in table}
    values.update(table)
    if overwrite and "overwrite" in names:
        values["overwrite"] = True
    return config_from_mapping(command.config_cls, values, context=context)


def _value(v: Any) -> Any:
    """A default as a config-file value (a run-layout path as its string)."""
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    return v


@dataclass
class Pipeline:
    """One pipeline config file, resolved stage by stage from the stages' declarations."""

    config_path: Path
    config: dict
    overwrite: bool = False

    def __post_init__(self):
        self.stages: dict[str, Command] = pipeline_stages()

    @property
    def run_dir(self) -> Path:
        return Path(self.config["run_dir"])

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    def run_stages(self) -> list[str]:
        """The stages of this config's run, in running order: every stage, whether or not the
        config has its table (a stage without one runs with its defaults, as `[count]` left out
        of a config still counts). The one list `arslice run` (whole or stage by stage), its
        checks before anything runs and the Makefile's stage rules all take, so `make all` and
        `arslice run` run the same stages."""
        return list(self.stages)

    def table(self, stage: str) -> dict:
        return dict(self.config.get(stage, {}))

    def resolve(self, stage: str) -> list[StageConfig]:
        """Every config `stage` runs with (one, one per store, or one per model)."""
        command = self.stages[stage]
        wiring = command.pipeline
        values = {k: v for k, v in self.table(stage).items() if k not in wiring.pipeline_keys}
        run = Run(self.layout, self.config, self.config_path)
        resolved = []
        fanned = Fanned(self.config, self.config_path, self.layout, stage, values)
        for table in wiring.fan_out(fanned):
            where = f"{self.config_path} {table.context}"
            chosen = (wiring.variant(table, where) if wiring.variant else None) or command
            defaults = wiring.defaults(run, table)
            cfg = build_config(chosen, table.values, defaults, where, self.overwrite)
            resolved.append(
                StageConfig(stage, table.name, table.context, chosen, cfg, wiring.output_of(cfg))
            )
        return resolved

    def configs(self, stage: str) -> dict[str, Any]:
        """The configs of `stage` by name."""
        return {c.name: c.config for c in self.resolve(stage)}

    # -- running -----------------------------------------------------------------------------

    def run_stage(self, stage: str, configs: list[StageConfig]) -> Any:
        """Run every config of `stage` (as its wiring says: one after another by default), then
        write the marker of a stage of many configs."""
        command = self.stages[stage]
        wiring = command.pipeline
        t0 = time.time()
        results = {}
        if wiring.run_all is not None:
            if configs:
                where = f"{self.config_path} [{stage}]"
                wiring.run_all(
                    command, {c.name: c.config for c in configs}, self.table(stage), where
                )
        else:
            results = {c.name: c.command.run(c.config) for c in configs}
        for c in configs:
            marker = c.output if wiring.writes.single_file else c.output / META_NAME
            if not marker.is_file():
                what = stage if c.name == stage else f"{stage} {c.name}"
                raise ArSliceError(f"{what}: finished without writing {marker}")
        if wiring.writes.root is not None:
            return self.write_marker(stage, configs, t0)
        return results[stage] if list(results) == [stage] else results

    def write_marker(self, stage: str, configs: list[StageConfig], t0: float) -> dict:
        """The meta.json over every output of a stage of many configs (every model trained,
        every model evaluated): its plan is their identities, so it is rewritten when one of
        them is redone or added, and only touched otherwise (make then sees it up to date)."""
        from ar_slicing.machinery.plan import StagePlan, identity, open_marker

        wiring = self.stages[stage].pipeline
        entries = {
            c.name: wiring.entry(c.name, c.output, read_json(c.output / META_NAME)) for c in configs
        }
        plan = StagePlan(
            f"{stage}-all", settings={}, inputs={c.name: identity(c.output) for c in configs}
        )
        marker = open_marker(wiring.writes.root(self.layout), plan)
        if marker.complete:
            marker.skip()
        else:
            with marker.running():
                meta = build_meta(
                    f"{stage}-all",
                    config={c.name: config_to_dict(c.config) for c in configs},
                    inputs={"config": str(self.config_path)},
                    counts={"models": len(configs)},
                    wall_time_s=time.time() - t0,
                    **{wiring.writes.name: entries},
                )
                marker.finish(meta)
        return {wiring.writes.name: entries}

    # -- what make reads ---------------------------------------------------------------------

    def write_settings(self, all_configs: dict[str, list[StageConfig]]) -> list[str]:
        """Each stage's resolved settings, and the make rules; returns the stages whose recorded
        settings changed."""
        from pipeline.runner.make_rules import make_rules

        changed = []
        for stage, configs in all_configs.items():
            settings = {
                c.name: {k: v for k, v in config_to_dict(c.config).items() if k != "overwrite"}
                for c in configs
            }
            text = json.dumps(settings, indent=2, sort_keys=True, default=str) + "\n"
            existed = self.layout.settings(stage).exists()
            if _write_if_changed(self.layout.settings(stage), text) and existed:
                changed.append(stage)  # (a first run's settings are new, not changed)
        rules = make_rules(self.layout, {s: self.stages[s] for s in self.run_stages()})
        _write_if_changed(self.layout.make_rules, rules)
        return changed

    def write_resolved_config(self) -> Path:
        from ar_slicing.machinery.ownership import RESOLVED_CONFIG_MARK

        out = self.layout.config
        header = f"# Resolved from {self.config_path} {RESOLVED_CONFIG_MARK}; placeholders filled in.\n\n"
        with atomic_path(out) as tmp:
            tmp.write_text(header + dumps_toml(self.config), encoding="utf-8")
        return out


def _write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it already holds it (its mtime is what make compares)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    write_bytes_atomic(path, text.encode("utf-8"))
    return True
