"""`arslice run`: run the stages of a pipeline config file, in order (what `make` calls).

A pipeline config is a TOML file whose top-level `run_dir` names the run directory and whose
tables hold each stage's own config fields (the same names as its command-line flags)::

    run_dir = "runs/demo"

    [tokenizer]                 # train-tokenizer fields, or `pretrained = "gpt2"` to copy one
    source = ["{stdlib}"]
    vocab_size = 4096

    [tokenize]                  # tokenize fields shared by both stores ...
    source = ["{stdlib}"]
    [tokenize.val]              # ... and per-store overrides (tables `train` and `val`)
    max_docs = 100

    [count]
    [tag]
    window = 512

    [train]                     # train fields shared by every model ...
    steps = 600
    [train.models.attention]    # ... one table per model, keyed by its name
    arch = "attention"

    [eval]                      # eval fields shared by every model; every trained model is
    batch_size = 8              # evaluated, plus any `[eval.models.<name>]` with a `model` spec
    [eval.models.pythia-160m]
    model = "hf:EleutherAI/pythia-160m"

    [report]
    reference = "attention"

Strings may use `{run_dir}` and `{stdlib}` (this Python's standard-library directory). Paths
that follow the run layout (`tokens/train`, `counts`, `tags`, `models/<name>`, `losses/<name>`,
...) are filled in when a table leaves them out, so a config only says what differs.

Each stage writes its own completion markers; this module adds the ones that span several
commands, which the Makefile targets name: `<run_dir>/tokenizer.json`,
`<run_dir>/models/meta.json` (after every model is trained) and `<run_dir>/losses/meta.json`
(after every model is evaluated). The resolved config is written to `<run_dir>/config.toml`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import re
import sysconfig
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import atomic_path, build_meta, is_complete, read_json, write_meta
from pipeline.config import Command, config_from_mapping, config_to_dict

log = logging.getLogger(__name__)

STAGES = ("tokenizer", "tokenize", "count", "tag", "train", "eval", "report")
# The stage module whose COMMAND each table configures.
STAGE_MODULES = {
    "tokenizer": "pipeline.train_tokenizer",
    "tokenize": "pipeline.tokenize",
    "count": "pipeline.count",
    "tag": "pipeline.tag",
    "train": "pipeline.train",
    "eval": "pipeline.eval",
    "report": "pipeline.report",
}
TOKENIZER_NAME = "tokenizer.json"
CONFIG_NAME = "config.toml"
STORE_PARTS = ("train", "val")


@dataclass(frozen=True)
class RunConfig:
    config: str = field(
        metadata={"help": "pipeline config file (TOML), e.g. pipeline/configs/demo.toml"}
    )
    stage: list[str] = field(
        default_factory=lambda: list(STAGES),
        metadata={"help": "stages to run (always in pipeline order)", "choices": list(STAGES)},
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "redo the chosen stages even where their outputs are complete"},
    )


# ---- reading the config -------------------------------------------------------------------------


def stdlib_dir() -> str:
    """This interpreter's standard-library source directory (the demo corpus)."""
    return sysconfig.get_paths()["stdlib"]


def resolve_placeholders(value: Any, placeholders: Mapping[str, str]) -> Any:
    """`value` with every `{name}` of `placeholders` replaced inside its strings, recursively.

    Only the named placeholders are touched, so other braces in strings survive.
    """
    if isinstance(value, str):
        for name, replacement in placeholders.items():
            value = value.replace("{" + name + "}", replacement)
        return value
    if isinstance(value, Mapping):
        return {k: resolve_placeholders(v, placeholders) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_placeholders(v, placeholders) for v in value]
    return value


