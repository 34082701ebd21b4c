"""`retnet:<file or dir>`: a microsoft/torchscale RetNet (`torchscale/architecture/retnet.py`'s
`RetNetDecoder`) state dict, loaded into models.backbone with torchscale's numerics.

The checkpoint is `torch.save(decoder.state_dict())` (or fairseq's `{"model": ...}` with keys
under `decoder.`), with torchscale's `RetNetConfig` arguments as JSON or YAML beside it
(`config.json`, `<name>.json`) or given with `--model-config`. The decoder maps onto the backbone:

    embed_tokens.weight                   -> word embeddings (times sqrt(d) if embeddings are scaled)
    layers.N.retention.*                  -> layers.N.sequence_mixer.* (models/mixers/retnet.py)
    layers.N.retention_layer_norm.weight  -> layers.N.norm1.weight    (RMSNorm, layernorm_eps)
    layers.N.ffn.{fc1,fc2,gate}           -> layers.N.state_mixer.*   (mlp.py GatedFFN)
    layers.N.final_layer_norm.weight      -> layers.N.norm2.weight
    layer_norm.weight                     -> ln_f.weight
    output_projection.weight              -> lm_head.weight (tied when share_decoder_input_output_embed)
    retnet_rel_pos.{angle,decay}          -> checked against what the mixer recomputes

Widths, depth, heads (the length of `retnet_rel_pos.decay`), value and FFN widths show in the
weights and are checked against the config. Options this project does not implement are refused
by name: MoE layers, DeepNorm, multiway, post-norm, an embedding layer norm, scaled embeddings
under a tied head, and torchscale's chunkwise-recurrent form (`chunkwise_recurrent`), whose rows
are scaled otherwise than the parallel form's before the group norm: its epsilon lets that
through (1.6e-4 nats on a tiny model). Dropout, checkpointing and other training switches are
accepted.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from models.checkpoints.registry import (
    LoadedModel,
    LoadRequest,
    loaded_language_model,
    register_loader,
)

log = logging.getLogger(__name__)

CONFIG_NAMES = ("config.json", "config.yaml", "config.yml")
# RetNetConfig defaults (torchscale/architecture/config.py) of what decides the function
DEFAULTS = {
    "decoder_retention_heads": 3, "decoder_normalize_before": True, "activation_fn": "gelu",
    "no_scale_embedding": True, "layernorm_embedding": False, "moe_freq": 0, "deepnorm": False,
    "multiway": False, "share_decoder_input_output_embed": False, "no_output_layer": False,
    "layernorm_eps": 1e-6,
}  # fmt: skip
_SHAPES = {
    "decoder_embed_dim": "d_model", "decoder_value_embed_dim": "value_dim",
    "decoder_ffn_embed_dim": "ffn_dim", "decoder_layers": "n_layers", "vocab_size": "vocab_size",
    "decoder_retention_heads": "num_heads",
}  # fmt: skip
_MUST_BE = {
    "decoder_normalize_before": True, "layernorm_embedding": False, "moe_freq": 0,
    "deepnorm": False, "multiway": False, "no_output_layer": False, "chunkwise_recurrent": False,
}  # fmt: skip
_OPTIONS = (
    "activation_fn",
    "no_scale_embedding",
    "share_decoder_input_output_embed",
    "layernorm_eps",
)
# training switches, settings RetNetDecoder never reads, and MoE settings without MoE layers
_NO_EFFECT = {
    "dropout", "drop_path_rate", "activation_dropout", "checkpoint_activations", "fsdp",
    "ddp_rank", "max_target_positions", "recurrent_chunk_size", "subln",
    "rel_pos_buckets", "max_rel_pos", "xpos_rel_pos", "xpos_scale_base", "moe_top1_expert",
    "moe_expert_count", "moe_gating_use_fp32", "moe_eval_capacity_token_fraction",
    "moe_second_expert_policy", "moe_normalize_gate_prob_before_dropping", "use_xmoe",
    "encoder_normalize_before",
}  # fmt: skip
ACTIVATIONS = {"gelu": "gelu", "swish": "silu", "relu": "relu"}


def shapes_of(state: dict, source: str) -> dict[str, int]:
    def shape(key):
        if key not in state:
            raise ArSliceError(f"{source}: not a torchscale RetNetDecoder state dict (no {key})")
        return tuple(state[key].shape)

    vocab, d_model = shape("embed_tokens.weight")
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    shapes = {
        "vocab_size": vocab, "d_model": d_model, "n_layers": len(layers),
        "value_dim": shape("layers.0.retention.v_proj.weight")[0],
        "ffn_dim": shape("layers.0.ffn.fc1.weight")[0],
    }  # fmt: skip
    if "retnet_rel_pos.decay" in state:
        shapes["num_heads"] = int(state["retnet_rel_pos.decay"].shape[0])
    return shapes


def resolve_settings(cfg: dict, shapes: dict, source: str) -> dict[str, Any]:
    settings = dict(DEFAULTS)
    for key, value in cfg.items():
        if key in _SHAPES:
            have = shapes.get(_SHAPES[key])
            if have is not None and value is not None and int(value) != have:
                raise ArSliceError(f"{source}: {key} is {value} but the weights have {have}; "
                                   "this config does not describe these weights")  # fmt: skip
            settings[key] = value
        elif key in _MUST_BE:
            if value != _MUST_BE[key]:
                raise ArSliceError(f"{source}: {key}={value!r} is not implemented (only "
                                   f"{_MUST_BE[key]!r})")  # fmt: skip
        elif key in _OPTIONS:
            settings[key] = value
        elif key not in _NO_EFFECT:
            known = sorted({*_SHAPES, *_MUST_BE, *_OPTIONS, *_NO_EFFECT})
            raise ArSliceError(f"{source}: {key} is not an option this project implements for "
                               f"torchscale RetNet; it knows: {', '.join(known)}")  # fmt: skip
    if settings["activation_fn"] not in ACTIVATIONS:
        raise ArSliceError(f"{source}: activation_fn {settings['activation_fn']!r}: torchscale "
                           f"knows {', '.join(ACTIVATIONS)}")  # fmt: skip
    if settings["share_decoder_input_output_embed"] and not settings["no_scale_embedding"]:
        raise ArSliceError(
            f"{source}: scaled embeddings (no_scale_embedding false) under a tied output "
            "projection are not implemented"
        )
    shapes.setdefault("num_heads", int(settings["decoder_retention_heads"]))
    return settings


def model_config_for(shapes: dict, settings: dict):
    from models.backbone import ModelConfig

    eps = float(settings["layernorm_eps"])
    return ModelConfig(
        vocab_size=shapes["vocab_size"],
        d_model=shapes["d_model"],
        n_layers=shapes["n_layers"],
        sequence_mixer="retnet",
        sequence_mixer_kwargs={
            "num_heads": shapes["num_heads"],
            "value_dim": shapes["value_dim"],
            "group_norm_eps": eps,
        },  # fmt: skip
        state_mixer="gated_ffn",
        state_mixer_kwargs={
            "hidden": shapes["ffn_dim"],
            "activation": ACTIVATIONS[settings["activation_fn"]],
        },  # fmt: skip
        l_max=2048,
        max_position_embeddings=0,
        layer_norm_epsilon=eps,
        norm="rmsnorm",
        tie_word_embeddings=bool(settings["share_decoder_input_output_embed"]),
    )


def convert_retnet_state(state: dict, settings: dict, d_model: int) -> tuple[dict, dict]:
    """torchscale keys -> models.backbone's; also the stored rel-pos buffers (checked later)."""
    scale = 1.0 if settings["no_scale_embedding"] else math.sqrt(d_model)
    tied = settings["share_decoder_input_output_embed"]
    out, rel_pos = {}, {}
    for key, value in state.items():
        if key.startswith("retnet_rel_pos."):
            rel_pos[key] = value
            continue
        if key == "embed_tokens.weight":
            out["backbone.embeddings.word_embeddings.weight"] = value * scale
            continue
        if key == "output_projection.weight":
            if not tied:
                out["lm_head.weight"] = value
            continue
        key = re.sub(r"^layer_norm\.", "backbone.ln_f.", key)
        key = re.sub(r"^layers\.(\d+)\.retention\.", r"backbone.layers.\1.sequence_mixer.", key)
        key = re.sub(r"^layers\.(\d+)\.retention_layer_norm\.", r"backbone.layers.\1.norm1.", key)
        key = re.sub(r"^layers\.(\d+)\.final_layer_norm\.", r"backbone.layers.\1.norm2.", key)
        key = re.sub(r"^layers\.(\d+)\.ffn\.", r"backbone.layers.\1.state_mixer.", key)
        out[key] = value
    return out, rel_pos


