"""Models made elsewhere by this trainer, taken instead of trained (`[train] prebuilt = FOLDER`,
`arslice train --prebuilt FOLDER`), and the folder they are taken from (`arslice export-models`,
what `make demo-models` runs).

A folder of prebuilt models holds a README.md saying how it was made and, per model, `<name>/`:
`prebuilt.json` (the training settings as the stage plan records them, the sha256 of the
training and validation token streams, the tokenizer's fingerprint, the sha256 of every other
file of the model's folder, the trainer's summary, and the machine, versions and time of the
training), `config.json`, `model.safetensors` with every
tensor bf16 holds exactly stored in bf16 (half the size: every parameter, since such a model was
trained with `saved_dtype = "bf16"`), and `checkpoints/step-<n>/` for each checkpoint it kept.

A model is taken only when it was made with exactly the settings asked for (`train_settings`, what
the stage plan records, except which checkpoints it kept: the folder need only hold the kept ones a
run does not train itself, those after `train_here_until`) from exactly the same token streams,
compared by content (`TokenStore.tokens_sha256`: a store's plan identity records paths and times,
which differ between machines), and only when every file of its folder has the sha256 recorded
at export, and no file was added (`refuse_changed_files`: a flipped weight byte, an edited
config.json, a damaged header are named, file by file, before any stage runs). Its weights are
upcast to fp32 and written as the trainer writes
them, so a model taken from the folder and one trained here with the same settings are the same
bytes on the machine that made the folder, and the same digits elsewhere (both rounded to bf16).
Anything else is refused, naming what differs and how to train here instead. A taken model is the
train stage's output like a trained one (the same plan, so the same identity to the evaluations that
read it); its meta.json says where it came from (`prebuilt`).
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import (
    atomic_dir,
    atomic_path,
    read_json,
    to_jsonable,
    write_json_atomic,
)
from ar_slicing.machinery.layout import (
    META_NAME,
    MODEL_CONFIG_NAME,
    MODEL_WEIGHTS_NAME,
    PREBUILT_README,
    PREBUILT_RECORD,
    kept_checkpoint,
)
from pipeline.config import config_to_dict, say
from pipeline.stage import Finished
from pipeline.train.config import TrainConfig

# what the README and the refusals tell a person who wants the models trained here
TRAIN_HERE = (
    "`make all DEMO_TRAIN=1` (`arslice run --config CONFIG --train-here`; `arslice train` "
    "without --prebuilt)"
)
# the trained model's meta.json fields that belong to the run, not to the model
_RUN_FIELDS = ("plan", "ledger", "written", "owns", "config", "inputs")


class PrebuiltMismatch(BadInput):
    """A prebuilt model made with other settings or from other token streams than asked for."""


def prebuilt_model(cfg: TrainConfig) -> Path:
    """The folder of the prebuilt model `cfg` would take: FOLDER/<the name of OUT>."""
    return Path(cfg.prebuilt) / Path(cfg.out).name


def _record(cfg: TrainConfig) -> dict:
    folder = prebuilt_model(cfg)
    path = folder / PREBUILT_RECORD
    if not path.is_file():
        raise PrebuiltMismatch(
            f"train {folder.name}: no prebuilt model {folder} (no {PREBUILT_RECORD} there)"
            + _train_here(cfg, None)
        )
    return read_json(path)


def _train_here(cfg: TrainConfig, record: Mapping | None) -> str:
    """How to train the model here instead, and how long it took where the folder was made."""
    took = ""
    made = (record or {}).get("made") or {}
    if made.get("train_wall_time_s") is not None:  # (0.0 for a few steps of a tiny model)
        minutes = made["train_wall_time_s"] / 60
        took = (
            f"; training the folder's models took {minutes:.1f} min on {made.get('machine')} "
            f"({Path(cfg.prebuilt) / PREBUILT_README})"
        )
    return f"\n  train it here instead: {TRAIN_HERE}{took}"


# Which checkpoints a run keeps decides nothing of its weights (keeping one touches neither the
# weights, the optimizer nor any random state: `loop.train_steps`), so a folder is taken whatever
# steps it was exported keeping, as long as it holds every kept one the run does not train
# itself (`_refuse_missing`). Points of a recall emergence can then be added without training
# the folder's models again.
_NOT_COMPARED = ("keep_checkpoints",)


# A folder exported before training pinned torch's CPU kernels records no `cpu_kernels`: its
# models are taken as the bytes its sha256 check holds (the same files on every machine); the
# steps a run trains itself beside them are pinned (`made_before_the_pin`, recorded in meta.json).
_PIN = "cpu_kernels"


def made_before_the_pin(record: Mapping) -> bool:
    """True when a prebuilt model's record was written before training pinned the CPU kernels."""
    settings = record.get("settings")
    return isinstance(settings, Mapping) and _PIN not in settings


