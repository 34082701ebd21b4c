"""`h3:<file, dir or hub id[@revision]>`: HazyResearch/H3 checkpoints as published (`model.pt`, a
raw `torch.save` state dict of `src/models/ssm_seq.py`'s `SSMLMHeadModel`, no config), loaded
into models.backbone.

The published models (danfu09/H3-125M, -355M, -1.3B, -2.7B) are hybrids: H3 layers
(models/mixers/h3.py) with flash-attn's `MHA` at a few layers, flash-attn's tanh-GELU `Mlp`,
pre-norm `Block`s with LayerNorms, GPT-2 embeddings without positions, a head tied to them and
GPT-2's vocabulary padded to 50264. Upstream keys `backbone.layers.N.{mixer,mlp}` become
`sequence_mixer` / `state_mixer`; the legacy names `SSMLMHeadModel.load_state_dict` maps are
mapped as it maps them (`s4seq.encoder.` -> `backbone.`, `embedding.` -> the word embeddings, and
the post-norm `backbone.norm` layout's norms moved one place along). A Lightning checkpoint
(`state_dict` under `model.`, optimizer state beside it) is read weights-only.

Widths, depth, the MLP, H3's `d_state` and `head_dim`, the vocabulary and which layers are attention
show in the weights. What does not — the attention heads, rotary, `layer_norm_epsilon`, H3's
discretisation — comes from, first found of:
  1. the file given with `--model-config`;
  2. `config.json` (or `<name>.json`, `config.yaml`) beside the weights;
  3. for a published shape (recognised by width, depth and attention layers), the arguments its
     README runs it with (`examples/generate_text_h3.py`);
each the `SSMLMHeadModel` arguments as JSON or YAML, e.g. {"d_model": 768, "n_layer": 12,
"d_inner": 3072, "vocab_size": 50257, "ssm_cfg": {"mode": "diag", "measure": "diag-lin"},
"attn_layer_idx": [6], "attn_cfg": {"num_heads": 12}, "pad_vocab_size_multiple": 8}. Shapes a
config names are checked against the weights; options that change nothing in an evaluation
forward (dropout, initialisation, fused kernels) are accepted; any other option this project does
not implement is refused by name. What was used is recorded in meta.json (`loader_settings`).
"""

from __future__ import annotations

import logging
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
# the published models' arguments (HazyResearch/H3 README and examples/README.md), keyed by what
# the weights show: (d_model, n_layer, attention layers)
PUBLISHED = {
    (768, 12, (6,)): ("danfu09/H3-125M", {"num_heads": 12}),
    (1024, 24, (8, 16)): ("danfu09/H3-355M", {"num_heads": 16}),
    (2048, 24, (8, 16)): ("danfu09/H3-1.3B", {"num_heads": 16}),
    (2560, 32, (8, 16, 24)): ("danfu09/H3-2.7B model-3attn.pt", {"num_heads": 20}),
    (2560, 32, (10, 21)): (
        "danfu09/H3-2.7B model-2attn-rotary.pt",
        {"num_heads": 20, "rotary_emb_dim": 64},
    ),
}
PUBLISHED_SSM = {"mode": "diag", "measure": "diag-lin"}

# SSMLMHeadModel arguments: shapes (checked against the weights), options, no-effect
_SHAPES = (
    "d_model",
    "n_layer",
    "d_inner",
    "vocab_size",
    "max_position_embeddings",
    "attn_layer_idx",
)
_NO_EFFECT = {
    "resid_dropout", "embed_dropout", "dropout_cls", "initializer_cfg", "fused_mlp",
    "fused_dropout_add_ln", "pad_vocab_size_multiple", "residual_in_fp32", "device", "dtype",
}  # fmt: skip
# H3 (and its SSKernel) arguments
_SSM_SHAPES = ("d_state", "head_dim")
_SSM_OPTIONS = ("disc",)
_SSM_NO_EFFECT = {
    "measure", "dt_min", "dt_max", "lr", "deterministic", "rank", "verbose", "measure_args",
    "dropout", "use_fast_fftconv", "layer_idx", "device", "dtype",
}  # fmt: skip
_SSM_MUST_BE = {
    "mode": ("diag",), "real_type": ("exp",), "bandlimit": (None,), "force_real": (False,),
    "n_ssm": (None,), "l_max": (None,),
}  # fmt: skip
# flash-attn MHA arguments
_ATTN_OPTIONS = ("num_heads", "rotary_emb_dim", "softmax_scale")
_ATTN_NO_EFFECT = {
    "dropout", "fused_bias_fc", "use_flash_attn", "checkpointing", "return_residual",
    "layer_idx", "device", "dtype", "bias",
}  # fmt: skip
_ATTN_MUST_BE = {
    "causal": (True,), "cross_attn": (False,), "dwconv": (False,),
    "rotary_emb_scale_base": (0, None),
}  # fmt: skip


