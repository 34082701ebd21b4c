"""Stage configs as frozen dataclasses, and the argparse flags generated from them.

Each stage module defines::

    @dataclass(frozen=True)
    class TagConfig:
        tokens: str = field(metadata={"help": "validation token store directory"})
        window: int = field(default=2048, metadata={"help": "window length L"})

    COMMAND = Command(TagConfig, run_tag, summary="...", examples="arslice tag --tokens ...")

A pipeline stage adds its wiring (`pipeline.wiring.Wiring`: its config table, the run-layout
outputs it reads and writes); `pipeline.runner.registry` lists every command.

Field name `x_y` becomes flag `--x-y`; a field without a default is a required flag; `list[...]`
fields take one or more values; `bool` fields are switches (`--flag` / `--no-flag`); metadata may
carry `choices` (or a function giving them), `flag` (a different flag name), `positional: True` and, on list fields,
`repeatable: True` (the flag may be given several times; the values are collected). `help`, like
`choices`, may be a function, called when the flags are made (so `arslice --help` imports
nothing to list the commands).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import TYPE_CHECKING, Any

from ar_slicing.errors import ArSliceError

if TYPE_CHECKING:
    from models.checkpoints.registry import ModelSpec
    from pipeline.wiring import Wiring


class ReadsModel:
    """A command's config that reads one model, named by its `model` spec: `spec` is the spec
    parsed once, which its checks, inputs, plan and loader all take."""

    model: str

    @functools.cached_property
    def spec(self) -> ModelSpec:
        """`model` parsed (raises ArSliceError naming it when it is not a model spec)."""
        from models.checkpoints.registry import ModelSpec

        return ModelSpec.parse(self.model)


@dataclass(frozen=True)
class Command:
    """One `arslice` subcommand, declared once: a config dataclass, the pure function that runs
    it, its one-line summary and examples, and, for a pipeline stage, its wiring.

    `validate(cfg)` checks what can be checked from the config alone (ranges, names, specs,
    sources that must already exist) and raises ArSliceError; `--dry-run` and `arslice run` call
    it before anything runs. A stage with outputs says what decides them: `plan_settings(cfg)` is
    the settings part of its plan (`ar_slicing.machinery.plan`) for the output `cfg.out`, which `arslice
    run` compares with a complete output's before the first stage starts. `inputs(cfg)` lists
    the files and folders it reads, as (flag, path): `--dry-run` refuses the missing ones, all
    at once, and so does `arslice run` for those no earlier stage of the run writes.
    (An input may add its kind, (flag, path, "dir") or "file": one of the other kind is refused
    too.) `hub_names(cfg, table)` lists what it would fetch from a hub, as `ar_slicing.machinery.hub.require`
    takes them, so `arslice run` stops before anything is written when the hub is unreachable.
    `pipeline` (`pipeline.wiring.Wiring`) is how `arslice run` runs it from a config table.
    `out_is_file`: its `--out` is one file (a tokenizer), not a folder (a variant of a stage
    without wiring of its own says it here; a stage's wiring says it by its output).
    """

    config_cls: type
    run: Callable[[Any], Any]
    summary: str
    examples: str = ""
    description: str = ""
    validate: Callable[[Any], None] | None = None
    plan_settings: Callable[[Any], dict] | None = None
    dry_run: Callable[[Any], None] | None = None  # instead of printing the config (`arslice run`)
    inputs: Callable[[Any], list[tuple[str, ...]]] | None = None
    hub_names: Callable[[Any, str], list[tuple[str, str, str]]] | None = None
    pipeline: Wiring | None = None
    out_is_file: bool = False


def missing_inputs(command: Command, cfg: Any, made: Iterable[str] = ()) -> list[str]:
    """`--flag PATH: no such file or directory` for each input of `cfg` that does not exist
    and is not one of `made` (what an earlier stage of the same run writes) or inside one (a
    checkpoint the train stage keeps in its model folder); `--flag PATH: a file, not a folder`
    for one there of the other kind than it declares ("dir" or "file"), and the same for its
    output (`cfg.out`), which `--dry-run` refuses as the stage itself would."""
    from ar_slicing.machinery.plan.stage_dir import output_kind_problem

    made = [os.path.abspath(os.path.expanduser(p)) for p in made]

    def made_by_then(path: str) -> bool:  # an output of an earlier stage, a file inside one or
        path = os.path.abspath(os.path.expanduser(path))  # the folder one is made in (--run)
        return any(
            path == m or path.startswith(m + os.sep) or m.startswith(path + os.sep) for m in made
        )

    problems = []
    for flag, path, *kind in command.inputs(cfg) if command.inputs is not None else []:
        found = os.path.expanduser(path)
        if not os.path.exists(found):
            if not made_by_then(path):
                problems.append(f"{flag} {path}: no such file or directory")
        elif kind == ["dir"] and not os.path.isdir(found):
            name = flag.lstrip("-").replace("-", " ")
            problems.append(f"{flag} {path}: a file, not a folder; give the {name} folder")
        elif kind == ["file"] and os.path.isdir(found):
            problems.append(f"{flag} {path}: a folder, not a file")
    out = getattr(cfg, "out", None)
    single_file = command.out_is_file or (
        command.pipeline is not None and command.pipeline.writes.single_file
    )
    problem = output_kind_problem(out, single_file) if isinstance(out, str) else None
    return problems + ([f"--out {problem}"] if problem else [])


# ---- the short summaries a person reads -------------------------------------------------------

SUMMARY_LOGGER = "arslice.summary"


def say(text: str) -> None:
    """A command's short summary for the person at the terminal (what it did or skipped, where
    the output went). `arslice` prints it to stdout, as it is (`printing_summaries`); called
    from Python, a stage says nothing (a notebook shows it only with logging at INFO)."""
    logging.getLogger(SUMMARY_LOGGER).info(text)


class _Stdout(logging.Handler):
    """The message alone, to whatever sys.stdout is at the time (pytest's capture included)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stdout.write(record.getMessage() + "\n")
        sys.stdout.flush()


@contextlib.contextmanager
def printing_summaries():
    """Inside, `say` prints to stdout: what `arslice` runs every command in."""
    logger = logging.getLogger(SUMMARY_LOGGER)
    saved = (logger.level, logger.propagate)
    handler = print_summaries()
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved


def print_summaries() -> logging.Handler:
    """From now on `say` prints to stdout (a worker process of a command that prints them)."""
    logger = logging.getLogger(SUMMARY_LOGGER)
    handler = _Stdout()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # (not again through the root logger's timestamped format)
    return handler


def summaries_printed() -> bool:
    """Whether `say` prints here (inside `printing_summaries`)."""
    return any(isinstance(h, _Stdout) for h in logging.getLogger(SUMMARY_LOGGER).handlers)


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return tp


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the dataclass `cls`."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        tp = _unwrap_optional(_field_type(cls, f))
        origin = typing.get_origin(tp)
        help_text = _help(f)
        kwargs: dict[str, Any] = {"help": help_text, "dest": f.name}
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        default = (
            f.default
            if f.default is not MISSING
            else f.default_factory()
            if f.default_factory is not MISSING
            else None
        )
        if "choices" in f.metadata:
            kwargs["choices"] = _choices(f)
        name = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = bool(default)
        elif origin in (list, tuple):
            (item,) = typing.get_args(tp)[:1]
            kwargs["nargs"] = "+"
            kwargs["type"] = item
            if f.metadata.get(
                "repeatable"
            ):  # `--x a --x b` collects both instead of keeping the last
                kwargs["action"] = "extend"
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
        if has_default and tp is not bool:
            kwargs["default"] = default
            if help_text and default not in (None, [], ()):
                kwargs["help"] = f"{help_text} (default: {default})"
        elif not has_default:
            kwargs["required"] = True
        if f.metadata.get("positional"):
            kwargs.pop("dest")
            kwargs.pop("required", None)
            parser.add_argument(f.name, **kwargs)
        else:
            parser.add_argument(name, **kwargs)


def config_from_namespace(cls: type, ns: argparse.Namespace) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):
            v = getattr(ns, f.name)
            flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
            _refuse_non_finite(v, f"{flag} {_shown(v)}")
            if (
                isinstance(v, list)
                and typing.get_origin(_unwrap_optional(_field_type(cls, f))) is tuple
            ):
                v = tuple(v)
            values[f.name] = v
    return cls(**values)