def _compared(settings: Mapping | None, skip: tuple[str, ...] = ()) -> dict | None:
    if not isinstance(settings, Mapping):
        return settings
    return {k: v for k, v in settings.items() if k not in _NOT_COMPARED + skip}


def _refuse_mismatch(cfg: TrainConfig, record: Mapping, asked: Mapping) -> None:
    """Refuse a prebuilt model made otherwise than `asked` (settings, and token streams when
    given), or whose folder lacks a kept checkpoint the run does not train itself."""
    from ar_slicing.machinery.plan import differences

    skip = (_PIN,) if made_before_the_pin(record) else ()
    made = {k: _compared(record.get(k), skip) if k == "settings" else record.get(k) for k in asked}
    asked = {k: _compared(v, skip) if k == "settings" else v for k, v in asked.items()}
    lines = differences(made, asked)
    if lines:
        raise PrebuiltMismatch(
            f"train {Path(cfg.out).name}: the prebuilt model {prebuilt_model(cfg)} was made with "
            "other settings or from other token streams than asked for (prebuilt -> asked):\n    "
            + "\n    ".join(lines)
            + _train_here(cfg, record)
        )
    _refuse_missing(cfg, record)


def check_prebuilt_settings(cfg: TrainConfig, dtype: str | None = None) -> None:
    """Refuse, before anything runs, a prebuilt model that is missing, was made with other
    settings or whose files are not the ones exported (its token streams are compared when the
    training store is there: `take`)."""
    from pipeline.train.state import train_settings

    record = _record(cfg)
    _refuse_mismatch(cfg, record, {"settings": train_settings(cfg, dtype)})
    refuse_changed_files(cfg, record)


def folder_files(folder: Path) -> dict[str, str]:
    """The sha256 of every file under a prebuilt model's folder but its prebuilt.json, by path
    relative to it (POSIX separators)."""
    from ar_slicing.machinery.io import sha256_file

    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() != PREBUILT_RECORD
    }


def refuse_changed_files(cfg: TrainConfig, record: Mapping) -> None:
    """Refuse a prebuilt model whose folder is not byte for byte what was exported: each file
    whose sha256 is not the one prebuilt.json records (both named), each recorded file that is
    missing and each file it does not record."""
    folder = prebuilt_model(cfg)
    name = Path(cfg.out).name
    recorded = record.get("files")
    if not isinstance(recorded, Mapping) or not recorded:
        raise PrebuiltMismatch(
            f"train {name}: {folder / PREBUILT_RECORD} records no sha256 of the folder's files "
            "(it was exported before they were recorded), so what would be taken is unchecked; "
            "make the folder again (`make demo-models`)" + _train_here(cfg, record)
        )
    found = folder_files(folder)
    lines = [
        f"{folder / rel}: sha256 {found[rel]}, recorded {sha}"
        if rel in found
        else f"{folder / rel}: missing (recorded sha256 {sha})"
        for rel, sha in sorted(recorded.items())
        if found.get(rel) != sha
    ]
    lines += [
        f"{folder / rel}: not recorded in {PREBUILT_RECORD}" for rel in found if rel not in recorded
    ]
    if lines:
        raise PrebuiltMismatch(
            f"train {name}: the prebuilt model {folder} is not what was exported: "
            + "; ".join(lines)
            + f". Restore the folder (git checkout {folder}), make it again (`make demo-models`) "
            "or train the models here (`make all DEMO_TRAIN=1`)"
        )


