"""`arslice train`: train a small language model of one `models/` architecture on a token store.

A deliberately small, correct trainer in the nanoGPT mould: AdamW (weight decay on matrices
only), linear warmup then cosine decay, gradient clipping, bf16 autocast on CUDA GPUs that have
it (`models.precision`), a fixed seed.
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
training, `DIR/.train-state/` holds the last periodic checkpoint (model, optimizer, step); a
killed run leaves no `meta.json`, and rerunning the same command resumes from that checkpoint.

The loop is here; `config` holds `TrainConfig`, `schedule` the batch order and learning rate,
`model` the model, optimizer and loss, `state` the plan settings and the checkpoints.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import (
    build_meta,
)
from ar_slicing.layout import TOKENIZER_NAME
from ar_slicing.store import TokenStore
from ar_slicing.tokenizer import require_same_fingerprint
from pipeline.config import Command, say
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
from pipeline.train.schedule import (  # noqa: F401  (re-exported)
    BatchOrder,
    learning_rate,
    validation_rows,
)
from pipeline.train.state import (  # noqa: F401  (re-exported)
    build_model,
    load_state,
    save_state,
    train_settings,
    validate_train,
)

log = logging.getLogger(__name__)


def train(cfg: TrainConfig) -> dict:
    """Train one model as `cfg` says; returns the summary written to `<out>/meta.json`."""
    from ar_slicing.plan import StagePlan, identity, open_stage
    from models.precision import resolve_device, resolve_dtype, torch_threads

    validate_train(cfg)
    t0 = time.time()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, training=True)
    plan = StagePlan(
        "train",
        settings=train_settings(cfg, dtype),
        inputs={
            "tokens": identity(cfg.tokens),
            "val_tokens": identity(cfg.val_tokens) if cfg.val_tokens else None,
        },
    )
    out = Path(cfg.out)
    stage = open_stage(out, plan, overwrite=cfg.overwrite)
    if stage.complete:
        say(f"train {cfg.arch}: {out} is complete, skipped (use --overwrite to retrain)")
        return stage.skip()
    with stage.running(keep_if=lambda out: (out / STATE_DIR).exists()), torch_threads(cfg.threads):
        return _train(stage, cfg, device, dtype, t0)


def _train(stage, cfg: TrainConfig, device: str, dtype: str, t0: float) -> dict:
    import torch
    from tqdm.auto import tqdm

    from models.checkpoints.native import save_native
    from models.precision import autocast

    out = stage.out
    store = TokenStore.open(cfg.tokens)
    order = BatchOrder(store.n_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
    if order.n_rows < 1:
        raise BadInput(
            f"token store {cfg.tokens}: {store.n_tokens} tokens is fewer than one training row of "
            f"{cfg.seq_len + 1}; use a smaller --seq-len or a larger corpus"
        )
    val_store = TokenStore.open(cfg.val_tokens) if cfg.val_tokens else None
    if val_store is not None:
        require_same_fingerprint(
            store.fingerprint,
            f"training store {cfg.tokens}",
            val_store.fingerprint,
            f"validation store {cfg.val_tokens}",
        )
    tokenizer_path = store.path / TOKENIZER_NAME
    tokenizer_json = str(tokenizer_path) if tokenizer_path.is_file() else None

    torch.manual_seed(cfg.seed)
    model_cfg = model_config_for(cfg, store.vocab_size)
    model = build_model(model_cfg, device)
    n_params = count_parameters(model)
    optimizer = make_optimizer(model, cfg)

    def autocast_ctx():
        return autocast(device, dtype)

    state_dir = out / STATE_DIR
    state = load_state(state_dir, model, optimizer, device)
    start_step = int(state["step"]) if state else 0
    history: list[dict] = list(state["history"]) if state else []
    if state:
        log.info("resuming %s from step %d of %d", out, start_step, cfg.steps)

    val_starts = (
        validation_rows(val_store.n_tokens, cfg.seq_len, cfg.eval_batches * cfg.batch_size)
        if val_store is not None
        else np.zeros(0, dtype=np.int64)
    )

    @torch.no_grad()
    def validation_loss() -> float | None:
        if val_starts.size == 0:
            return None
        model.eval()
        total, n = 0.0, 0
        for i in range(0, val_starts.size, cfg.batch_size):
            rows = np.stack(
                [
                    np.asarray(val_store.tokens[s : s + cfg.seq_len + 1], dtype=np.int64)
                    for s in val_starts[i : i + cfg.batch_size]
                ]
            )
            batch = torch.from_numpy(rows).to(device)
            total += sequence_loss(model, batch, autocast_ctx).item() * len(rows)
            n += len(rows)
        model.train()
        return total / n

    tokens_per_step = cfg.batch_size * cfg.seq_len
    model.train()
    train_loss_ema = state.get("train_loss_ema") if state else None
    last_val = state.get("last_val") if state else None
    t_loop = time.time()
    bar = tqdm(
        range(start_step, cfg.steps),
        initial=start_step,
        total=cfg.steps,
        desc=f"train {out.name}",
        unit="step",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    for step in bar:
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.from_numpy(order.batch(store.tokens, step)).to(device)
        loss = sequence_loss(model, batch, autocast_ctx)
        if not torch.isfinite(loss):
            raise ArSliceError(
                f"train {cfg.arch}: loss became {loss.item()} at step {step}; lower --lr "
                f"(now {cfg.lr}) or raise --warmup-steps"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if cfg.grad_clip > 0
            else None
        )
        optimizer.step()

        value = loss.item()
        train_loss_ema = value if train_loss_ema is None else 0.95 * train_loss_ema + 0.05 * value
        done = step + 1
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            last_val = validation_loss()
            history.append(
                {
                    "step": done,
                    "tokens": done * tokens_per_step,
                    "train_loss": round(train_loss_ema, 5),
                    "val_loss": None if last_val is None else round(last_val, 5),
                    "lr": lr,
                    "grad_norm": None if grad_norm is None else round(float(grad_norm), 4),
                }
            )
        elapsed = time.time() - t_loop
        postfix = {
            "loss": f"{train_loss_ema:.3f}",
            "tok/s": f"{(done - start_step) * tokens_per_step / max(elapsed, 1e-9):,.0f}",
        }
        if last_val is not None:
            postfix["val"] = f"{last_val:.3f}"
        bar.set_postfix(postfix, refresh=False)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            save_state(
                state_dir,
                model,
                optimizer,
                done,
                {
                    "history": history,
                    "train_loss_ema": train_loss_ema,
                    "last_val": last_val,
                },
            )
    bar.close()

    model.eval()
    save_native(model, out, tokenizer_json=tokenizer_json)  # each file atomically
    wall = time.time() - t0
    trained_tokens = (cfg.steps - start_step) * tokens_per_step
    meta = build_meta(
        "train",
        config=cfg,
        inputs={
            "tokens": {"path": str(store.path.resolve()), "n_tokens": store.n_tokens},
            "val_tokens": (
                {"path": str(val_store.path.resolve()), "n_tokens": val_store.n_tokens}
                if val_store
                else None
            ),
        },
        counts={
            "steps": cfg.steps,
            "resumed_from_step": start_step,
            "rows_per_epoch": order.n_rows,
        },
        batch_order_digest=order.digest(cfg.steps),
        wall_time_s=wall,
        throughput={"train_tokens_per_s": trained_tokens / max(time.time() - t_loop, 1e-9)},
        arch=cfg.arch,
        model_config=model_cfg,
        n_params=n_params,
        fingerprint=store.fingerprint,
        tokens_seen=cfg.steps * tokens_per_step,
        epochs=cfg.steps * cfg.batch_size / order.n_rows,
        final_train_loss=train_loss_ema,
        final_val_loss=last_val,
        device=device,
        dtype=dtype,
        history=history,
    )
    meta = stage.finish(meta)
    if state_dir.exists():
        shutil.rmtree(state_dir)
    val_text = "n/a" if last_val is None else f"{last_val:.3f}"
    say(
        f"train {cfg.arch}: {n_params / 1e6:.2f}M params, {meta['tokens_seen']:,} tokens "
        f"({meta['epochs']:.2f} epochs), train loss {train_loss_ema:.3f}, val loss {val_text}, "
        f"{wall:.0f} s -> {out}"
    )
    return meta


COMMAND = Command(
    TrainConfig,
    train,
    validate=validate_train,
    plan_settings=train_settings,
    summary="train a small model of one architecture on a token store",
    examples="""\
  arslice train --arch attention --tokens runs/demo/tokens/train --val-tokens runs/demo/tokens/val \\
      --out runs/demo/models/attention --d-model 128 --n-layers 4 --steps 600
  arslice train --arch hyena --tokens runs/demo/tokens/train --out runs/demo/models/hyena \\
      --mixer-options filter_order=32""",
)