def load_pipeline_config(path: str | Path) -> dict:
    """Parse a pipeline config and resolve its placeholders; refuses unknown top-level keys."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"pipeline config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"pipeline config {path}: not valid TOML ({e})") from None
    if not isinstance(raw.get("run_dir"), str) or not raw["run_dir"]:
        raise BadInput(f'pipeline config {path}: needs a top-level `run_dir = "runs/<name>"`')
    allowed = {"run_dir", "description", *STAGES}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise BadInput(
            f"pipeline config {path}: unknown top-level key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(sorted(allowed))}"
        )
    for name in STAGES:
        if name in raw and not isinstance(raw[name], dict):
            raise BadInput(f"pipeline config {path}: `{name}` must be a table ([{name}])")
    placeholders = {"stdlib": stdlib_dir()}
    run_dir = resolve_placeholders(raw["run_dir"], placeholders)
    placeholders["run_dir"] = run_dir
    return resolve_placeholders(raw, placeholders)


# ---- writing the resolved config ----------------------------------------------------------------


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes (\" \\ \n \t \uXXXX) are all valid in a TOML basic string; DEL is
        # the one control character JSON leaves raw and TOML does not allow
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def dumps_toml(mapping: Mapping[str, Any], _prefix: str = "") -> str:
    """A TOML document for `mapping` (tables, strings, numbers, bools and lists of them).

    None values are left out (TOML has no null; a missing key means the stage's default).
    """
    lines = [
        f"{_toml_key(k)} = {_toml_value(v)}"
        for k, v in mapping.items()
        if v is not None and not isinstance(v, Mapping)
    ]
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            name = f"{_prefix}{_toml_key(key)}"
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
            body = dumps_toml(value, name + ".")
            if body:
                lines.append(body.rstrip("\n"))
    return "\n".join(lines) + "\n" if lines else ""


# ---- building and running each stage ------------------------------------------------------------


def load_command(stage: str) -> Command:
    module_name = STAGE_MODULES[stage]
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

    def table(self, stage: str) -> dict:
        return dict(self.config.get(stage, {}))

    def path(self, *parts: str) -> str:
        return str(self.run_dir.joinpath(*parts))

    def write_resolved_config(self) -> Path:
        out = self.run_dir / CONFIG_NAME
        header = f"# Resolved from {self.config_path} by `arslice run`; placeholders filled in.\n\n"
        with atomic_path(out) as tmp:
            tmp.write_text(header + dumps_toml(self.config), encoding="utf-8")
        return out

    # -- tokenizer ---------------------------------------------------------------------------
    def run_tokenizer(self) -> dict:
        """Train the run's tokenizer, or copy the configured one, to `<run_dir>/tokenizer.json`."""
        out = self.run_dir / TOKENIZER_NAME
        table = self.table("tokenizer")
        if out.is_file() and not self.overwrite:
            print(f"tokenizer: {out} exists, skipped")
            return {"tokenizer": str(out), "skipped": True}
        if "pretrained" in table:
            extra = sorted(set(table) - {"pretrained"})
            if extra:
                raise BadInput(
                    f"{self.config_path} [tokenizer]: `pretrained` copies an existing tokenizer, "
                    f"so {', '.join(extra)} cannot be used with it"
                )
            from ar_slicing.tokenizer import describe, load_tokenizer

            tok = load_tokenizer(table["pretrained"])
            with atomic_path(out) as tmp:
                tok.save(str(tmp))
            info = describe(tok, table["pretrained"])
            print(f"tokenizer: copied {table['pretrained']} ({info['vocab_size']} tokens) to {out}")
            return {"tokenizer": str(out), **info}
        command = self.loader("tokenizer")
        cfg = build_config(
            command, table, {"out": str(out)}, f"{self.config_path} [tokenizer]", self.overwrite
        )
        result = command.run(cfg)
        if not out.is_file():
            raise ArSliceError(
                f"tokenizer: train-tokenizer finished but {out} does not exist; "
                f"point its `out` at {out}"
            )
        return result

    # -- tokenize ----------------------------------------------------------------------------
    def tokenize_configs(self) -> dict[str, Any]:
        command = self.loader("tokenize")
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
            defaults = {"out": self.path("tokens", part), "tokenizer": self.path(TOKENIZER_NAME)}
            if "split_fraction" in table:
                defaults["split_part"] = part
            configs[part] = build_config(
                command, table, defaults, f"{self.config_path} [tokenize.{part}]", self.overwrite
            )
        return configs

    def run_tokenize(self) -> dict:
        command = self.loader("tokenize")
        return {part: command.run(cfg) for part, cfg in self.tokenize_configs().items()}

    # -- count, tag --------------------------------------------------------------------------
    def count_config(self) -> Any:
        defaults = {"tokens": [self.path("tokens", "train")], "out": self.path("counts")}
        return build_config(
            self.loader("count"),
            self.table("count"),
            defaults,
            f"{self.config_path} [count]",
            self.overwrite,
        )

    def run_count(self) -> dict:
        return self.loader("count").run(self.count_config())

    def tag_config(self) -> Any:
        defaults = {
            "tokens": self.path("tokens", "val"),
            "counts": self.path("counts"),
            "out": self.path("tags"),
        }
        return build_config(
            self.loader("tag"),
            self.table("tag"),
            defaults,
            f"{self.config_path} [tag]",
            self.overwrite,
        )

    def run_tag(self) -> dict:
        return self.loader("tag").run(self.tag_config())

    # -- train -------------------------------------------------------------------------------
    def train_configs(self) -> dict[str, Any]:
        """One train config per `[train.models.<name>]` table (none when there is no [train])."""
        table = self.table("train")
        if not table:
            return {}
        common, models = _split_subtables(table, "models")
        if not models:
            raise BadInput(
                f"{self.config_path} [train]: no models; add a [train.models.<name>] table"
            )
        command = self.loader("train")
        val_store = self.path("tokens", "val")
        configs = {}
        for name, model_table in models.items():
            defaults = {
                "tokens": self.path("tokens", "train"),
                "val_tokens": val_store,
                "out": self.path("models", name),
            }
            configs[name] = build_config(
                command,
                {**common, **model_table},
                defaults,
                f"{self.config_path} [train.models.{name}]",
                self.overwrite,
            )
        return configs

    def run_train(self) -> dict:
        t0 = time.time()
        configs = self.train_configs()
        command = self.loader("train") if configs else None
        models = {}
        for name, cfg in configs.items():
            command.run(cfg)
            models[name] = self._model_entry(name, Path(cfg.out))
        meta = build_meta(
            "train-all",
            config={name: config_to_dict(cfg) for name, cfg in configs.items()},
            inputs={"config": str(self.config_path)},
            counts={"models": len(models)},
            wall_time_s=time.time() - t0,
            models=models,
        )
        write_meta(self.run_dir / "models", meta)
        return {"models": models}

    @staticmethod
    def _model_entry(name: str, out: Path) -> dict:
        if not is_complete(out):
            raise ArSliceError(f"train {name}: finished without writing {out / 'meta.json'}")
        meta = read_json(out / "meta.json")
        keep = (
            "arch",
            "n_params",
            "tokens_seen",
            "final_train_loss",
            "final_val_loss",
            "wall_time_s",
        )
        return {"dir": str(out), "spec": f"native:{out}", **{k: meta.get(k) for k in keep}}

    # -- eval --------------------------------------------------------------------------------
    def eval_configs(self) -> dict[str, Any]:
        """Every trained model (as `native:<dir>`), then every `[eval.models.<name>]` spec."""
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
        entries = {name: {"model": f"native:{self.path('models', name)}"} for name in trained}
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
        command = self.loader("eval")
        configs = {}
        for name, table in entries.items():
            defaults = {"tags": self.path("tags"), "out": self.path("losses", name), "name": name}
            configs[name] = build_config(
                command,
                {**common, **table},
                defaults,
                f"{self.config_path} [eval.models.{name}]",
                self.overwrite,
            )
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
                raise ArSliceError(f"eval {name}: finished without writing {out / 'meta.json'}")
            meta = read_json(out / "meta.json")
            losses[name] = {"dir": str(out), "spec": meta.get("spec"), "tokens": meta.get("tokens")}
        meta = build_meta(
            "eval-all",
            config={name: config_to_dict(cfg) for name, cfg in configs.items()},
            inputs={"config": str(self.config_path), "tags": self.path("tags")},
            counts={"models": len(losses)},
            wall_time_s=time.time() - t0,
            losses=losses,
        )
        write_meta(self.run_dir / "losses", meta)
        return {"losses": losses}

    # -- report ------------------------------------------------------------------------------
    def report_config(self) -> Any:
        return build_config(
            self.loader("report"),
            self.table("report"),
            {"run": str(self.run_dir)},
            f"{self.config_path} [report]",
            self.overwrite,
        )

    def run_report(self) -> dict:
        result = self.loader("report").run(self.report_config())
        html = self.run_dir / "report" / "report.html"
        print(f"report: {html.resolve() if html.exists() else html}")
        return result

    def run_stage(self, stage: str) -> Any:
        return getattr(self, f"run_{stage}")()


def run_pipeline(cfg: RunConfig) -> dict:
    """Run `cfg.stage` of the pipeline config `cfg.config`, in pipeline order."""
    unknown = sorted(set(cfg.stage) - set(STAGES))
    if unknown:
        raise ArSliceError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGES)}")
    pipeline = Pipeline(Path(cfg.config), load_pipeline_config(cfg.config), overwrite=cfg.overwrite)
    pipeline.run_dir.mkdir(parents=True, exist_ok=True)
    pipeline.write_resolved_config()
    timings = {}
    results = {}
    for stage in (s for s in STAGES if s in cfg.stage):
        log.info("stage %s", stage)
        t0 = time.time()
        results[stage] = pipeline.run_stage(stage)
        timings[stage] = round(time.time() - t0, 1)
        print(f"== {stage} done in {timings[stage]:.1f} s")
    return {"run_dir": str(pipeline.run_dir), "wall_time_s": timings, "results": results}


COMMAND = Command(
    RunConfig,
    run_pipeline,
    summary="run stages of a pipeline config file (what `make` calls)",
    examples="""\
  arslice run --config pipeline/configs/demo.toml                 # every stage, skipping complete ones
  arslice run --config pipeline/configs/demo.toml --stage train eval
  arslice run --config pipeline/configs/pile-gpt2.toml --stage report --overwrite""",
)
