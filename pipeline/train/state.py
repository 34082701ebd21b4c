"""What a training run is (its plan settings, checked before it starts), the model it builds, the
periodic checkpoints under `OUT/.train-state/` that a killed run resumes from, and the
checkpoints it keeps under `OUT/checkpoints/`.

A checkpoint is a part of the stage's ledger: `.train-state/step-<n>/` (model, optimizer,
state.json) is written whole under a temporary name, recorded, and only then is the one before
it removed, so a kill at any moment leaves a recorded checkpoint whole (or none yet). A kept
checkpoint (`keep_checkpoints`) is a part too, `checkpoints/step-<n>/` (config.json,
model.safetensors and a meta.json recording its step and the tokens seen), written whole and
recorded the same way; it outlives the run, as part of the trained output."""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import (
    atomic_dir,
    os_errors_of,
    read_json,
    write_json_atomic,
)
from ar_slicing.machinery.layout import (
    META_NAME,
    MODEL_CONFIG_NAME,
    MODEL_WEIGHTS_NAME,
    TOKENIZER_NAME,
    kept_checkpoint,
    train_state,
)
from ar_slicing.machinery.limits import require_memory
from pipeline.config import config_to_dict
from pipeline.train.config import _RESUMABLE_CHANGES, TrainConfig
from pipeline.train.model import (
    model_config_for,
)

log = logging.getLogger(__name__)


def train_settings(cfg: TrainConfig, dtype: str | None = None) -> dict:
    """What decides the trained weights besides the token stores (the settings of the plan; a
    saved state is only resumed under the same plan). `dtype` is the resolved one."""
    from models.precision import resolve_device, resolve_dtype

    settings = {
        k: v
        for k, v in config_to_dict(cfg).items()
        if k not in _RESUMABLE_CHANGES and k not in ("tokens", "val_tokens", "out", *_ONLY_SET)
    }
    device = resolve_device(cfg.device)
    if dtype is None:
        dtype = resolve_dtype(cfg.dtype, device, training=True)
    # recorded only when set, so the plans of models trained without them stay the same
    if cfg.keep_checkpoints:
        settings["keep_checkpoints"] = kept_steps(cfg)
    if cfg.saved_dtype != _ONLY_SET["saved_dtype"]:
        settings["saved_dtype"] = cfg.saved_dtype
    if device == "cpu":  # the instruction sets of torch's CPU kernels (models.cpu_kernels)
        from models import cpu_kernels

        settings["cpu_kernels"] = cpu_kernels.plan_setting()
    return {**settings, "dtype": dtype}


# settings recorded in the plan only when not at these defaults (`train_settings`)
_ONLY_SET = {"keep_checkpoints": [], "saved_dtype": "fp32"}


def kept_steps(cfg: TrainConfig) -> list[int]:
    """The steps whose model the run keeps, in order (each once)."""
    return sorted(set(cfg.keep_checkpoints))


def steps_trained_here(cfg: TrainConfig) -> list[int]:
    """The kept steps a run taking its model from a prebuilt folder trains here itself
    (`train_here_until`); the folder holds the others."""
    return [s for s in kept_steps(cfg) if s <= cfg.train_here_until] if cfg.train_here_until else []


def validate_train(cfg: TrainConfig) -> None:
    if cfg.steps <= 0 or cfg.batch_size <= 0 or cfg.seq_len <= 0:
        raise ArSliceError("--steps, --batch-size and --seq-len must be positive")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ArSliceError(f"--lr {cfg.lr}: must be a finite positive number, such as 3e-4")
    if cfg.warmup_steps < 0 or cfg.eval_batches < 1:
        raise ArSliceError("--warmup-steps must be >= 0 and --eval-batches >= 1")
    late = [s for s in cfg.keep_checkpoints if not 0 <= s < cfg.steps]
    if late:
        raise ArSliceError(
            f"--keep-checkpoints {' '.join(map(str, late))}: a kept step must be from 0 to "
            f"{cfg.steps - 1}, before the last step; the final model (step {cfg.steps}) is "
            "always kept, as OUT itself"
        )
    if not 0 <= cfg.train_here_until < cfg.steps:
        raise ArSliceError(
            f"--train-here-until {cfg.train_here_until}: must be from 0 to {cfg.steps - 1} "
            "(the kept checkpoints up to that step are trained here, the rest taken)"
        )
    model = build_model(model_config_for(cfg, vocab_size=256), device="meta")  # shapes: no memory
    require_memory(
        step_memory(cfg, model),
        f"--batch-size {cfg.batch_size} of --seq-len {cfg.seq_len}: one training step",
        "lower --batch-size or --seq-len",
    )