def _refuse_missing(cfg: TrainConfig, record: Mapping) -> None:
    """Refuse a folder that lacks a kept checkpoint the run does not train itself (those up to
    `train_here_until`)."""
    from pipeline.train.state import kept_steps, steps_trained_here

    folder, here = prebuilt_model(cfg), steps_trained_here(cfg)
    missing = [
        s for s in kept_steps(cfg) if s not in here and not kept_checkpoint(folder, s).is_dir()
    ]
    if missing:
        held = record.get("checkpoints_in_folder") or []
        raise PrebuiltMismatch(
            f"train {Path(cfg.out).name}: {folder} lacks the kept checkpoint(s) of step(s) "
            f"{', '.join(map(str, missing))} (it holds {', '.join(map(str, held)) or 'none'}); "
            f"a run trains only the kept checkpoints up to train_here_until = "
            f"{cfg.train_here_until} itself: raise train_here_until to {max(missing)}, or keep "
            "only steps the folder holds" + _train_here(cfg, record)
        )


def streams_of(inputs) -> dict:
    """What identifies a run's token streams wherever it is: their contents' sha256, and the
    tokenizer's fingerprint."""
    return {
        "tokens_sha256": inputs.store.tokens_sha256,
        "val_tokens_sha256": inputs.val_store.tokens_sha256 if inputs.val_store else None,
        "fingerprint": inputs.store.fingerprint,
    }


# ---- weights in the folder: bf16 where that is exact ------------------------------------------


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # a damaged header or tensor data: safetensors' own error, one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise BadInput(
            f"{path}: not a readable safetensors file ({type(e).__name__}: {first}); write it "
            "again (train the model again, or restore the folder it came from)"
        ) from None


def write_halved(src: Path, dst: Path) -> None:
    """`src`'s weights with every fp32 tensor that bf16 holds exactly stored in bf16: no value
    changes, and a model saved with `saved_dtype = "bf16"` takes half the bytes."""
    import torch

    from models.checkpoints.native import write_weights

    def halved(v):
        if v.dtype != torch.float32:
            return v
        bf16 = v.to(torch.bfloat16)
        return bf16 if torch.equal(bf16.to(torch.float32), v) else v

    write_weights({k: halved(v) for k, v in _weights(src).items()}, dst)


def write_upcast(src: Path, dst: Path) -> None:
    """`src`'s weights with every bf16 tensor back in fp32: the bytes the trainer writes."""
    import torch

    from models.checkpoints.native import write_weights

    state = _weights(src)
    write_weights({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()}, dst)


