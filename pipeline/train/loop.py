"""The training loop: the inputs a run reads, where it stands (`Progress`), its steps and the
periodic validation loss. Every float operation is the one the trainer has always made, in the
same order, so a run and its resumed twin write the same weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ar_slicing.data.store import TokenStore
from ar_slicing.data.tokenizer import require_same_fingerprint
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.layout import TOKENIZER_NAME
from pipeline.train.config import Recipe, TrainConfig
from pipeline.train.model import sequence_loss
from pipeline.train.schedule import BatchOrder, learning_rate, validation_rows

log = logging.getLogger(__name__)


@dataclass
class TrainInputs:
    """The token stores a run reads, its batch order and the tokenizer saved beside the model."""

    store: TokenStore
    val_store: TokenStore | None
    order: BatchOrder
    tokenizer_json: str | None  # the training store's tokenizer.json, when it has one

    @classmethod
    def open(cls, cfg: TrainConfig) -> TrainInputs:
        store = TokenStore.open(cfg.tokens)
        order = BatchOrder(store.n_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
        if order.n_rows < 1:
            raise BadInput(
                f"token store {cfg.tokens}: {store.n_tokens} tokens is fewer than one training "
                f"row of {cfg.seq_len + 1}; use a smaller --seq-len or a larger corpus"
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
        return cls(store, val_store, order, tokenizer_json)

    def described(self) -> dict:
        """The stores as a trained model's meta.json names them (`inputs`)."""
        store, val = self.store, self.val_store
        return {
            "tokens": {"path": str(store.path.resolve()), "n_tokens": store.n_tokens},
            "val_tokens": (
                {"path": str(val.path.resolve()), "n_tokens": val.n_tokens} if val else None
            ),
        }

    def validation_starts(self, cfg: TrainConfig) -> np.ndarray:
        """Where the rows of every validation estimate start (none without a validation store)."""
        if self.val_store is None:
            return np.zeros(0, dtype=np.int64)
        return validation_rows(
            self.val_store.n_tokens, cfg.seq_len, cfg.eval_batches * cfg.batch_size
        )


@dataclass
class Progress:
    """Where a run stands: the steps done, the loss history, the smoothed training loss and the
    last validation loss (what a checkpoint saves besides the weights)."""

    step: int = 0
    history: list[dict] = field(default_factory=list)
    train_loss_ema: float | None = None
    last_val: float | None = None

    def saved(self) -> dict:
        """What a checkpoint's state.json keeps besides the step."""
        return {
            "history": self.history,
            "train_loss_ema": self.train_loss_ema,
            "last_val": self.last_val,
        }

    @classmethod
    def from_saved(cls, state: dict) -> Progress:
        return cls(
            step=int(state["step"]),
            history=list(state["history"]),
            train_loss_ema=state.get("train_loss_ema"),
            last_val=state.get("last_val"),
        )


def validation_loss(model, inputs: TrainInputs, starts: np.ndarray, cfg, device, autocast_ctx):
    """Mean loss over the validation rows starting at `starts` (None without any)."""
    import torch

    if starts.size == 0:
        return None
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, starts.size, cfg.batch_size):
            rows = np.stack(
                [
                    np.asarray(inputs.val_store.tokens[s : s + cfg.seq_len + 1], dtype=np.int64)
                    for s in starts[i : i + cfg.batch_size]
                ]
            )
            batch = torch.from_numpy(rows).to(device)
            total += sequence_loss(model, batch, autocast_ctx).item() * len(rows)
            n += len(rows)
    model.train()
    return total / n


