"""The stages of one pipeline config: each stage's configs resolved from its tables and the run
layout, checked before anything runs, and run (`Pipeline`), with the markers that span several
commands (`pipeline.run_steps` trains models side by side and copies a pretrained tokenizer).
`pipeline.run` is the `arslice run` command over it; the config file's format is described there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import atomic_path, build_meta, is_complete, read_json, write_bytes_atomic
from ar_slicing.layout import STORE_PARTS, RunLayout, file_meta_path, meta_path
from pipeline.config import (
    READER_FIELDS,
    Command,
    config_from_mapping,
    config_to_dict,
    missing_inputs,
)
from pipeline.pipeline_file import dumps_toml
from pipeline.run_steps import PretrainedTokenizer, copy_pretrained_tokenizer, train_side_by_side
from pipeline.stages import PIPELINE, PIPELINE_STAGES

log = logging.getLogger(__name__)

# `[train] side_by_side = N`: a key of the pipeline, not of the train stage (see run_train).
SIDE_BY_SIDE_KEY = "side_by_side"


# ---- building each stage's config -------------------------------------------------------------


def load_command(stage: str) -> Command:
    module_name = PIPELINE[stage].module
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise ArSliceError(f"stage {stage}: module {module_name} is not installed") from None
        raise
    return module.COMMAND


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
    values = {k: v for k, v in defaults.items() if k in names and k not in table}
    values.update(table)
    if overwrite and "overwrite" in names:
        values["overwrite"] = True
    return config_from_mapping(command.config_cls, values, context=context)


def _split_subtables(table: Mapping[str, Any], key: str) -> tuple[dict, dict]:
    """(the table without `key`, the sub-tables under `key`)."""
    common = {k: v for k, v in table.items() if k != key}
    sub = table.get(key, {})
    if not isinstance(sub, Mapping) or not all(isinstance(v, Mapping) for v in sub.values()):
        raise BadInput(f"`{key}` must hold one table per name, like [{key}.<name>]")
    return common, {name: dict(v) for name, v in sub.items()}


def _settings_without_overwrite(cfg: Any) -> dict:
    if isinstance(cfg, PretrainedTokenizer):
        return dataclasses.asdict(cfg)
    return {k: v for k, v in config_to_dict(cfg).items() if k != "overwrite"}


def _write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it already holds it (its mtime is what make compares)."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    write_bytes_atomic(path, text.encode("utf-8"))
    return True


@dataclass
class Pipeline:
    """One pipeline config, resolved, and the functions that run its stages."""

    config_path: Path
    config: dict
    overwrite: bool = False
    loader: Callable[[str], Command] = load_command

    @property
    def run_dir(self) -> Path:
        return Path(self.config["run_dir"])

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    def table(self, stage: str) -> dict:
        return dict(self.config.get(stage, {}))

    def path(self, *parts: str) -> str:
        return str(self.run_dir.joinpath(*parts))

    def _build(self, stage: str, table, defaults, context: str) -> Any:
        return build_config(
            self.loader(stage), table, defaults, f"{self.config_path} {context}", self.overwrite
        )

    def configs(self, stage: str) -> dict[str, Any]:
        """Every config `stage` runs with, by name (one per store, per model, or just one)."""
        return getattr(self, f"{stage}_configs")()

    # -- tokenizer ---------------------------------------------------------------------------
    def tokenizer_configs(self) -> dict[str, Any]:
        table = self.table("tokenizer")
        out = str(self.layout.tokenizer)
        if "pretrained" in table:
            extra = sorted(set(table) - {"pretrained"})
            if extra:
                raise BadInput(
                    f"{self.config_path} [tokenizer]: `pretrained` copies an existing tokenizer, "
                    f"so {', '.join(extra)} cannot be used with it"
                )
            if not isinstance(table["pretrained"], str) or not table["pretrained"].strip():
                raise BadInput(
                    f"{self.config_path} [tokenizer]: `pretrained` must name a tokenizer"
                )
            return {"tokenizer": PretrainedTokenizer(table["pretrained"], out)}
        defaults = {"out": out}
        if "source" not in table:  # the corpus of the training store
            defaults.update(self.corpus_of_the_training_store())
        return {"tokenizer": self._build("tokenizer", table, defaults, "[tokenizer]")}

    def run_tokenizer(self) -> dict:
        """Train the run's tokenizer, or copy the configured one, to `<run_dir>/tokenizer.json`."""
        (cfg,) = self.tokenizer_configs().values()
        if isinstance(cfg, PretrainedTokenizer):
            return copy_pretrained_tokenizer(cfg, overwrite=self.overwrite)
        result = self.loader("tokenizer").run(cfg)
        if not Path(cfg.out).is_file():
            raise ArSliceError(f"tokenizer: train-tokenizer finished but {cfg.out} does not exist")
        return result

    def corpus_of_the_training_store(self) -> dict[str, Any]:
        """What [tokenize] reads into the training store (its sources, patterns, split), the
        defaults of a trained [tokenizer] that names no corpus of its own."""
        common = self.table("tokenize")
        train = common.pop("train", {})
        table = {**common, **(train if isinstance(train, Mapping) else {})}
        table.pop("val", None)
        keys = ("source", *(k for k in READER_FIELDS if k != "split_part"))
        out = {k: table[k] for k in keys if k in table}
        if "split_fraction" in out:
            out["split_part"] = "train"
        return out

    # -- tokenize ----------------------------------------------------------------------------
    def tokenize_configs(self) -> dict[str, Any]:
        # [tokenize.train] and [tokenize.val] override the shared [tokenize] keys per store.
        common = self.table("tokenize")
        parts = {
            part: dict(common.pop(part))
            for part in STORE_PARTS
            if isinstance(common.get(part), Mapping)
        }
        configs = {}
        for part in STORE_PARTS:
            table = {**common, **parts.get(part, {})}
            defaults = {
                "out": str(self.layout.store(part)),
                "tokenizer": str(self.layout.tokenizer),
            }
            if "split_fraction" in table:
                defaults["split_part"] = part
            configs[part] = self._build("tokenize", table, defaults, f"[tokenize.{part}]")
        return configs

    def run_tokenize(self) -> dict:
        command = self.loader("tokenize")
        return {part: command.run(cfg) for part, cfg in self.tokenize_configs().items()}

    # -- count, tag --------------------------------------------------------------------------
    def count_configs(self) -> dict[str, Any]:
        defaults = {"tokens": [str(self.layout.store("train"))], "out": str(self.layout.counts)}
        table = self.table("count")
        if table.get("only_bigrams_of"):  # "val" names the run's own validation store
            table["only_bigrams_of"] = [
                str(self.layout.store(s)) if s in STORE_PARTS else s
                for s in table["only_bigrams_of"]
            ]
        return {"count": self._build("count", table, defaults, "[count]")}

    def run_count(self) -> dict:
        return self.loader("count").run(self.count_configs()["count"])

    def tag_configs(self) -> dict[str, Any]:
        defaults = {
            "tokens": str(self.layout.store("val")),
            "counts": str(self.layout.counts),
            "out": str(self.layout.tags),
        }
        return {"tag": self._build("tag", self.table("tag"), defaults, "[tag]")}

    def run_tag(self) -> dict:
        return self.loader("tag").run(self.tag_configs()["tag"])

    # -- train -------------------------------------------------------------------------------
    def train_configs(self) -> dict[str, Any]:
        """One train config per `[train.models.<name>]` table (none when there is no [train])."""
        table = self.table("train")
        if not table:
            return {}
        common, models = _split_subtables(table, "models")
        common.pop(SIDE_BY_SIDE_KEY, None)
        if not models:
            raise BadInput(
                f"{self.config_path} [train]: no models; add a [train.models.<name>] table"
            )
        configs = {}
        for name, model_table in models.items():
            defaults = {
                "tokens": str(self.layout.store("train")),
                "val_tokens": str(self.layout.store("val")),
                "out": str(self.layout.model(name)),
            }
            context = f"[train.models.{name}]"
            configs[name] = self._build("train", {**common, **model_table}, defaults, context)
        return configs

    def side_by_side(self) -> int:
        """How many models `[train] side_by_side = N` trains at once (1: one after another)."""
        n = self.table("train").get(SIDE_BY_SIDE_KEY, 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise BadInput(
                f"{self.config_path} [train]: {SIDE_BY_SIDE_KEY} = {n!r}; use a whole number >= 1"
            )
        return n

    def run_train(self) -> dict:
        t0 = time.time()
        configs = self.train_configs()
        command = self.loader("train") if configs else None
        workers = min(self.side_by_side(), len(configs))
        if workers > 1:
            train_side_by_side(command, configs, workers)
        else:
            for cfg in configs.values():
                command.run(cfg)
        models = {name: self._model_entry(name, Path(cfg.out)) for name, cfg in configs.items()}
        self._write_marker(
            self.layout.models,
            "train-all",
            configs,
            {"config": str(self.config_path)},
            t0,
            models=models,
        )
        return {"models": models}

    @staticmethod
    def _model_entry(name: str, out: Path) -> dict:
        if not is_complete(out):
            raise ArSliceError(f"train {name}: finished without writing {meta_path(out)}")
        meta = read_json(meta_path(out))
        keep = (
            "arch",
            "n_params",
            "tokens_seen",
            "epochs",
            "final_train_loss",
            "final_val_loss",
            "wall_time_s",
        )
        return {"dir": str(out), "spec": f"native:{out}", **{k: meta.get(k) for k in keep}}

    # -- eval --------------------------------------------------------------------------------
    def eval_entries(self) -> dict[str, dict]:
        """Every trained model (as `native:<dir>`), then every `[eval.models.<name>]` table."""
        common, extra = _split_subtables(self.table("eval"), "models")
        trained = (
            list(_split_subtables(self.table("train"), "models")[1]) if self.table("train") else []
        )
        overlap = sorted(set(trained) & set(extra))
        if overlap:
            raise BadInput(
                f"{self.config_path}: model name(s) {', '.join(overlap)} are both trained and listed "
                "in [eval.models]; give the external checkpoint another name"
            )
        entries = {name: {"model": f"native:{self.layout.model(name)}"} for name in trained}
        for name, table in extra.items():
            if "model" not in table:
                raise BadInput(
                    f'{self.config_path} [eval.models.{name}]: needs `model = "<spec>"` '
                    "(hf:..., native:..., safari:..., zoology:..., based:...)"
                )
            entries[name] = table
        if not entries:
            raise BadInput(
                f"{self.config_path}: nothing to evaluate; add [train.models.<name>] or "
                "[eval.models.<name>] tables"
            )
        return {name: {**common, **table} for name, table in entries.items()}

    def eval_configs(self) -> dict[str, Any]:
        configs = {}
        for name, table in self.eval_entries().items():
            defaults = {
                "tags": str(self.layout.tags),
                "out": str(self.layout.losses(name)),
                "name": name,
            }
            configs[name] = self._build("eval", table, defaults, f"[eval.models.{name}]")
        return configs

    def run_eval(self) -> dict:
        t0 = time.time()
        configs = self.eval_configs()
        command = self.loader("eval")
        losses = {}
        for name, cfg in configs.items():
            command.run(cfg)
            out = Path(cfg.out)
            if not is_complete(out):
                raise ArSliceError(f"eval {name}: finished without writing {meta_path(out)}")
            meta = read_json(meta_path(out))
            losses[name] = {"dir": str(out), "spec": meta.get("spec"), "tokens": meta.get("tokens")}
        inputs = {"config": str(self.config_path), "tags": str(self.layout.tags)}
        self._write_marker(self.layout.losses_root, "eval-all", configs, inputs, t0, losses=losses)
        return {"losses": losses}

    # -- report ------------------------------------------------------------------------------
    def report_configs(self) -> dict[str, Any]:
        defaults = {"run": str(self.run_dir)}
        return {"report": self._build("report", self.table("report"), defaults, "[report]")}

    def run_report(self) -> dict:
        return self.loader("report").run(self.report_configs()["report"])

    def run_stage(self, stage: str) -> Any:
        return getattr(self, f"run_{stage}")()

    def _write_marker(self, directory: Path, stage: str, configs, inputs, t0, **extra) -> None:
        """The meta.json marking a stage of many commands (every model trained, evaluated):
        rewritten when what it records changes, else only touched (make sees it up to date)."""
        import os

        from ar_slicing.io import stable_meta, to_jsonable, write_meta
        from ar_slicing.ownership import output_lock

        meta = build_meta(
            stage,
            config={name: config_to_dict(cfg) for name, cfg in configs.items()},
            inputs=inputs,
            counts={"models": len(configs)},
            wall_time_s=time.time() - t0,
            **extra,
        )
        path = meta_path(directory)
        with output_lock(directory, wait=True):
            if path.is_file() and stable_meta(read_json(path)) == stable_meta(to_jsonable(meta)):
                os.utime(path)
                return
            write_meta(directory, meta)

    # -- checks before anything runs ---------------------------------------------------------
    def check(self, chosen) -> dict[str, dict[str, Any]]:
        """Resolve and check the configs (keys, types, values, sources, inputs, specs, hub
        names) of every chosen stage and of every stage the config file has a table for.
        Returns them by stage; refuses every problem found, in one message."""
        from ar_slicing import hub

        stages = [s for s in PIPELINE_STAGES if s in chosen or s in self.config]
        problems = _Problems()
        all_configs = {}
        for stage in stages:
            with problems.noted():
                all_configs[stage] = self.configs(stage)
        made = [c.out for cs in all_configs.values() for c in cs.values() if hasattr(c, "out")]
        for stage, configs in all_configs.items():
            command = self.loader(stage)
            for name, cfg in configs.items():
                if isinstance(cfg, PretrainedTokenizer):
                    continue
                table = f"{self.config_path} {_table_of(stage, name)}"
                with problems.noted(table):
                    if command.validate is not None:
                        command.validate(cfg)
                    problems.add(*(f"{table}: {m}" for m in missing_inputs(command, cfg, made)))
        with problems.noted():
            hub.require(self.hub_names(all_configs))
        with problems.noted():
            self.refuse_foreign(all_configs)
        problems.refuse(f"{self.config_path}: {{n}} problems, found before anything ran:")
        return all_configs

    def refuse_foreign(self, all_configs) -> None:
        """Refuse a run directory (or a stage output the configs name) holding files the
        project did not write: a run writes nowhere it could overwrite or remove a user's file."""
        from ar_slicing.ownership import ForeignFiles, foreign_in_run

        outputs = {}
        for stage, configs in all_configs.items():
            if stage not in ("tokenizer", "report"):
                outputs.update({Path(c.out): stage for c in configs.values()})
        found = foreign_in_run(self.layout, outputs)
        for cfg in all_configs.get("tokenizer", {}).values():  # a one-file output: its meta beside
            out = Path(cfg.out)
            if out.exists() and not file_meta_path(out).is_file():
                found.append(out)
        if found:
            found = sorted(set(found))
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ForeignFiles(
                f"{self.config_path}: run_dir {self.run_dir} holds {found[0]}{more}, which this "
                "project did not write; nothing was written. Point run_dir at a new folder (or "
                "one an earlier `arslice run` made), or move those files out"
            )

    @staticmethod
    def hub_names(all_configs) -> list[tuple[str, str, str]]:
        """What the configs name on the hub (tokenizers, models, datasets), as `hub.require`
        takes them: so an unreachable hub stops the run before anything is written."""
        from ar_slicing import hub
        from ar_slicing.readers import HF_PREFIX, parse_hf_spec
        from models.checkpoints.registry import parse_spec, reads_hub_models

        names = []
        for cfg in all_configs.get("tokenizer", {}).values():
            if isinstance(cfg, PretrainedTokenizer) and hub.is_hub_name(cfg.pretrained):
                what = f"tokenizer {cfg.pretrained!r} ([tokenizer] pretrained)"
                names.append((what, cfg.pretrained, "model"))
        for part, cfg in all_configs.get("tokenize", {}).items():
            if cfg.tokenizer and hub.is_hub_name(cfg.tokenizer):
                names.append(
                    (f"tokenizer {cfg.tokenizer!r} ([tokenize.{part}])", cfg.tokenizer, "model")
                )
            for source in cfg.source:
                if source.startswith(HF_PREFIX) and hub.is_hub_name(parse_hf_spec(source)[0]):
                    names.append((f"dataset {source} ([tokenize.{part}])", source, "dataset"))
        for name, cfg in all_configs.get("eval", {}).items():
            prefix, target = parse_spec(cfg.model)
            if reads_hub_models(prefix) and hub.is_hub_name(target):
                names.append((f"model {cfg.model} ([eval.models.{name}])", target, "model"))
        return names

    def conflicts(self, stages, all_configs) -> list[str]:
        """For each chosen stage whose complete output was made with other settings than the
        config now asks for: a line per differing setting (empty when every plan agrees)."""
        from ar_slicing.plan import differences, recorded_plan

        lines = []
        for stage in stages:
            command = self.loader(stage)
            for cfg in all_configs[stage].values():
                single = stage == "tokenizer"
                out = Path(cfg.out) if hasattr(cfg, "out") else self.layout.report
                old = recorded_plan(out, single_file=single)
                if old is None:
                    continue
                new = (
                    {"pretrained": cfg.pretrained}
                    if isinstance(cfg, PretrainedTokenizer)
                    else command.plan_settings(cfg)
                    if command.plan_settings
                    else {}
                )
                recorded = old.get("settings", {})
                # (None: decided by the inputs, e.g. a default reference; not comparable here)
                asked = {k: v for k, v in new.items() if v is not None}
                diff = differences({k: recorded.get(k) for k in asked}, asked)
                if diff or (not old and asked):
                    lines.append(f"[{stage}] {out}:")
                    lines += [f"    settings.{d}" for d in diff] or [
                        "    (made by an older version, which recorded no plan)"
                    ]
        return lines

    # -- what make reads ---------------------------------------------------------------------
    def write_settings(self, all_configs) -> list[str]:
        """Each stage's resolved settings, and the make rules; returns the stages whose recorded
        settings changed."""
        changed = []
        for stage in all_configs:
            configs = {n: _settings_without_overwrite(c) for n, c in all_configs[stage].items()}
            text = json.dumps(configs, indent=2, sort_keys=True, default=str) + "\n"
            existed = self.layout.settings(stage).exists()
            if _write_if_changed(self.layout.settings(stage), text) and existed:
                changed.append(stage)  # (a first run's settings are new, not changed)
        from pipeline.make_rules import make_rules

        _write_if_changed(self.layout.make_rules, make_rules(self.layout))
        return changed

    def write_resolved_config(self) -> Path:
        out = self.layout.config
        header = f"# Resolved from {self.config_path} by `arslice run`; placeholders filled in.\n\n"
        with atomic_path(out) as tmp:
            tmp.write_text(header + dumps_toml(self.config), encoding="utf-8")
        return out


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


def _table_of(stage: str, name: str) -> str:
    """The config table a stage's config `name` comes from: `[tag]`, `[tokenize.val]`, ..."""
    if name == stage:
        return f"[{stage}]"
    return f"[{stage}.models.{name}]" if stage in ("train", "eval") else f"[{stage}.{name}]"
