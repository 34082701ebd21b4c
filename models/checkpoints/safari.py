"""`safari:<checkpoint>`: a HazyResearch/safari Hyena LM (e.g. Hyena-153M) -> models.backbone.

The checkpoint is a raw state dict (`torch.save(model.state_dict())`, as the published
`Zymrael/hyena-small-150b-tok`), a Lightning `last.ckpt` of a safari training run, a directory
holding one weights file, or a hub id.

Names and gating. safari's `ConvLMHeadModel` names its blocks `backbone.layers.{i}.mixer.*` and
`.mlp.fc1/fc2` (flash-attn `Block`, tanh-GELU `Mlp`); this project (and Zoology) use
`sequence_mixer` and `state_mixer`. safari's `HyenaOperator` splits the short-filtered `in_proj`
output into `(x0, x1, v)` and computes `x0 ⊙ h * (x1 ⊙ v)`: the *second* third gates before the
long convolution and the *first* after it. Zoology's `Hyena` (models/mixers/hyena.py) splits into
`(x1, x2, v)` and computes `x2 ⊙ h * (x1 ⊙ v)`, so the first two d-row blocks of `in_proj` and
`short_filter` are swapped on the way in. safari uses `layer_norm_epsilon` in every norm.

Settings. Widths, depth, vocabulary, filter length and sizes, positions and the MLP come from the
tensor shapes. What the weights cannot show — above all `modulate` (the decay's parameters exist
either way) and `shift`, `normalized`, `bias`, `layer_norm_epsilon` — comes from safari's own
config, read as safari writes it (YAML or JSON; `model_config` as in `configs/evals/*.yaml`, `model`
as in its hydra config, or the model config itself, each with a nested `layer`), first found of:
  1. the file given with `--model-config` (`load_model(..., model_config=...)`);
  2. the hydra config a Lightning checkpoint carries (`hyper_parameters`);
  3. beside the weights: `<name>.json|yaml`, `config.json|yaml|yml`, the one `*.yaml` there, or the
     run directory's `.hydra/config.yaml` for `<run>/checkpoints/<name>.ckpt`;
  4. for the published `Zymrael/hyena-small-150b-tok` (recognised by its hub id or its exact
     shapes), safari's evaluation config for it, `configs/evals/hyena_small_150b.yaml` (modulate
     False; its training config says True);
  5. safari's defaults (modulate True).
The settings used are in `LoadedModel.settings` (and the eval stage's meta.json). Options with no
effect on an evaluation forward (dropout, learning rates, fused-kernel switches) are accepted;
any other option this project does not implement is refused by name.
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

HYENA_SMALL_150B = "Zymrael/hyena-small-150b-tok"
# safari configs/evals/hyena_small_150b.yaml: how safari evaluates the published checkpoint
HYENA_SMALL_150B_EVAL = {
    "model_name": "hyena-small",
    "tokenizer_name": "gpt2",
    "model_config": {
        "_name_": "lm", "d_model": 864, "d_inner": 1728, "n_layer": 18, "vocab_size": 50257,
        "embed_dropout": 0.0,
        "layer": {
            "_name_": "hyena", "emb_dim": 33, "filter_order": 64, "local_order": 3,
            "l_max": 2048, "modulate": False, "w": 14,
        },
        "fused_mlp": True, "fused_dropout_add_ln": True, "residual_in_fp32": True,
        "pad_vocab_size_multiple": 8,
    },
}  # fmt: skip

# keys safari's filter may omit (recomputed deterministically from l_max / d_model)
_RECOMPUTED = ("filter_fn.pos_emb.t", "filter_fn.modulation.deltas")
CONFIG_NAMES = ("config.json", "config.yaml", "config.yml")

# ConvLMHeadModel arguments. Shape keys are read from the weights and checked against the config.
_MODEL_SHAPES = ("d_model", "n_layer", "d_inner", "vocab_size", "max_position_embeddings")
_MODEL_NO_EFFECT = {
    "_name_": "the model's registry name", "resid_dropout": "dropout", "embed_dropout": "dropout",
    "dropout_cls": "dropout", "initializer_cfg": "initialisation",
    "fused_mlp": "a fused kernel of the same function", "sequence_parallel": "multi-GPU layout",
    "fused_dropout_add_ln": "a fused kernel of the same function", "process_group": "multi-GPU",
    "residual_in_fp32": "the residual stream's precision in bf16 runs (none in fp32)",
    "pad_vocab_size_multiple": "read from the weights", "device": "placement", "dtype": "placement",
}  # fmt: skip
_MODEL_MUST_BE = {"attn_layer_idx": (None, []), "attn_cfg": (None, {})}
# HyenaOperator / HyenaFilter / ExponentialModulation arguments
_LAYER_SHAPES = ("l_max", "filter_order", "short_filter_order", "emb_dim", "num_inner_mlps")
_LAYER_OPTIONS = ("modulate", "shift", "normalized", "bias", "fast_decay_pct", "slow_decay_pct", "target")  # fmt: skip
_LAYER_NO_EFFECT = {
    "_name_": "the layer's registry name", "dropout": "dropout", "filter_dropout": "dropout",
    "fused_bias_fc": "a fused kernel of the same function",
    "fused_fft_conv": "a fused kernel of the same function", "jit_filter": "compilation",
    "return_state": "API", "lr": "learning rate", "lr_pos_emb": "learning rate",
    "wd": "weight decay", "modulation_lr": "learning rate", "layer_idx": "bookkeeping",
    "w": "initial Sin frequency (the learned one is in the weights)",
    "local_order": "not a HyenaOperator argument: safari passes it on to ExponentialModulation, "
    "which ignores it", "device": "placement", "dtype": "placement",
}  # fmt: skip
_LAYER_MUST_BE = {
    "order": (2,), "num_heads": (1,), "inner_factor": (1,), "num_blocks": (1,),
    "outer_mixing": (False,), "post_order_ffn": (False,),
    # safari's Activation() makes each of these nn.Identity
    "activation": ("id", "identity", "linear", None),
    "filter_cls": ("hyena-filter",),
}  # fmt: skip
# safari's defaults for what the weights cannot show (HyenaFilter, ExponentialModulation, LMBackbone)
SAFARI_DEFAULTS = {
    "modulate": True, "shift": 0.0, "normalized": False, "bias": True, "fast_decay_pct": 0.3,
    "slow_decay_pct": 1.5, "target": 1e-2, "layer_norm_epsilon": 1e-5,
}  # fmt: skip


def rename_safari_keys(state: dict, source: str = "safari checkpoint") -> dict:
    """safari block names -> Zoology's: `.mixer.` -> `.sequence_mixer.`, `.mlp.` -> `.state_mixer.`;
    first the legacy names safari's `ConvLMHeadModel.load_state_dict` maps (`s4seq.encoder.`,
    `embedding.`, `.mixer.output_linear.`), as it does."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^s4seq\.encoder\.", "backbone.", key)
        key = re.sub(r"^embedding\.", "backbone.embeddings.word_embeddings.", key)
        if key.startswith(("backbone.norm", "backbone.ln_0")):  # safari reorders every norm
            raise ArSliceError(
                f"{source}: {key}: safari's legacy post-norm block order (its ln_0) is not "
                "implemented"
            )
        key = re.sub(
            r"^(backbone\.layers\.\d+)\.mixer\.output_linear\.", r"\1.mixer.out_proj.", key
        )
        key = re.sub(r"^(backbone\.layers\.\d+)\.mixer\.", r"\1.sequence_mixer.", key)
        key = re.sub(r"^(backbone\.layers\.\d+)\.mlp\.", r"\1.state_mixer.", key)
        out[key] = value
    return out