def set_learning_rate(optimizer, step: int, recipe: Recipe) -> float:
    """Every parameter group at the schedule's rate for `step` (`learning_rate`); the rate."""
    lr = learning_rate(step, recipe)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update(model, optimizer, loss, recipe: Recipe):
    """One optimizer update from `loss`: gradients, the recipe's clipping of their norm, the
    step. The norm before clipping (None when `grad_clip` is 0)."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = (
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        if recipe.grad_clip > 0
        else None
    )
    optimizer.step()
    return grad_norm


@dataclass(frozen=True)
class Step:
    """One step of `recipe_steps`: its index, its loss (a tensor), the rate it ran at, and the
    gradient norm before clipping (None without clipping, or when the loss was not finite and
    no update was made)."""

    step: int
    loss: object
    lr: float
    grad_norm: object = None
    finite: bool = True


def recipe_steps(recipe: Recipe, model, optimizer, steps: Iterable[int], loss_at) -> Iterator[Step]:
    """The one training loop: for each of `steps`, the schedule's rate, the loss of that step's
    batch (`loss_at(step)`, a scalar tensor) and the recipe's update; yields each `Step` after
    its update. A loss that is not finite is yielded without an update (`finite` False) and ends
    the loop: `arslice train` refuses it, an MQAR run stops there. `arslice train` and the MQAR
    probe train through this one loop, so they train by one recipe, op for op."""
    import torch

    for step in steps:
        lr = set_learning_rate(optimizer, step, recipe)
        loss = loss_at(step)
        if not torch.isfinite(loss):
            yield Step(step, loss, lr, finite=False)
            return
        grad_norm = update(model, optimizer, loss, recipe)
        yield Step(step, loss, lr, grad_norm)


def train_steps(
    cfg: TrainConfig,
    model,
    optimizer,
    inputs: TrainInputs,
    progress: Progress,
    device: str,
    autocast_ctx,
    checkpoint,
    name: str,
    keep=None,
    until: int | None = None,
) -> None:
    """Steps `progress.step .. cfg.steps - 1` (`until - 1` with `until`: the first steps of the
    run), updating `progress`; `checkpoint(progress)` is
    called every `checkpoint_every` steps (not after the last: the model itself is saved then),
    and `keep(progress)` after each step of `cfg.keep_checkpoints` (before that step's
    checkpoint, so a run resumed from the checkpoint has kept it). Neither touches the weights,
    the optimizer or any random state: the trained model is the same with or without them."""
    import torch
    from tqdm.auto import tqdm

    starts = inputs.validation_starts(cfg)
    kept = set(cfg.keep_checkpoints) if keep is not None else set()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    start_step = progress.step
    model.train()
    t_loop = time.time()
    last = cfg.steps if until is None else min(until, cfg.steps)
    bar = tqdm(
        range(start_step, last),
        initial=start_step,
        total=last,
        desc=f"train {name}",
        unit="step",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )

    def loss_at(step: int):
        batch = torch.from_numpy(inputs.order.batch(inputs.store.tokens, step)).to(device)
        return sequence_loss(model, batch, autocast_ctx)

    for step in recipe_steps(cfg.recipe, model, optimizer, bar, loss_at):
        if not step.finite:
            raise ArSliceError(
                f"train {cfg.arch}: loss became {step.loss.item()} at step {step.step}; lower "
                f"--lr (now {cfg.lr}) or raise --warmup-steps"
            )
        value = step.loss.item()
        ema = progress.train_loss_ema
        progress.train_loss_ema = value if ema is None else 0.95 * ema + 0.05 * value
        done = progress.step = step.step + 1
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            progress.last_val = validation_loss(model, inputs, starts, cfg, device, autocast_ctx)
            progress.history.append(
                {
                    "step": done,
                    "tokens": done * tokens_per_step,
                    "train_loss": round(progress.train_loss_ema, 5),
                    "val_loss": None if progress.last_val is None else round(progress.last_val, 5),
                    "lr": step.lr,
                    "grad_norm": None
                    if step.grad_norm is None
                    else round(float(step.grad_norm), 4),
                }
            )
        _show(bar, progress, (done - start_step) * tokens_per_step, time.time() - t_loop)
        if done in kept:
            keep(progress)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint(progress)
    bar.close()


def _show(bar, progress: Progress, tokens: int, elapsed: float) -> None:
    postfix = {
        "loss": f"{progress.train_loss_ema:.3f}",
        "tok/s": f"{tokens / max(elapsed, 1e-9):,.0f}",
    }
    if progress.last_val is not None:
        postfix["val"] = f"{progress.last_val:.3f}"
    bar.set_postfix(postfix, refresh=False)
