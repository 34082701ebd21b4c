"""`arslice train`: train a small language model of one `models/` architecture on a token store.

A deliberately small, correct trainer in the nanoGPT mould: AdamW (weight decay on matrices
only), linear warmup then cosine decay, gradient clipping, bf16 autocast on CUDA GPUs that have it (`models.precision`), a fixed seed.
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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import (
    atomic_dir,
    build_meta,
    read_json,
    write_json_atomic,
)
from ar_slicing.store import TOKENIZER_NAME, TokenStore
from ar_slicing.tokenizer import require_same_fingerprint
from pipeline.config import Command, config_to_dict, say

log = logging.getLogger(__name__)

ARCHITECTURES = ["attention", "base_conv", "hyena", "rwkv"]
STATE_DIR = ".train-state"
# Fields that change how a run is executed or reported but not what it computes, so a run may
# be resumed after changing them.
_RESUMABLE_CHANGES = {
    "overwrite",
    "device",
    "threads",
    "checkpoint_every",
    "eval_every",
    "progress",
}


@dataclass(frozen=True)
class TrainConfig:
    arch: str = field(metadata={"help": "sequence mixer of the model", "choices": ARCHITECTURES})
    tokens: str = field(metadata={"help": "training token store directory"})
    out: str = field(metadata={"help": "output directory (native checkpoint + meta.json)"})
    val_tokens: str | None = field(
        default=None, metadata={"help": "held-out token store for the periodic validation loss"}
    )
    d_model: int = field(default=128, metadata={"help": "model width"})
    n_layers: int = field(default=4, metadata={"help": "number of blocks"})
    model_options: list[str] = field(
        default_factory=list,
        metadata={
            "help": "further ModelConfig fields as KEY=VALUE (VALUE parsed as JSON), "
            'e.g. state_mixer_kwargs={"hidden_mult": 2}'
        },
    )
    mixer_options: list[str] = field(
        default_factory=list,
        metadata={
            "help": "sequence-mixer options as KEY=VALUE, e.g. num_heads=4 (attention) or "
            "kernel_size=3 (base_conv); an option the mixer does not have is refused"
        },
    )
    seq_len: int = field(
        default=256, metadata={"help": "training sequence length (tokens per row)"}
    )
    batch_size: int = field(default=16, metadata={"help": "rows per optimizer step"})
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(
        default=0.1,
        metadata={"help": "final learning rate as a fraction of the peak (cosine floor)"},
    )
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW weight decay (matrices only)"}
    )
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2 (beta1 is 0.9)"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip (0 disables)"})
    seed: int = field(
        default=0, metadata={"help": "seed of the initialisation and the batch order"}
    )
    eval_every: int = field(
        default=200, metadata={"help": "validation loss every N steps (0: only at the end)"}
    )
    eval_batches: int = field(default=8, metadata={"help": "batches in each validation estimate"})
    checkpoint_every: int = field(
        default=200, metadata={"help": "save a resumable checkpoint every N steps (0: never)"}
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "autocast dtype of the forward and backward passes; auto = bf16 on CUDA GPUs "
            "that have it, else fp32 (also on every CPU, so weights do not depend on the CPU)",
            "choices": ["auto", "bf16", "fp32"],
        },
    )
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    overwrite: bool = field(default=False, metadata={"help": "retrain even if OUT is complete"})


# ---- batch order and schedule (pure, tested) ----------------------------------------------------


@dataclass(frozen=True)
class BatchOrder:
    """Which rows of the training stream make up each batch (see the module docstring).

    >>> order = BatchOrder(n_tokens=11, seq_len=4, batch_size=2, seed=0)
    >>> order.n_rows        # rows start at 0, 4 (tokens 0..4, 4..8); a row at 8 would need token 12
    2
    """

    n_tokens: int
    seq_len: int
    batch_size: int
    seed: int

    @property
    def n_rows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)

    def rows(self, step: int) -> np.ndarray:
        """Row indices of batch `step` (int64, length batch_size)."""
        k = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        epochs, within = np.divmod(k, self.n_rows)
        out = np.empty_like(k)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.epoch_order(int(epoch))[within[sel]]
        return out

    def digest(self, steps: int) -> str:
        """sha256 of the rows of batches 0..steps-1: equal digests, same tokens in the same order."""
        h = hashlib.sha256(f"{self.n_tokens}:{self.seq_len}:{self.batch_size}".encode())
        for step in range(steps):
            h.update(self.rows(step).astype("<i8").tobytes())
        return h.hexdigest()

    def batch(self, tokens: np.ndarray, step: int) -> np.ndarray:
        """(batch_size, seq_len + 1) int64 array of the rows of batch `step`."""
        starts = self.rows(step) * self.seq_len
        return np.stack(
            [np.asarray(tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        )


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to lr*min_lr_ratio."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def validation_rows(n_tokens: int, seq_len: int, n_rows: int) -> np.ndarray:
    """Start indices of `n_rows` rows spread evenly over a held-out stream (fixed across runs)."""
    available = max(0, (n_tokens - 1) // seq_len)
    if available == 0:
        return np.zeros(0, dtype=np.int64)
    picks = np.unique(
        np.linspace(0, available - 1, num=min(n_rows, available)).round().astype(np.int64)
    )
    return picks * seq_len


# ---- model construction -------------------------------------------------------------------------


def parse_model_options(options: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`["n_heads=4", "mlp_ratio=2.5", "rotary=true"]` -> {"n_heads": 4, "mlp_ratio": 2.5, ...}."""
    parsed = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArSliceError(f"--model-options {item!r}: expected KEY=VALUE")
        try:
            parsed[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key.strip()] = value
    return parsed