def _copy(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


# ---- taking a model from the folder ---------------------------------------------------------------


def take_prebuilt(
    stage, cfg: TrainConfig, dtype: str, t0: float, train_first, kernels: dict
) -> Finished:
    """Put the prebuilt model asked for into the stage's output (its plan is the one asked for):
    the model, its tokenizer and its kept checkpoints, each recorded in the ledger as training
    records them, then meta.json; refused (nothing written) when it was made otherwise. The kept
    checkpoints up to `train_here_until` are trained here: `train_first(steps, inputs)`, with
    the CPU kernels `kernels` (`models.cpu_kernels.reported`)."""
    from models.checkpoints.native import copy_tokenizer
    from pipeline.train.loop import TrainInputs
    from pipeline.train.state import (
        KEPT_FILES,
        kept_part,
        kept_record,
        kept_steps,
        steps_trained_here,
        train_settings,
    )

    inputs = TrainInputs.open(cfg)
    record = _record(cfg)
    _refuse_mismatch(cfg, record, {"settings": train_settings(cfg, dtype), **streams_of(inputs)})
    refuse_changed_files(cfg, record)
    folder, out = prebuilt_model(cfg), stage.out
    here = steps_trained_here(cfg)
    if made_before_the_pin(record):
        say(
            f"train {Path(cfg.out).name}: the folder's model was trained before the CPU kernels "
            f"were pinned (on {(record.get('made') or {}).get('machine')}); it is taken as the "
            "files its sha256 hold, and the steps trained here are pinned"
        )
    if here:
        say(f"train {Path(cfg.out).name}: steps 1-{max(here)} here, for the checkpoints of {here}")
        train_first(here, inputs)
    for step in kept_steps(cfg):
        if step in here:
            continue
        target = kept_checkpoint(out, step)
        with atomic_dir(target) as tmp:
            source = kept_checkpoint(folder, step)
            _copy(source / MODEL_CONFIG_NAME, tmp / MODEL_CONFIG_NAME)
            write_upcast(source / MODEL_WEIGHTS_NAME, tmp / MODEL_WEIGHTS_NAME)
            write_json_atomic(tmp / META_NAME, kept_record(cfg, step, inputs.order.n_rows, stage))
        stage.record(kept_part(step), [target / name for name in KEPT_FILES], step=step)
    write_upcast(folder / MODEL_WEIGHTS_NAME, out / MODEL_WEIGHTS_NAME)
    if inputs.tokenizer_json is not None:
        copy_tokenizer(inputs.tokenizer_json, out)
    _copy(folder / MODEL_CONFIG_NAME, out / MODEL_CONFIG_NAME)  # (last: the model is whole)
    meta = {
        **record["trained"],
        "checkpoints": kept_steps(cfg),  # (the run's own, whichever the folder was made keeping)
        "config": to_jsonable(config_to_dict(cfg)),
        "inputs": inputs.described(),
        "cpu_kernels": kernels,  # (the steps trained here; the folder's in record["trained"])
        "prebuilt": {
            "folder": str(folder.resolve()),
            "made": record.get("made"),
            "cpu_kernels": (record.get("settings") or {}).get(_PIN, "not pinned (made before)"),
        },
        "wall_time_s": round(time.time() - t0, 3),
    }
    taken = f"train {cfg.arch}: taken from {folder} (the same settings and tokens)"
    return Finished(meta, [taken])


def held_as_asked(cfg: TrainConfig) -> bool:
    """True when the prebuilt folder holds the model `cfg` asks for, made exactly so (settings,
    token streams, every file as exported): what `take_prebuilt` would take."""
    from pipeline.train.loop import TrainInputs
    from pipeline.train.state import train_settings

    if cfg.prebuilt is None:
        return False
    try:
        record = _record(cfg)
        streams = streams_of(TrainInputs.open(cfg))
        _refuse_mismatch(cfg, record, {"settings": train_settings(cfg), **streams})
        refuse_changed_files(cfg, record)
    except PrebuiltMismatch:
        return False
    return True


def only_models_to_make(configs: Mapping[str, TrainConfig], config: dict) -> dict:
    """`config` with only the [train.models] the prebuilt folder does not hold as asked
    (`arslice run --train-missing`, what `make demo-models` runs): the others are left out."""
    missing = [c.tokens for c in configs.values() if not (Path(c.tokens) / META_NAME).is_file()]
    if missing:
        raise BadInput(
            f"--train-missing compares the folder's models with the run's token streams, and "
            f"{missing[0]} is not made yet: tokenize first (`arslice run --config CONFIG --stage "
            "tokenizer tokenize`; `make demo-models` does)"
        )
    held = {name for name, cfg in configs.items() if held_as_asked(cfg)}
    train = dict(config.get("train") or {})
    train["models"] = {k: v for k, v in (train.get("models") or {}).items() if k not in held}
    return {**config, "train": train}


def without_prebuilt(config: dict) -> dict:
    """A pipeline config whose [train] models are all trained here (`arslice run --train-here`):
    `prebuilt` taken out of the [train] table and of every [train.models.<name>]."""
    train = config.get("train")
    if not isinstance(train, Mapping):
        return config
    table = {k: v for k, v in train.items() if k != "prebuilt"}
    models = table.get("models")
    if isinstance(models, Mapping):
        table["models"] = {
            name: {k: v for k, v in t.items() if k != "prebuilt"} if isinstance(t, Mapping) else t
            for name, t in models.items()
        }
    return {**config, "train": table}


# ---- writing the folder -----------------------------------------------------------------------


def machine() -> str:
    """The machine a model was trained on, in words (its CPU, cores and system)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def export_model(cfg: TrainConfig, folder: Path, made: dict) -> dict:
    """Write the model `cfg` trained (complete, trained here with `saved_dtype = "bf16"`, from
    the stores it names as they are now) to FOLDER/<name>/, replacing an earlier export of it;
    returns its prebuilt.json."""
    from ar_slicing.machinery.plan import identity
    from pipeline.train.loop import TrainInputs
    from pipeline.train.state import steps_trained_here

    out = Path(cfg.out)
    name = out.name
    if not (out / META_NAME).is_file():
        raise BadInput(f"export {name}: {out} is not a complete trained model; train it first")
    meta = read_json(out / META_NAME)
    settings = (meta.get("plan") or {}).get("settings") or {}
    if meta.get("prebuilt"):
        raise BadInput(
            f"export {name}: {out} was taken from {meta['prebuilt'].get('folder')}, not trained "
            f"here; train it here first ({TRAIN_HERE})"
        )
    if settings.get("saved_dtype") != "bf16":
        raise BadInput(
            f"export {name}: {out} was saved in fp32; a prebuilt folder stores bf16 weights, so "
            'train it with saved_dtype = "bf16" (the weights a run then takes from the folder '
            "are the ones it would train)"
        )
    if meta["plan"]["inputs"].get("tokens") != identity(cfg.tokens):
        raise BadInput(
            f"export {name}: the training store {cfg.tokens} is not the one {out} was trained "
            "on (it was made again since); train the model again first"
        )
    early = steps_trained_here(cfg)
    # the kept checkpoints the folder holds (a run taking the model trains the others itself)
    held = [s for s in settings.get("keep_checkpoints", []) if s not in early]
    record = {
        "settings": settings,
        "checkpoints_in_folder": held,
        **streams_of(TrainInputs.open(cfg)),
        "trained": {k: v for k, v in meta.items() if k not in _RUN_FIELDS},
        "made": made,
    }
    target = folder / name
    if target.exists() and not (target / PREBUILT_RECORD).is_file():
        raise BadInput(
            f"export {name}: {target} holds no {PREBUILT_RECORD}, so it is not an export of "
            "this project; move it away or choose another folder"
        )
    with atomic_dir(target) as tmp:
        _copy(out / MODEL_CONFIG_NAME, tmp / MODEL_CONFIG_NAME)
        write_halved(out / MODEL_WEIGHTS_NAME, tmp / MODEL_WEIGHTS_NAME)
        for step in held:
            source, kept = kept_checkpoint(out, step), kept_checkpoint(tmp, step)
            kept.mkdir(parents=True)
            _copy(source / MODEL_CONFIG_NAME, kept / MODEL_CONFIG_NAME)
            write_halved(source / MODEL_WEIGHTS_NAME, kept / MODEL_WEIGHTS_NAME)
        record["files"] = folder_files(tmp)  # (what a run taking the model checks first)
        write_json_atomic(tmp / PREBUILT_RECORD, record)
    return record


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def readme(folder: Path, records: dict[str, dict]) -> str:
    """The folder's README.md: how it was made, on what, and the models in it."""
    from models.checkpoints.registry import fmt_params

    rows = [
        "| model | arch | parameters | steps | tokens seen | kept checkpoints | final val loss |",
        "| :--- | :--- | ---: | ---: | ---: | :--- | ---: |",
    ]
    for name, r in records.items():
        t = r["trained"]
        held = r.get("checkpoints_in_folder", r["settings"].get("keep_checkpoints", []))
        here = [s for s in r["settings"].get("keep_checkpoints", []) if s not in held]
        kept = ", ".join(map(str, held)) or "none"
        if here:
            kept += f" (and {', '.join(map(str, here))}, which a run taking it trains itself)"
        val = t.get("final_val_loss")
        rows.append(
            f"| {name} | {t.get('arch')} | {fmt_params(t.get('n_params'))} | {t.get('step'):,} "
            f"| {t.get('tokens_seen'):,} | {kept} | {'—' if val is None else f'{val:.3f}'} |"
        )
    size = folder_bytes(folder)
    return "\n".join(
        [
            "# Prebuilt demo models",
            "",
            "The trained models `make all` evaluates, so that it need not train them: each is "
            "taken instead of trained when `[train]` asks for exactly the settings its "
            f"`{PREBUILT_RECORD}` records, the run's token streams have the sha256 recorded "
            "there and every file of its folder the sha256 recorded there; otherwise `make all` "
            f"refuses and says so. {TRAIN_HERE} trains them here instead. `make demo-models` "
            "trains only the models of the config this folder does not hold made so, and keeps "
            "the others.",
            "",
            *(line for group in _made_groups(records) for line in _made_lines(*group)),
            f"Weights: bf16 (every parameter; a buffer bf16 does not hold exactly stays fp32), "
            f"upcast to fp32 when taken; {size / 1e6:.1f} MB in all.",
            "",
            *rows,
            "",
        ]
    )


def _made_groups(records: dict[str, dict]) -> list[tuple[dict, list[str]]]:
    """The folder's models grouped by the command run that made them (in the order made)."""
    groups: list[tuple[dict, list[str]]] = []
    for name, r in records.items():
        made = r.get("made") or {}
        for seen, names in groups:
            if seen == made:
                names.append(name)
                break
        else:
            groups.append((made, [name]))
    return sorted(groups, key=lambda g: g[0].get("created_at") or "")


def _made_lines(made: dict, names: list[str]) -> list[str]:
    kernels = made.get("cpu_kernels")
    return [
        f"Made by `{made.get('command')}` ({', '.join(names)}):",
        "",
        f"- when: {made.get('created_at')} (git {made.get('git_hash')})",
        f"- training took: {(made.get('train_wall_time_s') or 0) / 60:.1f} min (the train stage, "
        "as the config runs it)",
        f"- Python {made.get('python')}, torch {made.get('torch')}",
        f"- machine: {made.get('machine')}",
        f"- torch's CPU kernels pinned for training: {kernels or 'no (made before they were)'}",
        "",
    ]


def export_models(configs: Mapping[str, TrainConfig], folder: Path, made: dict) -> dict:
    """Every model of `configs` into `folder`, then its README.md; returns the records. A model
    the folder already holds made exactly as asked (`held_as_asked`) is kept as it is, so `make
    demo-models` need train only the models added to the config."""
    import dataclasses

    from ar_slicing.machinery.io import write_bytes_atomic

    folder.mkdir(parents=True, exist_ok=True)
    records = {}
    for name, cfg in configs.items():
        asked = dataclasses.replace(cfg, prebuilt=str(folder))
        if held_as_asked(asked):
            records[name] = read_json(prebuilt_model(asked) / PREBUILT_RECORD)
        else:
            records[name] = export_model(cfg, folder, made)
    write_bytes_atomic(folder / PREBUILT_README, readme(folder, records).encode())
    return records


def made_by(command: str, train_wall_time_s: float) -> dict:
    """How a folder's models were made: the command, the training's wall time, the versions."""
    import torch

    from ar_slicing.machinery.io import git_hash
    from models import cpu_kernels

    return {
        "command": command,
        "train_wall_time_s": round(train_wall_time_s, 1),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_hash": git_hash(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": machine(),
        "cpu_kernels": cpu_kernels.plan_setting(),
    }
