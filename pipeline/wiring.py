"""How a stage joins a pipeline config file (`arslice run`): its table, the run-layout outputs it
reads and writes, how its table fans out into configs, and what the run layout fills in.

A stage declares its `Wiring` on its `Command` (`pipeline.config`); the runner
(`pipeline.runner`) derives everything else from the declarations: the running order (a stage
runs after those that write what it reads), the Makefile's stage rules (each names the markers
of what its stage writes), the config file's tables and `arslice run --stage`'s choices::

    COMMAND = Command(
        TagConfig, run_tag, summary="...",
        pipeline=Wiring(
            table="tag", reads=(STORES, COUNTS), writes=TAGS,
            defaults=lambda run, t: {"tokens": run.layout.store("val"), "out": run.layout.tags, ...},
        ),
    )
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import META_NAME, STORE_PARTS, RunLayout

# ---- the run-layout outputs ------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """An output of a run: the files that say it is complete (what a make target names)."""

    name: str
    markers: Callable[[RunLayout], list[Path]]
    single_file: bool = False  # one file, its meta.json beside it (a tokenizer)
    # one folder per config under this root, which a marker of its own covers (models/<name>/)
    root: Callable[[RunLayout], Path] | None = None


TOKENIZER = Output("tokenizer", lambda layout: [layout.tokenizer], single_file=True)
STORES = Output("stores", lambda layout: [layout.store(p) / META_NAME for p in STORE_PARTS])
COUNTS = Output("counts", lambda layout: [layout.counts / META_NAME])
TAGS = Output("tags", lambda layout: [layout.tags / META_NAME])
MODELS = Output(
    "models", lambda layout: [layout.models / META_NAME], root=lambda layout: layout.models
)
LOSSES = Output(
    "losses",
    lambda layout: [layout.losses_root / META_NAME],
    root=lambda layout: layout.losses_root,
)
PROBES = Output(
    "probes",
    lambda layout: [layout.probes_root / META_NAME],
    root=lambda layout: layout.probes_root,
)
REPORT = Output("report", lambda layout: [layout.report / META_NAME])


# ---- tables and how they fan out -------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """The table one config of a stage is built from."""

    name: str  # the config's name: the stage's own, a store's ("val") or a model's
    values: dict  # its keys: the stage table's shared ones, overridden by its own
    context: str  # where it was written: "[tag]", "[tokenize.val]", "[train.models.x]"


@dataclass(frozen=True)
class Fanned:
    """What a fan-out sees: the whole config file (its path for messages), the run layout and
    the stage's table without the pipeline's own keys."""

    config: Mapping[str, Any]
    path: Path
    layout: RunLayout
    table: str
    values: dict


def one(f: Fanned) -> list[Table]:
    """One config, named as the stage's table: `[tag]`."""
    return [Table(f.table, dict(f.values), f"[{f.table}]")]


def per_store(f: Fanned) -> list[Table]:
    """One config per token store: the shared keys, then `[tokenize.train]`/`[tokenize.val]`."""
    common = dict(f.values)
    own = {p: dict(common.pop(p)) for p in STORE_PARTS if isinstance(common.get(p), Mapping)}
    return [Table(p, {**common, **own.get(p, {})}, f"[{f.table}.{p}]") for p in STORE_PARTS]


def model_tables(values: Mapping[str, Any]) -> tuple[dict, dict[str, dict]]:
    """(the keys a table shares, its `models.<name>` sub-tables by name)."""
    common = {k: v for k, v in values.items() if k != "models"}
    sub = values.get("models", {})
    if not isinstance(sub, Mapping) or not all(isinstance(v, Mapping) for v in sub.values()):
        raise BadInput("`models` must hold one table per name, like [models.<name>]")
    return common, {name: dict(v) for name, v in sub.items()}


# A model's name is a folder of the run (models/<name>/, losses/<name>/): a plain name, never a
# path; `@` is kept for the losses of a checkpoint (<name>@step<n>).
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_model_name(name: str) -> bool:
    """Whether `name` may name a model: a plain folder name, not a path (see `_MODEL_NAME`)."""
    return _MODEL_NAME.fullmatch(name) is not None


def check_model_names(f: Fanned, names) -> None:
    """Refuse a name of `[<table>.models.<name>]` that is not a plain folder name (`..`, a path,
    an absolute name, an empty one), naming the table, before anything is written."""
    for name in names:
        if not is_model_name(name):
            key = name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)
            raise BadInput(
                f"{f.path} [{f.table}.models.{key}]: a model's name must be a plain folder name "
                "(it names models/<name> and losses/<name>): letters, digits, '.', '_' and '-', "
                "starting with a letter or digit, at most 128 characters"
            )


def per_model(f: Fanned) -> list[Table]:
    """One config per `[train.models.<name>]` table (none without a [train] table)."""
    if not f.config.get(f.table):
        return []
    common, models = model_tables(f.values)
    if not models:
        raise BadInput(f"{f.path} [{f.table}]: no models; add a [{f.table}.models.<name>] table")
    check_model_names(f, models)
    return [
        Table(name, {**common, **table}, f"[{f.table}.models.{name}]")
        for name, table in models.items()
    ]


# ---- what a stage declares -------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """What a stage's defaults are filled in from: the run layout and the whole config file."""

    layout: RunLayout
    config: Mapping[str, Any]
    path: Path  # the config file, for messages


@dataclass(frozen=True)
class Wiring:
    """How a stage runs in a pipeline config (see the module docstring)."""

    table: str  # its config table, and its name in `arslice run --stage`
    writes: Output
    reads: tuple[Output, ...] = ()
    fan_out: Callable[[Fanned], list[Table]] = one
    # the run-layout paths (and other values) filled in where its table leaves them out; may
    # rewrite the table's own values that name run-layout outputs (count's "val")
    defaults: Callable[[Run, Table], dict] = lambda run, table: {}
    # keys of its table that belong to the pipeline, not to the stage's config (side_by_side)
    pipeline_keys: tuple[str, ...] = ()
    # another command for a table of another form (`[tokenizer] pretrained = NAME` copies one)
    variant: Callable[[Table, str], Any] | None = None
    # runs its configs ({name: config}) as the stage table says; default: one after another
    run_all: Callable[[Any, dict, Mapping, str], None] | None = None
    # the entry of one output in the marker of a per-config stage (`models/meta.json`)
    entry: Callable[[str, Path, dict], dict] = lambda name, out, meta: {"dir": str(out)}
    # the output a config writes (default: its `out`)
    output_of: Callable[[Any], Path] = field(default=lambda cfg: Path(cfg.out))