def model_config_for(cfg: TrainConfig, vocab_size: int):
    """The `models.backbone.ModelConfig` a TrainConfig asks for, refusing unknown option names."""
    import dataclasses

    from models.backbone import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    options = parse_model_options(cfg.model_options)
    unknown = sorted(set(options) - names)
    if unknown:
        raise ArSliceError(
            f"--model-options: unknown ModelConfig field(s) {', '.join(unknown)}; "
            f"fields: {', '.join(sorted(names))}"
        )
    values = {
        "vocab_size": vocab_size,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "sequence_mixer": cfg.arch,
        # the model is built for the rows it trains on (attention's positions, Hyena's filters)
        "l_max": cfg.seq_len,
        **options,
    }
    mixer_kwargs = dict(values.get("sequence_mixer_kwargs") or {})
    mixer_kwargs.update(parse_model_options(cfg.mixer_options))
    values["sequence_mixer_kwargs"] = mixer_kwargs
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError, ArSliceError) as e:
        raise ArSliceError(f"model config for --arch {cfg.arch}: {e}") from None


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, cfg: TrainConfig):
    """AdamW with weight decay on matrices (dim >= 2) only, as nanoGPT's configure_optimizers."""
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), eps=1e-8)


def sequence_loss(model, batch, autocast_ctx):
    """Mean next-token loss of a (B, T+1) int64 batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
    with autocast_ctx():
        return model(inputs, targets=targets, loss_reduction="mean").float()


# ---- checkpoints --------------------------------------------------------------------------------


def train_settings(cfg: TrainConfig, dtype: str | None = None) -> dict:
    """What decides the trained weights besides the token stores (the settings of the plan; a
    saved state is only resumed under the same plan). `dtype` is the resolved one."""
    from models.precision import resolve_device, resolve_dtype

    settings = {
        k: v
        for k, v in config_to_dict(cfg).items()
        if k not in _RESUMABLE_CHANGES and k not in ("tokens", "val_tokens", "out")
    }
    if dtype is None:
        dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device), training=True)
    return {**settings, "dtype": dtype}


def validate_train(cfg: TrainConfig) -> None:
    if cfg.steps <= 0 or cfg.batch_size <= 0 or cfg.seq_len <= 0:
        raise ArSliceError("--steps, --batch-size and --seq-len must be positive")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or cfg.eval_batches < 1:
        raise ArSliceError("--lr must be positive, --warmup-steps >= 0 and --eval-batches >= 1")
    build_model(model_config_for(cfg, vocab_size=256), device="meta")  # options, shapes: no memory


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


def save_state(state_dir: Path, model, optimizer, step: int, extra: dict) -> None:
    """Atomically replace the resumable checkpoint (model, optimizer, step) in `state_dir`."""
    import torch
    from safetensors.torch import save_model

    with atomic_dir(state_dir) as tmp:
        # save_model (not save_file) handles the tied embedding / output head
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        write_json_atomic(tmp / "state.json", {"step": step, **extra})


def load_state(state_dir: Path, model, optimizer, device: str) -> dict | None:
    """Restore a saved state into `model` and `optimizer`; None when there is none to resume.
    (A state is only there under the same stage plan: another plan is refused or cleared first.)"""
    import torch
    from safetensors.torch import load_model

    if not (state_dir / "state.json").is_file():
        return None
    state = read_json(state_dir / "state.json")
    load_model(model, str(state_dir / "model.safetensors"), device=device)
    optimizer.load_state_dict(
        torch.load(state_dir / "optimizer.pt", map_location=device, weights_only=True)
    )
    return state


# ---- the training loop --------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict:
    """Train one model as `cfg` says; returns the summary written to `<out>/meta.json`."""
    from ar_slicing.plan import StagePlan, identity, open_stage
    from models.precision import resolve_device, resolve_dtype

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
    with stage.running(keep_if=lambda out: (out / STATE_DIR).exists()):
        return _train(stage, cfg, device, dtype, t0)


def _train(stage, cfg: TrainConfig, device: str, dtype: str, t0: float) -> dict:
    import torch
    from tqdm.auto import tqdm

    from models.native import save_native
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

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
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
