"""The checkpoints a pipeline config's `[eval]` evaluates besides its models, one table each, for
the recall emergence (docs/design.md, "Recall emergence"):

    [eval]
    checkpoints = "all"             # every checkpoint each trained model keeps (or [800, 1600])
    checkpoint_windows = 64         # each checkpoint scored on 64 windows, evenly strided

    [eval.models.pythia-160m]
    model = "hf:EleutherAI/pythia-160m"
    checkpoints = ["step0", "step512", "step1000"]   # hub revisions: hf:ID@step512, ...
    tokens_per_step = 2097152       # tokens one training step saw (1024 rows of 2048)

Each checkpoint is evaluated into `losses/<model>@step<n>` (`ar_slicing.machinery.layout.CHECKPOINT_LOSSES`)
with `checkpoint_of`, `step`, `tokens_seen` and `window_subset` set; a trained model's checkpoint
records its own tokens seen (its meta.json). These keys belong to the pipeline, not to the eval
stage's config: `[eval]`'s are its wiring's `pipeline_keys`, a model table's are taken out here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import CHECKPOINT_LOSSES, KEPT_CHECKPOINTS_DIR, kept_checkpoint
from pipeline.wiring import Fanned, Table, model_tables

CHECKPOINT_KEYS = ("checkpoints", "checkpoint_windows", "tokens_per_step")
_STEP_REVISION = re.compile(r"step(\d+)")


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _shown(value: Any) -> str:
    import json

    return json.dumps(value)


def _window_subset(values: Mapping, where: str) -> int | None:
    n = values.get("checkpoint_windows")
    if n is not None and not _whole(n, 1):
        raise BadInput(
            f"{where}: checkpoint_windows = {_shown(n)} must be a whole number >= 1 (how many "
            "windows, evenly strided over all of them, each checkpoint is scored on)"
        )
    return n


def _steps(value: Any, where: str, what: str) -> list[int] | str:
    """`"all"` or the steps of a `checkpoints` value, refused naming the table and the key."""
    if value == "all":
        return value
    if isinstance(value, list) and all(_whole(s, 0) for s in value):
        return sorted(set(value))
    raise BadInput(
        f'{where}: checkpoints = {_shown(value)} must be "all" or a list of {what}, such as '
        "[800, 1600]"
    )


def _kept(train_values: Mapping, name: str) -> list[int]:
    """The steps `[train.models.<name>]` keeps (`keep_checkpoints`; its own, else [train]'s)."""
    common, models = model_tables(train_values)
    kept = models.get(name, {}).get("keep_checkpoints", common.get("keep_checkpoints", []))
    if not (isinstance(kept, list) and all(_whole(s, 0) for s in kept)):
        return []  # (the train stage's own check names what is wrong with it)
    return sorted(set(kept))


def _native_steps(model_dir: Path) -> list[int]:
    """The steps of the checkpoints kept in a native model folder that is there already."""
    found = (model_dir / KEPT_CHECKPOINTS_DIR).glob("step-*")
    return sorted(int(p.name[5:]) for p in found if p.name[5:].isdigit() and p.is_dir())


def trained_checkpoints(f: Fanned, common: dict, trained: list[str]) -> list[Table]:
    """A table per checkpoint `[eval] checkpoints` asks of the trained models."""
    where = f"{f.path} [{f.table}]"
    table = f.config.get(f.table, {})
    if "checkpoints" not in table:
        return []
    steps = _steps(table["checkpoints"], where, "training steps (whole numbers)")
    if not trained:
        raise BadInput(
            f"{where}: checkpoints applies to the trained models ([train.models.<name>]), and "
            "there are none; a hub model's checkpoints are its revisions, named in its own table: "
            '[eval.models.<name>] checkpoints = ["step1000", ...]'
        )
    windows = _window_subset(table, where)
    tables = []
    for name in trained:
        kept = _kept(f.config["train"], name)
        if steps != "all":
            missing = [s for s in steps if s not in kept]
            if missing:
                raise BadInput(
                    f"{where}: checkpoints = {_shown(steps)}: step(s) "
                    f"{', '.join(map(str, missing))} not kept by [train.models.{name}] "
                    f"(keep_checkpoints = {_shown(kept)}); keep them there, or ask for "
                    'checkpoints = "all"'
                )
        for step in kept if steps == "all" else steps:
            spec = f"native:{kept_checkpoint(f.layout.model(name), step)}"
            tables.append(_checkpoint_table(f, common, name, step, spec, None, windows))
    return tables


def listed_checkpoints(f: Fanned, common: dict, name: str, table: dict) -> list[Table]:
    """A table per checkpoint `[eval.models.<name>] checkpoints` asks for (taking the pipeline's
    keys out of `table`): revisions of a hub model, or steps a native model folder kept."""
    from models.checkpoints.registry import ModelSpec

    own = {k: table.pop(k) for k in CHECKPOINT_KEYS if k in table}
    shared = {k: v for k, v in f.config.get(f.table, {}).items() if k in CHECKPOINT_KEYS[1:]}
    values = {**shared, **own}
    if "checkpoints" not in own:
        return []
    where = f"{f.path} [{f.table}.models.{name}]"
    windows = _window_subset(values, where)
    spec = str(table.get("model", ""))
    parsed = ModelSpec.parse(spec)
    if parsed.prefix == "native":
        folder = parsed.path
        steps = _steps(own["checkpoints"], where, "the steps its folder kept (whole numbers)")
        steps = _native_steps(folder) if steps == "all" else steps
        return [
            _checkpoint_table(
                f, common, name, s, f"native:{kept_checkpoint(folder, s)}", None, windows,
                {**table, "model": None},
            )
            for s in steps
        ]  # fmt: skip
    revision = parsed.revision
    if not parsed.is_hub:
        raise BadInput(
            f"{where}: checkpoints names revisions of a hub model (hf:ID, based:ID) or steps "
            f"of a native model folder; {spec} is neither"
        )
    if revision is not None:
        raise BadInput(
            f"{where}: model = {_shown(spec)} already names a revision; name the model without "
            "it and its checkpoints' revisions in checkpoints"
        )
    revisions = own["checkpoints"]
    if not (isinstance(revisions, list) and all(isinstance(r, str) for r in revisions)):
        raise BadInput(
            f"{where}: checkpoints = {_shown(revisions)} must be a list of the hub model's "
            'revisions, such as ["step512", "step1000"] (Pythia\'s training steps)'
        )
    tokens_per_step = values.get("tokens_per_step")
    if not _whole(tokens_per_step, 1):
        raise BadInput(
            f"{where}: checkpoints needs tokens_per_step = <tokens one training step saw> (a "
            f"whole number >= 1; Pythia's: 2097152, 1024 rows of 2048 tokens), not "
            f"{_shown(tokens_per_step)}, to place each checkpoint by the tokens it had seen"
        )
    tables = []
    for revision in dict.fromkeys(revisions):
        found = _STEP_REVISION.fullmatch(revision)
        if found is None:
            raise BadInput(
                f"{where}: checkpoints: {_shown(revision)} is not a training step's revision "
                "(step<N>, such as Pythia's step512); a checkpoint is placed by its step"
            )
        step = int(found.group(1))
        tables.append(
            _checkpoint_table(
                f, common, name, step, f"{spec}@{revision}", step * tokens_per_step, windows,
                {**table, "model": None},
            )
        )  # fmt: skip
    return tables


def _checkpoint_table(
    f: Fanned,
    common: dict,
    model: str,
    step: int,
    spec: str,
    tokens_seen: int | None,
    windows: int | None,
    own: dict | None = None,
) -> Table:
    """The eval table of the checkpoint of `model` at `step` (`own`: its model table's keys)."""
    name = CHECKPOINT_LOSSES.format(model, step)
    values = {**common, **{k: v for k, v in (own or {}).items() if v is not None}}
    values.update(model=spec, checkpoint_of=model, step=step, window_subset=windows)
    if tokens_seen is not None:  # (a trained model's checkpoint records its own)
        values["tokens_seen"] = tokens_seen
    where = f"[{f.table}.models.{model}]" if own is not None else f"[{f.table}]"
    return Table(name, {k: v for k, v in values.items() if v is not None}, f"{where} {name}")