def map_legacy_keys(state: dict) -> dict:
    """`SSMLMHeadModel.load_state_dict`'s remapping, as upstream does it: legacy names first,
    then the post-norm layout (Mixer / MLP -> Dropout -> Add -> LN, with a `backbone.ln_0`) moved
    to the pre-norm one (each norm one place along; the last becomes ln_f)."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^s4seq\.encoder\.", "backbone.", key)
        key = re.sub(r"^embedding\.", "backbone.embeddings.word_embeddings.", key)
        key = re.sub(r"^backbone\.norm", "backbone.ln_0", key)
        out[key] = value
    if "backbone.ln_0.weight" not in out:
        return out
    n = 1 + max(int(m.group(1)) for k in out if (m := re.match(r"backbone\.layers\.(\d+)\.", k)))
    for part in ("weight", "bias"):
        out[f"backbone.ln_f.{part}"] = out.pop(f"backbone.layers.{n - 1}.norm2.{part}")
        for layer in reversed(range(n)):
            out[f"backbone.layers.{layer}.norm2.{part}"] = out.pop(f"backbone.layers.{layer}.norm1.{part}")  # fmt: skip
            if layer > 0:
                out[f"backbone.layers.{layer}.norm1.{part}"] = out.pop(f"backbone.layers.{layer - 1}.norm2.{part}")  # fmt: skip
        out[f"backbone.layers.0.norm1.{part}"] = out.pop(f"backbone.ln_0.{part}")
    return out


def convert_h3_state(state: dict, source: str) -> tuple[dict, dict]:
    """Upstream keys -> models.backbone's; also returns stored rotary frequencies (checked
    against the model's own by the loader)."""
    import torch

    state = map_legacy_keys(state)
    out, inv_freq = {}, {}
    for key, value in state.items():
        if key.endswith(".rotary_emb.inv_freq"):
            inv_freq[key] = value
            continue
        if key == "lm_head.weight":
            emb = state.get("backbone.embeddings.word_embeddings.weight")
            if emb is None or emb.shape != value.shape or not torch.equal(emb, value):
                raise ArSliceError(f"{source}: lm_head.weight differs from the word embeddings; "
                                   "SSMLMHeadModel ties them")  # fmt: skip
            continue
        key = re.sub(r"^(backbone\.layers\.\d+)\.mixer\.", r"\1.sequence_mixer.", key)
        key = re.sub(r"^(backbone\.layers\.\d+)\.mlp\.", r"\1.state_mixer.", key)
        out[key] = value
    return out, inv_freq


def shapes_of(state: dict, source: str) -> dict[str, Any]:
    """What a converted H3 LM state dict shows, in SSMLMHeadModel's argument names."""

    def shape(key):
        if key not in state:
            raise ArSliceError(f"{source}: not an H3 LM state dict (no {key})")
        return tuple(state[key].shape)

    vocab, d_model = shape("backbone.embeddings.word_embeddings.weight")
    layers = sorted(
        {int(m.group(1)) for k in state if (m := re.match(r"backbone\.layers\.(\d+)\.", k))}
    )
    if not layers:
        raise ArSliceError(f"{source}: no backbone.layers.* keys")
    attention = [i for i in layers if f"backbone.layers.{i}.sequence_mixer.Wqkv.weight" in state]
    ssm = [i for i in layers if i not in attention]
    shapes = {
        "vocab_size": vocab, "d_model": d_model, "n_layer": len(layers),
        "d_inner": shape("backbone.layers.0.state_mixer.fc1.weight")[0],
        "attn_layer_idx": attention, "max_position_embeddings": 0,
    }  # fmt: skip
    positions = state.get("backbone.embeddings.position_embeddings.weight")
    if positions is not None:
        shapes["max_position_embeddings"] = int(positions.shape[0])
    if ssm:
        prefix = f"backbone.layers.{ssm[0]}.sequence_mixer."
        shapes["d_state"] = shape(prefix + "ssm_k_kernel.kernel.B")[1]
        shapes["head_dim"] = d_model // shape(prefix + "D")[0]
    return shapes


