"""The model a `TrainConfig` describes, its optimizer (decay on matrices only) and its loss."""

from __future__ import annotations

import json
import logging
from typing import Any

from ar_slicing.errors import ArSliceError
from pipeline.train.config import TrainConfig

log = logging.getLogger(__name__)


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