def _check_rel_pos(model, rel_pos: dict, source: str) -> None:
    """Stored `retnet_rel_pos` buffers must be what every retention layer recomputes."""
    import torch

    mixer = model.backbone.layers[0].sequence_mixer
    for key, value in rel_pos.items():
        ours = getattr(mixer, key.split(".")[-1], None)
        if ours is None or ours.shape != value.shape or not torch.allclose(ours, value.float()):
            raise ArSliceError(f"{source}: {key} differs from torchscale's RetNetRelPos for this "
                               "shape; not implemented")  # fmt: skip


def load_retnet(target: str, model_config=None):
    from models.backbone import LanguageModel
    from models.checkpoints.io import (
        find_weights_file,
        load_state_dict_checked,
        read_checkpoint,
        read_config_file,
        state_dict_from,
    )

    weights_file = find_weights_file(Path(target).expanduser(), "retnet")
    state = state_dict_from(read_checkpoint(weights_file), weights_file)
    if all(k.startswith("decoder.") for k in state):  # fairseq's RetNetLanguageModel
        state = {k[len("decoder.") :]: v for k, v in state.items()}
    folder = weights_file.parent
    beside = [folder / n for n in (f"{weights_file.stem}.json", *CONFIG_NAMES) if (folder / n).is_file()]  # fmt: skip
    if model_config is not None:
        source, cfg = f"{model_config} (--model-config)", read_config_file(Path(model_config))
    elif beside:
        source, cfg = str(beside[0]), read_config_file(beside[0])
    else:
        raise ArSliceError(
            f"{weights_file}: no RetNetConfig beside it ({' / '.join(CONFIG_NAMES)}); save the "
            "RetNetConfig arguments there as JSON, or pass them with --model-config"
        )
    shapes = shapes_of(state, str(weights_file))
    settings = resolve_settings(cfg, shapes, source)
    try:
        model = LanguageModel(model_config_for(shapes, settings))
    except (TypeError, ValueError, ArSliceError) as e:
        raise ArSliceError(f"{source}: cannot build the model ({e})") from None
    converted, rel_pos = convert_retnet_state(state, settings, shapes["d_model"])
    _check_rel_pos(model, rel_pos, str(weights_file))
    tied = ("lm_head.weight",) if settings["share_decoder_input_output_embed"] else ()
    load_state_dict_checked(model, converted, source=str(weights_file), tied=tied)
    used = {"config": source, "num_heads": shapes["num_heads"],
            **{k: settings[k] for k in _OPTIONS}}  # fmt: skip
    return model, folder, used


@register_loader("retnet", order=7, model_config=True, local=("file", "dir"))
def load_spec(request: LoadRequest) -> LoadedModel:
    model, tokenizer_dir, settings = load_retnet(request.target, request.model_config)
    return loaded_language_model(model, request, tokenizer_dir, settings)
