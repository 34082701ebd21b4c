"""The eval stage in a pipeline config: `[eval]` shared by every model, each trained model (as
`native:<dir>`) and each `[eval.models.<name>]` with a `model` spec evaluated into `losses/<name>/`,
then the checkpoints `checkpoints` asks for, each into `losses/<name>@step<n>/`
(`pipeline.eval.checkpoints`)."""

from __future__ import annotations

from pathlib import Path

from ar_slicing.errors import BadInput
from pipeline.eval.checkpoints import listed_checkpoints, trained_checkpoints
from pipeline.wiring import Fanned, Run, Table, check_model_names, is_model_name, model_tables


def evaluated_models(f: Fanned) -> list[Table]:
    """Every trained model, then every `[eval.models.<name>]` table, then their checkpoints."""
    common, extra = model_tables(f.values)
    check_model_names(f, extra)
    trained = list(model_tables(f.config["train"])[1]) if f.config.get("train") else []
    trained = [n for n in trained if is_model_name(n)]  # (the others: refused by [train]'s check)
    overlap = sorted(set(trained) & set(extra))
    if overlap:
        raise BadInput(
            f"{f.path}: model name(s) {', '.join(overlap)} are both trained and listed in "
            "[eval.models]; give the external checkpoint another name"
        )
    entries = {name: {"model": f"native:{f.layout.model(name)}"} for name in trained}
    for name, table in extra.items():
        if "model" not in table:
            from models.checkpoints.registry import formats

            prefixes = ", ".join(f"{c.prefix}:..." for c in formats())
            raise BadInput(
                f'{f.path} [{f.table}.models.{name}]: needs `model = "<spec>"` ({prefixes})'
            )
        entries[name] = table
    if not entries:
        raise BadInput(
            f"{f.path}: nothing to evaluate; add [train.models.<name>] or "
            "[eval.models.<name>] tables"
        )
    checkpoints = trained_checkpoints(f, common, trained)
    for name, table in extra.items():
        checkpoints += listed_checkpoints(f, common, name, table)  # (takes its keys out of table)
    tables = [
        Table(name, {**common, **table}, f"[{f.table}.models.{name}]")
        for name, table in entries.items()
    ]
    clash = sorted({t.name for t in tables} & {t.name for t in checkpoints})
    if clash:
        raise BadInput(
            f"{f.path}: model name(s) {', '.join(clash)} are also the losses folders of "
            "checkpoints (<model>@step<n>); give the model another name"
        )
    return tables + checkpoints


def defaults(run: Run, table: Table) -> dict:
    return {"tags": run.layout.tags, "out": run.layout.losses(table.name), "name": table.name}


def losses_entry(name: str, out: Path, meta: dict) -> dict:
    """An evaluated model (or checkpoint: its model and step) in `losses/meta.json`."""
    entry = {"dir": str(out), "spec": meta.get("spec"), "tokens": meta.get("tokens")}
    if meta.get("checkpoint_of") is not None:
        entry.update({k: meta.get(k) for k in ("checkpoint_of", "step", "tokens_seen")})
    return entry


def eval_hub_names(cfg, where: str) -> list[tuple[str, str, str]]:
    """The model an evaluation would fetch from the hub."""
    from ar_slicing.machinery import hub

    spec = cfg.spec
    if spec.reads_hub and hub.is_hub_name(spec.written):
        return [(f"model {cfg.model} ({where})", spec.written, "model")]
    return []