def swap_gate_blocks(tensor, d_model: int):
    """Exchange rows [0, d) and [d, 2d) of an in_proj / short_filter tensor (first dim 3d)."""
    import torch

    return torch.cat(
        [tensor[d_model : 2 * d_model], tensor[:d_model], tensor[2 * d_model :]], dim=0
    )


def convert_safari_state(state: dict, d_model: int, source: str = "safari checkpoint") -> dict:
    """Rename safari keys and reorder the Hyena projections to Zoology's gating order."""
    state = rename_safari_keys(state, source)
    for key in list(state):
        if re.search(r"\.sequence_mixer\.(in_proj|short_filter)\.(weight|bias)$", key):
            state[key] = swap_gate_blocks(state[key], d_model)
    return state


def shapes_of(state: dict, source: str) -> dict[str, int]:
    """The architecture a (renamed) safari Hyena LM state dict shows, in safari's config names."""

    def shape(key):
        if key not in state:
            raise ArSliceError(f"{source}: not a safari Hyena LM state dict (no {key})")
        return tuple(state[key].shape)

    vocab, d_model = shape("backbone.embeddings.word_embeddings.weight")
    layers = sorted(
        {int(m.group(1)) for k in state if (m := re.match(r"backbone\.layers\.(\d+)\.", k))}
    )
    if not layers:
        raise ArSliceError(f"{source}: no backbone.layers.* keys")
    attention_layers = [
        i for i in layers if f"backbone.layers.{i}.sequence_mixer.Wqkv.weight" in state
    ]
    if attention_layers:
        raise ArSliceError(
            f"{source}: layers {attention_layers} are attention (hybrid safari models are not supported)"
        )
    prefix = "backbone.layers.0.sequence_mixer."
    in_rows = shape(prefix + "in_proj.weight")[0]
    if in_rows != 3 * d_model:
        raise ArSliceError(
            f"{source}: in_proj has {in_rows} rows for d_model {d_model}; only order-2 Hyena "
            f"(3 x d_model) is supported"
        )
    if any(".sequence_mixer.ord_proj_w" in k for k in state):
        raise ArSliceError(f"{source}: post_order_ffn (ord_proj_w) is not supported")
    _, l_max, emb_dim = shape(prefix + "filter_fn.pos_emb.z")
    linears = [
        k for k in state
        if k.startswith(prefix + "filter_fn.implicit_filter.") and k.endswith(".weight")
    ]  # fmt: skip
    positions = state.get("backbone.embeddings.position_embeddings.weight")
    return {
        "vocab_rows": vocab,
        "d_model": d_model,
        "n_layer": len(layers),
        "d_inner": shape("backbone.layers.0.state_mixer.fc1.weight")[0],
        "max_position_embeddings": 0 if positions is None else int(positions.shape[0]),
        "l_max": l_max,
        "emb_dim": emb_dim,
        "filter_order": shape(prefix + "filter_fn.implicit_filter.0.weight")[0],
        "short_filter_order": shape(prefix + "short_filter.weight")[-1],
        "num_inner_mlps": len(linears) - 2,
    }