def config_from_mapping(cls: type, mapping: Mapping[str, Any], context: str = "config") -> Any:
    """Build `cls` from a TOML table, refusing unknown keys with a message naming them."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - names)
    if unknown:
        raise ArSliceError(
            f"{context}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(names))}"
        )
    values = dict(mapping)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        tp = _unwrap_optional(_field_type(cls, f))
        if typing.get_origin(tp) in (list, tuple) and isinstance(values[f.name], str):
            values[f.name] = [values[f.name]]  # `glob = "*.py"` for `glob = ["*.py"]`
        values[f.name] = _checked_value(f, tp, values[f.name], context)
        if typing.get_origin(tp) is tuple:
            values[f.name] = tuple(values[f.name])
    try:
        return cls(**values)
    except TypeError as e:
        raise ArSliceError(f"{context}: {e}") from None
    except ArSliceError as e:  # (a config's own check of its values, named with its table)
        raise type(e)(f"{context}: {e}") from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        return f"a list of {_type_name(item)}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _checked_value(f: dataclasses.Field, tp: Any, value: Any, context: str) -> Any:
    """`value` of a config-file key, refused when it has the wrong type or is not a choice (the
    checks argparse does for flags)."""
    if value is None:
        return value
    values = f.metadata.get("values")  # (a string setting that takes a number too: "8" or 8)
    if values is not None and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    origin = typing.get_origin(tp)
    items = [value] if origin not in (list, tuple) else value
    item_tp = typing.get_args(tp)[0] if origin in (list, tuple) else tp
    ok = isinstance(value, (list, tuple)) if origin in (list, tuple) else True
    for v in items if ok else []:
        if item_tp is float and isinstance(v, int) and not isinstance(v, bool):
            continue
        if item_tp is int and isinstance(v, bool):
            ok = False
        elif item_tp in (int, float, str, bool) and not isinstance(v, item_tp):
            ok = False
    if not ok:
        wanted = values or _type_name(tp)
        raise ArSliceError(f"{context}: `{f.name} = {_shown(value)}` must be {wanted}")
    choices = _choices(f)
    if choices is not None:
        for v in items:
            if v not in choices:
                raise ArSliceError(
                    f"{context}: `{f.name} = {_shown(v)}` is not one of {', '.join(map(str, choices))}"
                )
    if item_tp is float:
        value = [float(v) for v in value] if origin in (list, tuple) else float(value)
        _refuse_non_finite(value, f"{context}: `{f.name} = {_shown(value)}`")
    return value


def _refuse_non_finite(value: Any, what: str) -> None:
    """Refuse a NaN or an infinity (a number or in a list) given for a setting: no setting of
    the project means anything with one, and NaN passes every `<=` check."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        raise ArSliceError(f"{what}: must be a finite number")