def step_memory(cfg: TrainConfig, model) -> int:
    """Bytes one training step holds at least (the model built on the meta device): the weights
    with their gradients and Adam's two moments (four fp32 copies), and what the backward pass
    keeps of the forward one, about 12 fp32 values per token, block and channel plus the logits
    and their gradient (a lower bound: the vocabulary here is the smallest, 256)."""
    parameters = sum(p.numel() for p in model.parameters())
    tokens = cfg.batch_size * cfg.seq_len
    per_token = 4 * (12 * cfg.n_layers * cfg.d_model + 2 * model.config.vocab_size)
    return 16 * parameters + tokens * per_token


def build_model(model_cfg, device: str):
    """The LanguageModel of `model_cfg` on `device` ("meta": shapes only, for validation)."""
    import torch

    from models.backbone import LanguageModel

    try:
        with torch.device(device):
            return LanguageModel(model_cfg)
    except (TypeError, ValueError) as e:
        raise ArSliceError(
            f"cannot build the model for --arch {model_cfg.sequence_mixer}: {e}"
        ) from None


CHECKPOINT = "checkpoint"  # the ledger's names of checkpoints: "checkpoint <step>"
# a resumable checkpoint's files: the model's weights, the optimizer's state, the step and history
OPTIMIZER_NAME = "optimizer.pt"
STATE_NAME = "state.json"
STATE_FILES = (MODEL_WEIGHTS_NAME, OPTIMIZER_NAME, STATE_NAME)


def save_state(state_dir: Path, model, optimizer, step: int, extra: dict) -> None:
    """Write the resumable checkpoint (model, optimizer, step) to the folder `state_dir`
    atomically (replacing one there)."""
    import torch
    from safetensors.torch import save_model

    with atomic_dir(state_dir) as tmp:
        # save_model (not save_file) handles the tied embedding / output head
        with os_errors_of(tmp / MODEL_WEIGHTS_NAME):
            save_model(model, str(tmp / MODEL_WEIGHTS_NAME))
        # (serialized here, written by Python: torch's own writer reports a full disk only as
        # "unexpected pos")
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        (tmp / OPTIMIZER_NAME).write_bytes(buffer.getvalue())
        write_json_atomic(tmp / STATE_NAME, {"step": step, **extra})


def load_state(state_dir: Path, model, optimizer, device: str) -> dict | None:
    """Restore a saved state into `model` and `optimizer`; None when there is none to resume.
    (A state is only there under the same stage plan: another plan is refused or cleared first.)
    A file of it that is not what the trainer wrote (a pickle carrying code, a truncated or
    foreign file) is refused in one line naming it; none of its code runs (weights only)."""
    import warnings

    import torch
    from safetensors.torch import load_model

    from models.checkpoints.io import refused_global

    if not (state_dir / STATE_NAME).is_file():
        return None
    reading = state_dir / STATE_NAME
    try:
        state = read_json(reading)
        reading = state_dir / MODEL_WEIGHTS_NAME
        load_model(model, str(reading), device=device)
        reading = state_dir / OPTIMIZER_NAME
        with warnings.catch_warnings():  # (torch warns of a foreign file's pickle protocol)
            warnings.simplefilter("ignore")
            saved = torch.load(reading, map_location=device, weights_only=True)
        optimizer.load_state_dict(saved)
    except Exception as e:  # whatever the file holds, the resume stops here, in one line
        name = refused_global(str(e))
        first = (str(e).strip().splitlines() or [""])[0]
        what = f"a pickle naming {name}, which is not loaded" if name else first
        raise ArSliceError(
            f"cannot resume the training from {reading}: not what the trainer wrote "
            f"({type(e).__name__}: {what}); pass --overwrite to start the training over"
        ) from None
    return state