def published_shapes() -> dict[str, int]:
    """The shapes of the published Hyena-153M (`Zymrael/hyena-small-150b-tok`)."""
    model = HYENA_SMALL_150B_EVAL["model_config"]
    vocab, pad = model["vocab_size"], model["pad_vocab_size_multiple"]
    return {
        "vocab_rows": -(-vocab // pad) * pad, "d_model": model["d_model"],
        "n_layer": model["n_layer"], "d_inner": model["d_inner"], "max_position_embeddings": 0,
        "l_max": model["layer"]["l_max"], "emb_dim": model["layer"]["emb_dim"],
        "filter_order": model["layer"]["filter_order"], "short_filter_order": 3, "num_inner_mlps": 2,
    }  # fmt: skip


def model_section(data: dict, source: str) -> dict:
    """safari's model config inside a config file: `model_config` (evaluation configs), `model`
    (hydra / Lightning hyper-parameters), or the model config itself (it has a `layer`)."""
    for key in ("model_config", "model"):
        if isinstance(data.get(key), dict):
            return data[key]
    if isinstance(data.get("layer"), dict):
        return data
    raise ArSliceError(
        f"{source}: not a safari config: expected a 'model_config' or 'model' section (as in "
        "safari's configs/evals/*.yaml and its hydra config), or a model config with a 'layer', "
        'e.g. {"model": {"layer": {"_name_": "hyena", "modulate": false}}}'
    )


def find_config(weights_file: Path) -> Path | None:
    """A safari config file beside the weights, or in the hydra run directory they belong to."""
    folder = weights_file.parent
    names = (f"{weights_file.stem}.json", f"{weights_file.stem}.yaml", *CONFIG_NAMES)
    for name in names:
        if (folder / name).is_file():
            return folder / name
    yamls = sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    if len(yamls) > 1:
        raise ArSliceError(
            f"{folder}: several YAML files ({', '.join(p.name for p in yamls)}); name the "
            "model's config with --model-config"
        )
    if yamls:
        return yamls[0]
    hydra = folder.parent / ".hydra" / "config.yaml"
    if folder.name == "checkpoints" and hydra.is_file():
        return hydra
    return None


def _unresolved(value) -> bool:
    return isinstance(value, str) and "${" in value


def resolve_settings(
    model_cfg: dict | None, shapes: dict[str, int], source: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """(filter and norm settings, options accepted without effect: key -> value) from a safari
    model config, checked against the shapes; refuses what this project does not implement."""
    settings = dict(SAFARI_DEFAULTS)
    ignored: dict[str, str] = {}
    if model_cfg is None:
        return settings, ignored
    layer = model_cfg.get("layer") or {}
    if not isinstance(layer, dict):
        raise ArSliceError(f"{source}: 'layer' must be a mapping of HyenaOperator options")
    if model_cfg.get("_name_", "lm") != "lm" or layer.get("_name_", "hyena") != "hyena":
        raise ArSliceError(
            f"{source}: model {model_cfg.get('_name_')!r} with layer {layer.get('_name_')!r}: "
            "only safari's 'lm' (ConvLMHeadModel) with 'hyena' layers is supported"
        )
    vocab = model_cfg.get("vocab_size")
    if isinstance(vocab, int):
        pad = int(model_cfg.get("pad_vocab_size_multiple", 1) or 1)
        model_cfg = {**model_cfg, "vocab_size": -(-vocab // pad) * pad}
    for where, cfg, shape_keys, options, no_effect, must_be in (
        ("", model_cfg, _MODEL_SHAPES, ("layer_norm_epsilon",), _MODEL_NO_EFFECT, _MODEL_MUST_BE),
        ("layer.", layer, _LAYER_SHAPES, _LAYER_OPTIONS, _LAYER_NO_EFFECT, _LAYER_MUST_BE),
    ):
        for key, value in cfg.items():
            name = where + key
            if key == "layer" and not where:
                continue
            if _unresolved(value) and (key in options or key in must_be):
                raise ArSliceError(
                    f"{source}: {name} is an unresolved interpolation ({value}); give the "
                    "resolved config with --model-config"
                )
            if key in shape_keys:
                have = shapes["vocab_rows" if key == "vocab_size" else key]
                if not _unresolved(value) and value is not None and int(value) != have:
                    raise ArSliceError(
                        f"{source}: {name} is {value} but the weights have {have}; this config "
                        "does not describe these weights"
                    )
            elif key in options:
                settings[key] = value
            elif key in no_effect:
                ignored[name] = value
            elif key in must_be:
                if value not in must_be[key]:
                    raise ArSliceError(
                        f"{source}: {name}={value!r} is not implemented (only "
                        f"{' or '.join(repr(v) for v in must_be[key])})"
                    )
            else:
                accepted = sorted({*shape_keys, *options, *no_effect, *must_be} - {"layer"})
                raise ArSliceError(
                    f"{source}: {name} is not an option this project implements for safari "
                    f"Hyena models; it knows: {', '.join(accepted)}"
                )
    return settings, ignored


def model_config_for(shapes: dict[str, int], settings: dict[str, Any]):
    from models.backbone import ModelConfig

    d_model = shapes["d_model"]
    return ModelConfig(
        vocab_size=shapes["vocab_rows"],
        d_model=d_model,
        n_layers=shapes["n_layer"],
        sequence_mixer="hyena",
        sequence_mixer_kwargs={
            "filter_order": shapes["filter_order"],
            "short_filter_order": shapes["short_filter_order"],
            "emb_dim": shapes["emb_dim"],
            "num_inner_mlps": shapes["num_inner_mlps"],
            **{k: settings[k] for k in _LAYER_OPTIONS},
        },
        state_mixer="mlp",
        state_mixer_kwargs={"hidden": shapes["d_inner"], "activation": "gelu_tanh"},
        l_max=shapes["l_max"],
        max_position_embeddings=shapes["max_position_embeddings"],
        layer_norm_epsilon=float(settings["layer_norm_epsilon"]),
    )


def _weights_file(target: str, revision: str | None = None) -> Path:
    """The weights file a safari target names: a file, a directory with one, or a hub id (at
    `revision`, a commit load_model resolved)."""
    from models.checkpoints.io import find_weights_file

    path = Path(target).expanduser()
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", target):
        from ar_slicing.machinery import hub

        patterns = ["*.pt", "*.pth", "*.bin", "*.ckpt", "*.safetensors", "*.json", "*.yaml"]
        path = hub.fetch(
            target, revision, patterns, f"safari:{target}", "the downloaded state-dict file"
        )
    if not path.exists():
        raise ArSliceError(f"{path}: checkpoint file not found")
    return find_weights_file(path, "safari")


def _embedding_width(raw: dict) -> int:
    """d_model from the word embeddings under today's name or safari's legacy ones (0: none)."""
    legacy = ("s4seq.encoder.embeddings.word_embeddings.weight", "embedding.weight")
    for key in ("backbone.embeddings.word_embeddings.weight", *legacy):
        if key in raw and getattr(raw[key], "ndim", 0) == 2:
            return int(raw[key].shape[1])
    return 0


def load_safari(
    target: str | Path, model_config: str | Path | None = None, revision: str | None = None
):
    """(LanguageModel with the safari checkpoint's weights, directory to look for a tokenizer in,
    the settings used)."""
    from models.backbone import LanguageModel
    from models.checkpoints.io import (
        load_state_dict_checked,
        plain_config,
        read_checkpoint,
        read_config_file,
        state_dict_from,
    )

    weights_file = _weights_file(str(target), revision)
    obj = read_checkpoint(weights_file)
    raw = state_dict_from(obj, weights_file)
    state = convert_safari_state(raw, _embedding_width(raw), str(weights_file))
    shapes = shapes_of(state, str(weights_file))
    hparams = plain_config(obj.get("hyper_parameters")) if isinstance(obj, dict) else None
    beside = find_config(weights_file) if model_config is None and not hparams else None
    published = HYENA_SMALL_150B.split("/")[1] in str(target) or shapes == published_shapes()
    if model_config is not None:
        source = f"{model_config} (--model-config)"
        model_cfg = model_section(read_config_file(Path(model_config)), source)
    elif isinstance(hparams, dict):
        source = f"{weights_file} (the hydra config in its hyper_parameters)"
        model_cfg = model_section(hparams, source)
    elif beside is not None:
        source = str(beside)
        model_cfg = model_section(read_config_file(beside), source)
    elif published:
        source = f"safari configs/evals/hyena_small_150b.yaml (the published {HYENA_SMALL_150B})"
        model_cfg = HYENA_SMALL_150B_EVAL["model_config"]
    else:
        source, model_cfg = "safari's defaults (no config found beside the weights)", None
    settings, ignored = resolve_settings(model_cfg, shapes, source)
    try:
        config = model_config_for(shapes, settings)
    except ArSliceError as e:
        raise ArSliceError(f"{weights_file}: {e}") from None
    model = LanguageModel(config)
    may_be_missing = ["lm_head.weight"] + [
        f"backbone.layers.{i}.sequence_mixer.{k}"
        for i in range(config.n_layers)
        for k in _RECOMPUTED
    ]
    load_state_dict_checked(model, state, source=str(weights_file), tied=may_be_missing)
    used = {"config": source, "published_checkpoint": published, **settings}
    if ignored:
        used["accepted_without_effect"] = ignored
    log.info(
        "safari %s: %s (from %s)",
        weights_file,
        ", ".join(f"{k}={settings[k]}" for k in settings),
        source,
    )
    return model, weights_file.parent, used


@register_loader("safari", order=3, hub=True, model_config=True, local=("file", "dir"))
def load_spec(request: LoadRequest) -> LoadedModel:
    model, tokenizer_dir, settings = load_safari(
        request.target, request.model_config, request.commit
    )
    return loaded_language_model(model, request, tokenizer_dir, settings)