def _choices(f: dataclasses.Field) -> list | None:
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def _help(f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    return text() if callable(text) else text


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, list, bool)) else str(value)


def config_to_dict(cfg: Any) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def print_config(cfg: Any, file=None) -> None:
    """`--dry-run` output: the resolved config as JSON (to stdout as it is at call time)."""
    text = json.dumps({type(cfg).__name__: config_to_dict(cfg)}, indent=2, default=str)
    print(text, file=file or sys.stdout)


# ---- options shared by the commands that read text sources ----------------------------------------


def executor_option(help_text: str):
    """`--executor local|ray`: the stage's work in local processes or on a Ray cluster;
    `help_text` says what runs where and which paths every node must see."""
    return dataclasses.field(
        default="local", metadata={"help": help_text, "choices": ["local", "ray"]}
    )


def ray_address_option():
    return dataclasses.field(
        default=None,
        metadata={"help": "Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"},
    )


def text_field_option():
    return dataclasses.field(
        default="text", metadata={"help": "JSON field / Parquet column holding the text"}
    )


def glob_option():
    return dataclasses.field(
        default_factory=lambda: ["**/*.txt"],
        metadata={"help": "file patterns inside directory sources (a file matching any is read)"},
    )


def normalize_glob(cfg: Any) -> None:
    """In a frozen config's `__post_init__`: one pattern given as a string becomes a list of
    one, so `glob="*.py"` and `--glob '*.py'` make the same config (and the same stage plan);
    a pattern that names no file (`glob = ""`) is refused."""
    from ar_slicing.data.readers.files import check_glob

    if isinstance(cfg.glob, str):
        object.__setattr__(cfg, "glob", [cfg.glob])
    check_glob(cfg.glob)


READER_FIELDS = ("text_field", "glob", "on_bad_record", "split_fraction", "split_part")


def reader_options(cfg: Any) -> dict[str, Any]:
    """The reader options (`READER_FIELDS`) of a config that has them, as `iter_documents` and
    the per-file tasks take them."""
    return {name: getattr(cfg, name) for name in READER_FIELDS}


def read_documents(cfg: Any, stats) -> Any:
    """`ar_slicing.data.readers.iter_documents` over `cfg.source` with the config's reader options."""
    from ar_slicing.data.readers import iter_documents

    return iter_documents(cfg.source, **reader_options(cfg), max_docs=cfg.max_docs, stats=stats)


def on_bad_record_option():
    from ar_slicing.data.readers import BAD_RECORD_POLICIES

    return dataclasses.field(
        default="error",
        metadata={
            "help": "a malformed record stops the run (error) or is counted and skipped (skip)",
            "choices": list(BAD_RECORD_POLICIES),
        },
    )
