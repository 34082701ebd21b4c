"""`arslice train`: train a small language model of one `models/` architecture on a token store.

A deliberately small, correct trainer in the nanoGPT mould: AdamW (weight decay on matrices
only), linear warmup then cosine decay, gradient clipping, bf16 autocast on CUDA GPUs that have
it (`models.precision`), a fixed seed, and torch's CPU kernels pinned before torch loads
(`models.cpu_kernels`), so that a run writes the same bytes on any x86-64 CPU (the pin is a
setting of its plan, and its meta.json says what torch and MKL report they used).
The batch order depends only on the store, `seq_len`, `batch_size` and `seed` — never on the
architecture — so models of different families trained with the same settings see the same
training tokens in the same order, as in the Zoology comparison.

Rows and batches. The training stream `S` is cut into rows of `seq_len + 1` tokens starting at
`r * seq_len` (consecutive rows share one token, so every stream token but the first is a
target exactly once per epoch). Each epoch visits every row once, in the order of a permutation
drawn from `numpy.random.default_rng([seed, epoch])`; batch `s` is global rows
`s*B .. s*B+B-1` of that sequence. The order is a pure function of the step, which is what
makes resuming exact.

Outputs (`--out DIR`): `config.json` + `model.safetensors` (the `native` format, read back by
`native:DIR` model specs), the store's `tokenizer.json`, and `meta.json` written last (final
train/validation loss, tokens seen, parameter count, wall time, the loss history). While
training, `DIR/.train-state/step-<n>/` holds the last periodic checkpoint (model, optimizer,
step), recorded in the stage's ledger; a killed run leaves no `meta.json`, and rerunning the
same command resumes from the checkpoint the ledger holds. `--keep-checkpoints 800 1600` also
keeps the model at those steps, as `DIR/checkpoints/step-<n>/` (native checkpoints with a
meta.json of their step and tokens seen), parts of the ledger and of the output; keeping them
changes no byte of the final model. `--saved-dtype bf16` rounds the saved parameters to bf16, and
`--prebuilt FOLDER` takes the model from a folder of prebuilt models instead of training it,
when it was made with the same settings from the same tokens (`pipeline.train.prebuilt`).

The run is put together here; `loop` holds the steps and the validation loss, `config`
`TrainConfig`, `schedule` the batch order and learning rate, `model` the model, optimizer and
loss, `state` the plan settings and the checkpoints.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import build_meta, is_complete
from pipeline.config import Command
from pipeline.stage import Finished
from pipeline.train.config import (  # noqa: F401  (re-exported)
    _RESUMABLE_CHANGES,
    ARCHITECTURES,
    STATE_DIR,
    TrainConfig,
)
from pipeline.train.model import (  # noqa: F401  (re-exported)
    count_parameters,
    make_optimizer,
    model_config_for,
    parse_model_options,
    sequence_loss,
)
from pipeline.train.prebuilt import check_prebuilt_settings, take_prebuilt
from pipeline.train.schedule import (  # noqa: F401  (re-exported)
    BatchOrder,
    learning_rate,
    validation_rows,
)
from pipeline.train.side_by_side import SIDE_BY_SIDE_KEY, run_models
from pipeline.train.state import (  # noqa: F401  (re-exported)
    build_model,
    checkpoint,
    final_files,
    keep_checkpoint,
    kept_steps,
    load_state,
    missing_kept,
    resume,
    save_state,
    train_settings,
    validate_train,
)
from pipeline.wiring import MODELS, STORES, Run, Table, Wiring, per_model

if TYPE_CHECKING:
    from pipeline.train.loop import TrainInputs

log = logging.getLogger(__name__)


def validate(cfg: TrainConfig) -> None:
    """Refuse settings no training can run with, and a prebuilt model made otherwise than asked
    (a complete model is not taken again; its token streams are compared once they are there)."""
    validate_train(cfg)
    if cfg.prebuilt is not None and not is_complete(cfg.out):
        check_prebuilt_settings(cfg)


def train(cfg: TrainConfig) -> dict:
    """Train one model as `cfg` says; returns the summary written to `<out>/meta.json`."""
    from ar_slicing.machinery.plan import StagePlan, identity
    from models import cpu_kernels
    from models.precision import resolve_device, resolve_dtype, torch_threads
    from pipeline.stage import run_stage

    cpu_kernels.pin()  # (before validate loads torch; refused if it is loaded otherwise)
    validate(cfg)
    t0 = time.time()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, training=True)
    kernels = cpu_kernels.require_pinned()
    plan = StagePlan(
        "train",
        settings=train_settings(cfg, dtype),
        inputs={
            "tokens": identity(cfg.tokens),
            "val_tokens": identity(cfg.val_tokens) if cfg.val_tokens else None,
        },
    )
    out = Path(cfg.out)

    def work(stage, _) -> Finished:
        with torch_threads(cfg.threads):
            stage.expect(final_files(cfg, out))
            if cfg.prebuilt is None:
                return _train(stage, cfg, device, dtype, t0, kernels)
            # taken from a folder of prebuilt models: the same model
            return take_prebuilt(stage, cfg, dtype, t0, lambda steps, inputs: _train_first_steps(
                stage, cfg, device, dtype, steps, inputs), kernels)  # fmt: skip

    return run_stage(
        f"train {cfg.arch}",
        out,
        plan,
        work,
        overwrite=cfg.overwrite,
        work_is_parts=cfg.prebuilt is None,  # (a checkpoint the ledger holds)
    )


def _train(stage, cfg: TrainConfig, device: str, dtype: str, t0: float, kernels: dict) -> Finished:
    """Build the model (resumed from the ledger's latest checkpoint), run the steps left, save
    the model and write meta.json."""
    from models.checkpoints.native import save_native
    from models.precision import autocast
    from pipeline.train.loop import Progress, TrainInputs, train_steps

    out = stage.out
    inputs = TrainInputs.open(cfg)
    model_cfg, model, optimizer = _start(cfg, inputs, device)
    n_params = count_parameters(model)
    progress = resume(stage, model, optimizer, device)
    if progress is not None:
        log.info("resuming %s from step %d of %d", out, progress.step, cfg.steps)
    progress = progress or Progress()
    start_step = progress.step

    def autocast_ctx():
        return autocast(device, dtype)

    def keep(p):
        keep_checkpoint(stage, model, cfg, p.step, inputs.order.n_rows)

    if start_step == 0 and 0 in cfg.keep_checkpoints:
        keep(progress)  # the initial weights
    t_loop = time.time()
    train_steps(
        cfg, model, optimizer, inputs, progress, device, autocast_ctx,
        checkpoint=lambda p: checkpoint(stage, model, optimizer, p), name=out.name, keep=keep,
    )  # fmt: skip
    t_loop = time.time() - t_loop
    missing = missing_kept(stage, cfg)
    if missing:  # (a run resumed past a step whose kept checkpoint is gone)
        raise ArSliceError(
            f"train {cfg.arch}: the checkpoints of step(s) {', '.join(map(str, missing))} are "
            f"missing from {out}; pass --overwrite to train it again"
        )
    model.eval()
    save_native(  # each file atomically
        model, out, tokenizer_json=inputs.tokenizer_json, saved_dtype=cfg.saved_dtype
    )
    trained_tokens = (cfg.steps - start_step) * cfg.batch_size * cfg.seq_len
    meta = _train_meta(cfg, inputs, model_cfg, n_params, progress, start_step, device, dtype)
    meta = {
        **meta,
        "cpu_kernels": kernels,
        "wall_time_s": round(time.time() - t0, 3),
        "throughput": {"train_tokens_per_s": trained_tokens / max(t_loop, 1e-9)},
    }
    val_text = "n/a" if progress.last_val is None else f"{progress.last_val:.3f}"
    line = (
        f"train {cfg.arch}: {n_params / 1e6:.2f}M params, {meta['tokens_seen']:,} tokens "
        f"({meta['epochs']:.2f} epochs), train loss {progress.train_loss_ema:.3f}, val loss "
        f"{val_text}, {meta['wall_time_s']:.0f} s -> {out}"
    )
    return Finished(meta, [line])  # (finishing drops the checkpoints)


def _start(cfg: TrainConfig, inputs, device: str):
    """The model and optimizer at step 0, from the seed: (model config, model, optimizer)."""
    import torch

    torch.manual_seed(cfg.seed)
    model_cfg = model_config_for(cfg, inputs.store.vocab_size)
    model = build_model(model_cfg, device)
    return model_cfg, model, make_optimizer(model, cfg.recipe)


def _train_first_steps(
    stage, cfg: TrainConfig, device: str, dtype: str, steps: list[int], inputs
) -> None:
    """Train the first max(steps) steps of the run `cfg` describes, keeping the model at each
    of `steps` as training keeps it: the same weights as the whole run's kept checkpoints
    (`train_here_until`, for a model taken from a prebuilt folder that holds only later ones).
    It writes no resumable checkpoint: a killed run does these steps again. `inputs`: the
    run's `TrainInputs`, already open."""
    from models.precision import autocast
    from pipeline.train.loop import Progress, train_steps

    _, model, optimizer = _start(cfg, inputs, device)
    wanted = set(steps)

    def keep(p):
        if p.step in wanted:
            keep_checkpoint(stage, model, cfg, p.step, inputs.order.n_rows)

    progress = Progress()
    if 0 in wanted:
        keep(progress)
    train_steps(
        cfg, model, optimizer, inputs, progress, device, lambda: autocast(device, dtype),
        checkpoint=lambda p: None, name=stage.out.name, keep=keep, until=max(steps),
    )  # fmt: skip


def _train_meta(cfg, inputs: TrainInputs, model_cfg, n_params, progress, start_step, device, dtype):
    """meta.json of a trained model (its timings are added by the caller)."""
    store, order = inputs.store, inputs.order
    return build_meta(
        "train",
        config=cfg,
        inputs=inputs.described(),
        counts={
            "steps": cfg.steps,
            "resumed_from_step": start_step,
            "rows_per_epoch": order.n_rows,
        },
        batch_order_digest=order.digest(cfg.steps),
        wall_time_s=0.0,
        arch=cfg.arch,
        model_config=model_cfg,
        n_params=n_params,
        fingerprint=store.fingerprint,
        step=cfg.steps,
        tokens_seen=cfg.steps * cfg.batch_size * cfg.seq_len,
        epochs=cfg.steps * cfg.batch_size / order.n_rows,
        checkpoints=kept_steps(cfg),
        final_train_loss=progress.train_loss_ema,
        final_val_loss=progress.last_val,
        device=device,
        dtype=dtype,
        history=progress.history,
    )


# ---- in a pipeline config: [train] and [train.models.<name>] -----------------------------------


def _defaults(run: Run, table: Table) -> dict:
    return {
        "tokens": run.layout.store("train"),
        "val_tokens": run.layout.store("val"),
        "out": run.layout.model(table.name),
    }


def model_entry(name: str, out: Path, meta: dict) -> dict:
    """A trained model in `models/meta.json`: where it is, its spec, and how it went."""
    keep = (
        "arch",
        "n_params",
        "tokens_seen",
        "epochs",
        "final_train_loss",
        "final_val_loss",
        "wall_time_s",
    )
    entry = {"dir": str(out), "spec": f"native:{out}", **{k: meta.get(k) for k in keep}}
    if meta.get(
        "checkpoints"
    ):  # (kept checkpoints: their steps, as `[eval] checkpoints` names them)
        entry["checkpoints"] = meta["checkpoints"]
    return entry


COMMAND = Command(
    TrainConfig,
    train,
    validate=validate,
    plan_settings=train_settings,
    inputs=lambda cfg: [
        ("--tokens", cfg.tokens, "dir"),
        *([("--val-tokens", cfg.val_tokens, "dir")] if cfg.val_tokens else []),
    ],
    summary="train a small model of one architecture on a token store",
    examples="""\
  arslice train --arch attention --tokens runs/demo/tokens/train --val-tokens runs/demo/tokens/val \\
      --out runs/demo/models/attention --d-model 128 --n-layers 4 --steps 600
  arslice train --arch hyena --tokens runs/demo/tokens/train --out runs/demo/models/hyena \\
      --mixer-options filter_order=32
  arslice train --arch attention --tokens runs/demo/tokens/train --out runs/demo/models/attention \\
      --steps 1600 --keep-checkpoints 200 400 800""",
    pipeline=Wiring(
        table="train",
        reads=(STORES,),
        writes=MODELS,
        fan_out=per_model,
        defaults=_defaults,
        pipeline_keys=(SIDE_BY_SIDE_KEY,),
        run_all=run_models,
        entry=model_entry,
    ),
)