def checkpoint(stage, model, optimizer, progress) -> None:
    """Save the run's checkpoint at `progress.step` and record it in the stage's ledger, then
    remove the checkpoints before it."""
    from ar_slicing.machinery.ownership import remove_work

    state_dir = train_state(stage.out, progress.step)
    save_state(state_dir, model, optimizer, progress.step, progress.saved())
    stage.record(
        f"{CHECKPOINT} {progress.step:08d}",
        [state_dir / f for f in STATE_FILES],
        step=progress.step,
    )
    for old in state_dir.parent.glob("step-*"):
        if old.name != state_dir.name:
            remove_work(old)


KEPT = "kept"  # the ledger's names of kept checkpoints: "kept <step>"
KEPT_FILES = (MODEL_CONFIG_NAME, MODEL_WEIGHTS_NAME, META_NAME)  # a kept checkpoint's files


def kept_part(step: int) -> str:
    return f"{KEPT} {step:08d}"


def kept_record(cfg: TrainConfig, step: int, rows_per_epoch: int, stage) -> dict:
    """A kept checkpoint's meta.json: where it stands along training (`step`, `tokens_seen`, as
    a trained model's meta.json says them; `models.checkpoints.native.training_point` reads
    both) and the plan of the run that kept it, which with the step identifies its weights."""
    from ar_slicing.machinery.plan import digest

    return {
        "stage": "train",
        "kept_checkpoint": True,
        "arch": cfg.arch,
        "step": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "epochs": step * cfg.batch_size / rows_per_epoch,
        "train_plan": digest(stage.plan),
    }


def keep_checkpoint(stage, model, cfg: TrainConfig, step: int, rows_per_epoch: int) -> None:
    """Write the model at `step` as the kept checkpoint OUT/checkpoints/step-<step>/, whole or
    not at all, and record it in the stage's ledger (nothing to do when the ledger holds it)."""
    from models.checkpoints.native import save_native

    part = kept_part(step)
    if stage.done(part) is not None:
        return
    folder = kept_checkpoint(stage.out, step)
    with atomic_dir(folder) as tmp:
        # (copies the weights: the model goes on training untouched)
        save_native(model, tmp, saved_dtype=cfg.saved_dtype)
        write_json_atomic(tmp / META_NAME, kept_record(cfg, step, rows_per_epoch, stage))
    stage.record(part, [folder / name for name in KEPT_FILES], step=step)


def final_files(cfg: TrainConfig, out: Path) -> list[Path]:
    """Every file a training run (or a model taken prebuilt) may write under a final name in
    `out`: the model, its tokenizer and each kept checkpoint's files (what the stage expects
    before it writes any of them)."""
    files = [out / MODEL_CONFIG_NAME, out / MODEL_WEIGHTS_NAME, out / TOKENIZER_NAME]
    for step in kept_steps(cfg):
        files += [kept_checkpoint(out, step) / name for name in KEPT_FILES]
    return files


def missing_kept(stage, cfg: TrainConfig) -> list[int]:
    """The steps of `keep_checkpoints` the ledger does not hold whole."""
    return [step for step in kept_steps(cfg) if stage.done(kept_part(step)) is None]


def resume(stage, model, optimizer, device: str):
    """The `Progress` of the latest checkpoint the ledger holds, loaded into `model` and
    `optimizer`; None when there is none (the run starts at step 0)."""
    from pipeline.train.loop import Progress

    recorded = {
        entry["facts"]["step"]: entry
        for name, entry in stage.ledger.parts.items()
        if name.startswith(CHECKPOINT)
    }
    if not recorded:
        return None
    # the latest is whole unless something changed it since (earlier ones are removed once it
    # is recorded, and a kill while removing one leaves it part-removed: not resumed from)
    step = max(recorded)
    state_dir = train_state(stage.out, step)
    changed = [
        f"{stage.out / rel}: {_size(stage.out / rel)}, written {size} bytes"
        for rel, size in recorded[step]["files"].items()
        if _size(stage.out / rel) != f"{size} bytes"
    ]
    if changed:
        raise ArSliceError(
            f"cannot resume the training from {state_dir}: its files are not what the trainer "
            f"wrote ({'; '.join(changed)}); pass --overwrite to start the training over"
        )
    return Progress.from_saved(load_state(state_dir, model, optimizer, device))


def _size(path: Path) -> str:
    return f"{path.stat().st_size} bytes" if path.is_file() else "missing"
