"""The model a `TrainConfig` describes, its optimizer (decay on matrices only) and its loss."""

from __future__ import annotations

import json
import logging
from typing import Any

from ar_slicing.errors import ArSliceError
from pipeline.train.config import Recipe, TrainConfig

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


# Transformer++ (`--arch transformer_pp`), the attention baseline of HazyResearch/based (flash-attn's
# MHA with rotary_emb_fraction 1 and bias-free projections, a bias-free GatedMlp, RMSNorm;
# `models/based_ckpt.py` reads its checkpoints): the ModelConfig fields it sets. Rotary turns every
# channel of each head and replaces the learned positions. Its mixer options are defaults that
# --mixer-options and --model-options' *_mixer_kwargs add to or override key by key.
TRANSFORMER_PP = {
    "sequence_mixer": "attention",
    "sequence_mixer_kwargs": {"bias": False, "out_proj_bias": False},
    "state_mixer": "swiglu",
    "state_mixer_kwargs": {"fc1_bias": False, "fc2_bias": False},
    "norm": "rmsnorm",
    "max_position_embeddings": 0,
}


def swiglu_hidden(d_model: int, multiple_of: int = 128) -> int:
    """flash-attn `GatedMlp`'s default width: 8/3 of `d_model` (three matrices holding about what
    a 4x MLP's two do), rounded up to a multiple of `multiple_of`."""
    return (int(8 * d_model / 3) + multiple_of - 1) // multiple_of * multiple_of


def architecture_fields(arch: str) -> dict[str, Any]:
    """The ModelConfig fields `--arch` sets: a sequence mixer, or a whole recipe."""
    if arch == "transformer_pp":
        return {k: dict(v) if isinstance(v, dict) else v for k, v in TRANSFORMER_PP.items()}
    return {"sequence_mixer": arch}


def _fill_transformer_pp_shape(values: dict[str, Any]) -> None:
    """What Transformer++'s options depend on the model's width: rotary over all of each head's
    channels, and flash-attn's SwiGLU width, unless given."""
    from models.backbone import resolved_options

    attention = values["sequence_mixer_kwargs"]
    if "rotary_emb_dim" not in attention:
        num_heads = resolved_options("sequence", "attention", attention)["num_heads"]
        attention["rotary_emb_dim"] = values["d_model"] // num_heads
    swiglu = values["state_mixer_kwargs"]
    if values["state_mixer"] == "swiglu" and not {"hidden", "hidden_mult"} & set(swiglu):
        swiglu["hidden"] = swiglu_hidden(values["d_model"])


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
    recipe = architecture_fields(cfg.arch)
    values = {
        "vocab_size": vocab_size,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        # the model is built for the rows it trains on (attention's positions, Hyena's filters)
        "l_max": cfg.seq_len,
        **recipe,
        **options,
    }
    for key in ("sequence_mixer_kwargs", "state_mixer_kwargs"):
        values[key] = {**recipe.get(key, {}), **(options.get(key) or {})}
    values["sequence_mixer_kwargs"].update(parse_model_options(cfg.mixer_options))
    try:
        if cfg.arch == "transformer_pp":
            _fill_transformer_pp_shape(values)
        return ModelConfig(**values)
    except (TypeError, ValueError, ArSliceError) as e:
        raise ArSliceError(f"model config for --arch {cfg.arch}: {e}") from None


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, recipe: Recipe):
    """AdamW with weight decay on matrices (dim >= 2) only, as nanoGPT's configure_optimizers,
    and never on parameters a mixer marks `_no_weight_decay` (H3's SSM parameters, as upstream)."""
    import torch

    def decays(p) -> bool:
        return p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)

    decay = [p for p in model.parameters() if p.requires_grad and decays(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not decays(p)]
    groups = [
        {"params": decay, "weight_decay": recipe.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, recipe.beta2), eps=1e-8)


def sequence_loss(model, batch, autocast_ctx):
    """Mean next-token loss of a (B, T+1) int64 batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T), (B, T)
    with autocast_ctx():
        return model(inputs, targets=targets, loss_reduction="mean").float()