def _check(cfg: dict, where: str, shapes: dict, shape_keys, options, no_effect, must_be, source):
    """The options among `cfg`; refuses shapes that differ from the weights and unknown keys."""
    chosen = {}
    for key, value in cfg.items():
        name = f"{where}{key}"
        if key in shape_keys:
            have = shapes.get(key)
            if key == "vocab_size" and isinstance(value, int):
                pad = int(cfg.get("pad_vocab_size_multiple", 1) or 1)
                value = -(-value // pad) * pad
            if key == "attn_layer_idx":
                value = sorted(value or [])
            if value is not None and have is not None and value != have:
                raise ArSliceError(f"{source}: {name} is {value} but the weights have {have}; "
                                   "this config does not describe these weights")  # fmt: skip
        elif key in options:
            chosen[key] = value
        elif key in must_be:
            if value not in must_be[key]:
                raise ArSliceError(f"{source}: {name}={value!r} is not implemented (only "
                                   f"{' or '.join(repr(v) for v in must_be[key])})")  # fmt: skip
        elif key not in no_effect:
            known = sorted({*shape_keys, *options, *no_effect, *must_be})
            raise ArSliceError(f"{source}: {name} is not an option this project implements for "
                               f"H3 models; it knows: {', '.join(known)}")  # fmt: skip
    return chosen


def resolve_settings(cfg: dict | None, shapes: dict, source: str) -> dict[str, Any]:
    """The settings the weights do not show, from an SSMLMHeadModel config (None: published)."""
    if not isinstance(cfg, dict):
        raise ArSliceError(f"{source}: expected a mapping of SSMLMHeadModel arguments")
    top = {k: v for k, v in cfg.items() if k not in ("ssm_cfg", "attn_cfg")}
    settings = _check(top, "", shapes, _SHAPES, ("layer_norm_epsilon",), _NO_EFFECT, {}, source)
    ssm = _check(cfg.get("ssm_cfg") or {}, "ssm_cfg.", shapes, _SSM_SHAPES, _SSM_OPTIONS,
                 _SSM_NO_EFFECT, _SSM_MUST_BE, source)  # fmt: skip
    attn = _check(cfg.get("attn_cfg") or {}, "attn_cfg.", shapes, (), _ATTN_OPTIONS,
                  _ATTN_NO_EFFECT, _ATTN_MUST_BE, source)  # fmt: skip
    if shapes["attn_layer_idx"] and "num_heads" not in attn:
        raise ArSliceError(
            f"{source}: the weights have attention at layers {shapes['attn_layer_idx']} but the "
            'config names no attn_cfg.num_heads; give it, e.g. {"attn_cfg": {"num_heads": 12}}'
        )
    return {
        "layer_norm_epsilon": float(settings.get("layer_norm_epsilon", 1e-5)),
        "disc": ssm.get("disc", "bilinear"),
        "num_heads": attn.get("num_heads"),
        "rotary_emb_dim": int(attn.get("rotary_emb_dim") or 0),
        "softmax_scale": attn.get("softmax_scale"),
    }


def model_config_for(shapes: dict, settings: dict):
    from models.backbone import ModelConfig

    attention = {"num_heads": settings["num_heads"], "rotary_emb_dim": settings["rotary_emb_dim"],
                 "softmax_scale": settings["softmax_scale"]}  # fmt: skip
    ssm = {"d_state": shapes.get("d_state", 64), "head_dim": shapes.get("head_dim", 1),
           "disc": settings["disc"]}  # fmt: skip
    attn_layers = shapes["attn_layer_idx"]
    every_layer_attention = len(attn_layers) == shapes["n_layer"]
    return ModelConfig(
        vocab_size=shapes["vocab_size"],
        d_model=shapes["d_model"],
        n_layers=shapes["n_layer"],
        sequence_mixer="attention" if every_layer_attention else "h3",
        sequence_mixer_kwargs=attention if every_layer_attention else ssm,
        state_mixer="mlp",
        state_mixer_kwargs={"hidden": shapes["d_inner"], "activation": "gelu_tanh"},
        l_max=2048,
        max_position_embeddings=shapes["max_position_embeddings"],
        layer_norm_epsilon=settings["layer_norm_epsilon"],
        layer_mixers=[]
        if every_layer_attention or not attn_layers
        else [{"layers": list(attn_layers), "name": "attention", "kwargs": attention}],
    )


def find_config(weights_file: Path) -> Path | None:
    folder = weights_file.parent
    for name in (f"{weights_file.stem}.json", f"{weights_file.stem}.yaml", *CONFIG_NAMES):
        if (folder / name).is_file():
            return folder / name
    return None


def weights_file_of(target: str, spec: str, is_hub: bool, revision: str | None) -> Path:
    """The weights file a target names: a file, a directory holding one, or a hub repo (at
    `revision`, the commit load_model resolved), fetched under the project's hub policy."""
    from models.checkpoints.io import find_weights_file

    path = Path(target).expanduser()
    if is_hub and not path.exists():
        from ar_slicing.machinery import hub

        patterns = ["*.pt", "*.json", "*.yaml"]
        path = hub.fetch(target, revision, patterns, spec, "the downloaded model.pt")
    return find_weights_file(path, "h3")


def load_h3(request: LoadRequest):
    """(LanguageModel with the checkpoint's weights, directory to look for a tokenizer in, the
    settings used)."""
    from models.backbone import LanguageModel
    from models.checkpoints.based import _check_inv_freq
    from models.checkpoints.io import (
        load_state_dict_checked,
        read_checkpoint,
        read_config_file,
        state_dict_from,
    )

    weights_file = weights_file_of(request.target, request.spec, request.is_hub, request.commit)
    state, inv_freq = convert_h3_state(
        state_dict_from(read_checkpoint(weights_file), weights_file), str(weights_file)
    )
    shapes = shapes_of(state, str(weights_file))
    beside = find_config(weights_file) if request.model_config is None else None
    key = (shapes["d_model"], shapes["n_layer"], tuple(shapes["attn_layer_idx"]))
    if request.model_config is not None:
        source = f"{request.model_config} (--model-config)"
        cfg = read_config_file(Path(request.model_config))
    elif beside is not None:
        source, cfg = str(beside), read_config_file(beside)
    elif key in PUBLISHED:
        name, attn = PUBLISHED[key]
        source = f"the published {name} (HazyResearch/H3 README: its generate_text_h3.py arguments)"
        cfg = {"ssm_cfg": dict(PUBLISHED_SSM), "attn_cfg": dict(attn)}
    elif not shapes["attn_layer_idx"]:
        source, cfg = "SSMLMHeadModel's defaults (no config beside the weights)", {}
    else:
        raise ArSliceError(
            f"{weights_file}: H3 with attention at layers {shapes['attn_layer_idx']} "
            f"(d_model {shapes['d_model']}, {shapes['n_layer']} layers) is no published shape "
            "and no config is beside it; pass the SSMLMHeadModel arguments with --model-config, "
            'e.g. {"attn_cfg": {"num_heads": 12}, "ssm_cfg": {"mode": "diag"}}'
        )
    settings = resolve_settings(cfg, shapes, source)
    try:
        model = LanguageModel(model_config_for(shapes, settings))
    except (TypeError, ValueError, ArSliceError) as e:
        raise ArSliceError(f"{source}: cannot build the model ({e})") from None
    _check_inv_freq(model, {re.sub(r"^backbone\.", "transformer.", k): v for k, v in inv_freq.items()},
                    str(weights_file))  # fmt: skip
    load_state_dict_checked(model, state, source=str(weights_file), tied=("lm_head.weight",))
    used = {"config": source, "published_checkpoint": key in PUBLISHED and source.startswith("the published"),
            "attention_layers": shapes["attn_layer_idx"], "d_state": shapes.get("d_state"),
            "head_dim": shapes.get("head_dim"), **settings}  # fmt: skip
    log.info("h3 %s: %s (from %s)", weights_file, used, source)
    return model, weights_file.parent, used


@register_loader("h3", order=6, hub=True, model_config=True, local=("file", "dir"))
def load_spec(request: LoadRequest) -> LoadedModel:
    model, tokenizer_dir, settings = load_h3(request)
    return loaded_language_model(model, request, tokenizer_dir, settings)
