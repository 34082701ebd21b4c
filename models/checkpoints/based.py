"""`based:<dir or hub id>`: HazyResearch/based checkpoints as published (`config.json` +
`pytorch_model.bin`): the Based LM and the suite's Transformer++, loaded into models.backbone.

The config is the `GPT2Config`-style dict that upstream's `GPTLMHeadModel.from_pretrained_hf`
reads: `n_embd`, `n_layer`, `n_head`, `rms_norm`, `activation_function`, `rotary_emb_fraction`, ...,
and for Based the Hydra specs `mixer` (every layer), `alt_mixer` (layers `alt_mixer_layers`) and
`alt_mixer_2` (layers `alt_mixer_2_layers`, checked first); a layer without a spec is flash-attn's
`MHA` (Transformer++ has no spec at all). Both published layouts of the mixers are read:

    based/models/mixers/convolution.py    BaseConv          -> models/mixers/base_conv.py GatedConv
    based/models/mixers/base_conv.py      BaseConvWithSiLU4 (key conv1) ditto
    based/models/mixers/linear_attention.py LinearAttention -> models/mixers/linear_attention.py
    based/models/mixers/linear_attn.py    LinearAttention   ditto
    based/models/mixers/slide_attention.py SlidingAttention -> models/mixers/sliding_attention.py
    based/models/mixers/slide_fa2.py      SlidingsMHA       ditto
    based/models/mixers/prefix_linear_attention.py PrefixLinearAttention (JRT-RNN,
        HazyResearch/prefix-linear-attention) -> models/mixers/prefix_linear_attention.py

Upstream keys `transformer.{embeddings,layers.N.{mixer,mlp,norm1,norm2},ln_f}` become
`backbone.{embeddings,layers.N.{sequence_mixer,state_mixer,norm1,norm2},ln_f}`. As upstream's
loader does, keys naming training metrics are dropped and a shared `model.` prefix is stripped.
Every option that changes the function and is not implemented here is refused by name; options
that only choose a kernel for the same function (`use_flash_attn`, `fused_*`,
`parallel_implementation`) are accepted.
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
    checkpoint_format,
    loaded_language_model,
    register_loader,
)

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHT_NAMES = ("pytorch_model.bin", "model.safetensors")

# upstream class (last two components of `_target_`) -> what builds it here
CONV_TARGETS = ("convolution.BaseConv", "base_conv.BaseConv", "base_conv.BaseConvWithSiLU4")
LINEAR_TARGETS = ("linear_attention.LinearAttention", "linear_attn.LinearAttention")
SLIDING_TARGETS = ("slide_attention.SlidingAttention", "slide_fa2.SlidingsMHA")
# JRT-RNN (HazyResearch/prefix-linear-attention): the same GPT with an encoder-decoder mixer
PREFIX_TARGETS = ("prefix_linear_attention.PrefixLinearAttention",)

# GPT2Config defaults (transformers) for the keys a published config may omit
GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "activation_function": "gelu_new",
}  # fmt: skip
GPT2_ALIASES = {
    "hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
}  # fmt: skip

# Based calls flash-linear-attention's `parallel_based(q, k, v, True, True)` (and
# `fused_chunk_based` alike), whose signature changed under it. "Equal to upstream" means the API
# the call was written for; a config's `fla_version` key (this loader's, upstream ignores it)
# chooses the other. From 0.2.0 on the kernels read (B, T, H, D) by default while Based passes
# (B, H, T, D): a different function again, not implemented.
FLA_VERSIONS = {
    "2024": "flash-linear-attention before eeee0ee8 (2024-08-20): use_scale, q.k * feature_dim ** -0.5",
    "0.1": "flash-linear-attention from eeee0ee8 to 0.1.2 (PyPI, 2025-03): scale=True, q.k * 1",
}
DEFAULT_FLA_VERSION = "2024"

# Config keys whose value changes the function and that this loader does not implement:
# key -> the value upstream's default (or the only value implemented here) takes.
UNSUPPORTED_GLOBAL = {
    "prenorm": True, "parallel_block": False, "scale_attn_by_inverse_layer_idx": False,
    "rotary_emb_scale_base": None, "rotary_emb_interleaved": False, "attn_dwconv": False,
    "word_embed_proj_dim": None, "tie_word_embeddings": True, "lm_head_bias": False,
    "fused_dense_sqrelu_dense": False, "mlp_type": "base",
}  # fmt: skip


def _short_target(spec: dict, where: str, source: str) -> str:
    target = spec.get("_target_") if isinstance(spec, dict) else None
    if not isinstance(target, str):
        raise ArSliceError(f"{source}: `{where}` must be a Hydra spec with a `_target_`")
    return ".".join(target.split(".")[-2:])


def _check_kwargs(kwargs: dict, known: dict, source: str, what: str) -> None:
    """Refuse keys upstream's class does not take, and values of `known` keys this loader does
    not implement (`known[key]` is a tuple of the accepted values, or None for any value)."""
    for key, value in kwargs.items():
        if key not in known:
            raise ArSliceError(
                f"{source}: {what} option {key!r} is not one this loader knows; known: "
                f"{', '.join(sorted(known))}"
            )
        accepted = known[key]
        if accepted is not None and value not in accepted:
            raise ArSliceError(
                f"{source}: {what} {key}={value!r} is not implemented (only {accepted!r})"
            )


def conv_mixer(spec: dict, target: str, source: str) -> tuple[str, dict, bool]:
    """(mixer name, kwargs, renames conv1 -> conv) for a BaseConv spec."""
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    known = {"l_max": None, "use_bias": None, "expand_proj": None, "use_cuda": None}
    if target == "convolution.BaseConv":
        # upstream's __init__ swallows `kernel_sizes` in **kwargs; its kernel is `kernel_size`
        known |= {"kernel_size": None, "kernel_sizes": None}
        kernel = kwargs.get("kernel_size", 3)
    elif target == "base_conv.BaseConv":
        known |= {"kernel_size": None}
        kernel = kwargs.get("kernel_size", 3)
    else:  # BaseConvWithSiLU4 builds one convolution per kernel size and keeps the first
        known |= {"kernel_sizes": None, "implicit_long_conv": None}
        sizes = kwargs.get("kernel_sizes", [3])
        kernel = sizes[0] if isinstance(sizes, list) else sizes
    _check_kwargs(kwargs, known, source, target)
    return (
        "based_conv",
        {
            "kernel_size": int(kernel),
            "expand_proj": int(kwargs.get("expand_proj", 2)),
            "bias": bool(kwargs.get("use_bias", True)),
            # the causal_conv1d path (use_cuda) forces a convolution bias
            "conv_bias": bool(kwargs.get("use_cuda", False)),
        },
        target != "convolution.BaseConv",
    )


def linear_mixer(spec: dict, target: str, cfg: dict, source: str) -> tuple[str, dict, bool]:
    """(mixer name, kwargs, False) for a Taylor linear-attention spec."""
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    feature_dim = int(kwargs.get("feature_dim", 16))
    num_heads = int(kwargs.get("num_heads", 16))
    if target == "linear_attention.LinearAttention":
        known = {
            "l_max": None, "feature_dim": None, "num_heads": None, "head_dim": None, "eps": None,
            "feature_map": None,
            # all but ThunderKittens' (which adds an output RMSNorm) compute the same function
            "parallel_implementation": ("quadratic", "linear", "fla_parallel", "fla_chunk"),
        }  # fmt: skip
        _check_kwargs(kwargs, known, source, target)
        fmap = kwargs.get("feature_map")
        if not isinstance(fmap, dict) or not str(fmap.get("_target_", "")).endswith(".TaylorExp"):
            raise ArSliceError(
                f"{source}: {target} feature_map {fmap!r} is not implemented; only "
                "{'_target_': 'based.models.mixers.linear_attention.TaylorExp', 'input_dim': N}"
            )
        _check_kwargs(
            {k: v for k, v in fmap.items() if k != "_target_"}, {"input_dim": None}, source,
            "TaylorExp",
        )  # fmt: skip
        head_dim = kwargs.get("head_dim")
        eps = float(kwargs.get("eps", 1e-12))
        if str(kwargs.get("parallel_implementation", "quadratic")).startswith("fla"):
            # FLA's kernels never call TaylorExp: they scale q.k by their own rule and add 1e-6,
            # whatever `input_dim` and `eps` say
            scale_dim = fla_scale_dim(feature_dim, cfg, source)
            eps = 1e-6
        else:
            scale_dim = int(fmap.get("input_dim", feature_dim))
    else:
        known = {
            "l_max": None, "feature_dim": None, "num_heads": None, "num_key_value_heads": None,
            "head_dim": None, "feature_name": ("taylor_exp",), "eps": None, "scale_dim": None,
            "train_view": ("linear", "quadratic"), "mem_save": None, "attn_fp32": None,
            "use_act": (False,), "use_rotary_apply": (False,), "use_proj_g": (False,),
            "use_output_gating": (False,), "use_decay_proj": (False,), "initial_conv": (False,),
            "fa_rotary": None, "rope_theta": None, "expand_rotary": None, "init_weights": None,
            "linear_attn_init": None, "use_decay_proj_init_1": None, "use_exp_combo": None,
            "use_positive": None, "c0": None, "c1": None, "c2": None, "feature_expanded_dim": None,
        }  # fmt: skip
        _check_kwargs(kwargs, known, source, target)
        kv_heads = int(kwargs.get("num_key_value_heads", 16))
        if kv_heads != num_heads:
            raise ArSliceError(
                f"{source}: {target} with num_key_value_heads {kv_heads} != num_heads "
                f"{num_heads} (grouped heads) is not implemented"
            )
        if cfg.get("fixed_decay"):
            raise ArSliceError(
                f"{source}: fixed_decay with {target} is not implemented (upstream applies the "
                "decay in its quadratic view and refuses it in its linear one)"
            )
        scale_dim = int(kwargs.get("scale_dim") or feature_dim)
        head_dim = kwargs.get("head_dim")
        eps = float(kwargs.get("eps", 1e-12))
    return (
        "linear_attention",
        {
            "feature_dim": feature_dim,
            "num_heads": num_heads,
            "head_dim": None if head_dim is None else int(head_dim),
            "scale_dim": scale_dim,
            "eps": eps,
        },
        False,
    )


def fla_scale_dim(feature_dim: int, cfg: dict, source: str) -> int:
    """The d of phi's scaling (q.k / sqrt(d)) that upstream's `parallel_based(q, k, v, True,
    True)` / `fused_chunk_based(...)` computes under the config's `fla_version` (see FLA_VERSIONS):
    the 2024 API reads the 4th argument as `use_scale` (scale `feature_dim ** -0.5`), 0.1 as
    `scale`, so `True` multiplies by 1."""
    version = str(cfg.get("fla_version", DEFAULT_FLA_VERSION))
    if version not in FLA_VERSIONS:
        raise ArSliceError(
            f"{source}: fla_version {version!r} is not implemented; implemented: "
            + "; ".join(f"{v!r} ({what})" for v, what in FLA_VERSIONS.items())
        )
    return feature_dim if version == "2024" else 1


def attention_kwargs(cfg: dict, source: str) -> dict:
    """The MHA kwargs every attention layer takes from the config (upstream's create_mha_cls and
    sliding_window_additions read the same keys)."""
    d_model, n_head = int(cfg["n_embd"]), int(cfg["n_head"])
    if d_model % n_head:
        raise ArSliceError(f"{source}: n_embd {d_model} is not divisible by n_head {n_head}")
    head_dim = d_model // n_head
    if cfg.get("head_dim") not in (None, head_dim):
        raise ArSliceError(
            f"{source}: head_dim {cfg['head_dim']} != n_embd / n_head is not implemented"
        )
    if cfg.get("n_head_kv") not in (None, n_head):
        raise ArSliceError(
            f"{source}: n_head_kv {cfg['n_head_kv']} != n_head {n_head} (grouped-query attention) "
            "is not implemented"
        )
    return {
        "num_heads": n_head,
        "bias": bool(cfg.get("qkv_proj_bias", True)),
        "out_proj_bias": bool(cfg.get("out_proj_bias", True)),
        "rotary_emb_dim": int(float(cfg.get("rotary_emb_fraction", 0.0)) * head_dim),
        "rotary_emb_base": float(cfg.get("rotary_emb_base", 10000.0)),
        "softmax_scale": None if cfg.get("scale_attn_weights", True) else 1.0,
    }


def sliding_mixer(spec: dict, target: str, cfg: dict, source: str) -> tuple[str, dict, bool]:
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    # the config's attention settings override these (upstream's sliding_window_additions)
    known = dict.fromkeys(
        ("num_heads", "num_heads_kv", "qkv_proj_bias", "out_proj_bias", "dropout",
         "softmax_scale", "layer_idx", "rotary_emb_dim", "rotary_emb_base",
         "rotary_emb_scale_base", "rotary_emb_interleaved", "fused_bias_fc", "use_flash_attn",
         "checkpointing", "l_max", "do_update", "batch_size", "device", "dtype"),
    )  # fmt: skip
    known |= {"window_size": None, "causal": (True,), "cross_attn": (False,)}
    known |= {"return_residual": (False,), "dwconv": (False,)}
    # prefix-linear-attention's copy: masks keys only when a padding mask is passed, never here
    known |= {"use_mask": None}
    _check_kwargs(kwargs, known, source, target)
    window_size = kwargs.get("window_size", 128)
    if window_size is None:
        raise ArSliceError(f"{source}: {target} needs a window_size (upstream asserts one)")
    # flash-attn's window (window_size // 2, 0): the current token and window_size // 2 before it
    return (
        "sliding_attention",
        {**attention_kwargs(cfg, source), "window": int(window_size) // 2},
        False,
    )


def prefix_mixer(spec: dict, target: str, cfg: dict, source: str) -> tuple[str, dict, bool]:
    """(mixer name, kwargs, False) for JRT's PrefixLinearAttention. Its "default" and
    "fla_parallel" implementations compute the same function (fla_parallel's `parallel_based(q, k,
    v, use_scale=True, ...)` exists in the 2024 API only, whose scale is TaylorExp's); `use_mask`
    acts only on a padding mask, which scoring never passes; `dec_length` is not read."""
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    known = {
        "l_max": None, "feature_dim": None, "num_heads": None, "num_key_value_heads": None,
        "feature_name": ("taylor_exp",), "eps": None, "scale_dim": None, "enc_length": None,
        "dec_length": None, "implementation": ("default", "fla_parallel"), "use_mask": None,
    }  # fmt: skip
    _check_kwargs(kwargs, known, source, target)
    num_heads = int(kwargs.get("num_heads", cfg["n_head"]))
    if int(kwargs.get("num_key_value_heads", num_heads)) != num_heads:
        raise ArSliceError(
            f"{source}: {target} with num_key_value_heads != num_heads is not implemented"
        )
    enc_length = kwargs.get("enc_length", cfg.get("enc_length"))
    if not isinstance(enc_length, int) or enc_length < 1:
        raise ArSliceError(f"{source}: {target} needs a positive enc_length (got {enc_length!r})")
    scale_dim = kwargs.get("scale_dim")
    return (
        "prefix_linear_attention",
        {
            "enc_length": enc_length, "feature_dim": int(kwargs.get("feature_dim", 16)),
            "num_heads": num_heads, "eps": float(kwargs.get("eps", 1e-12)),
            "scale_dim": None if scale_dim is None else int(scale_dim),
        },
        False,
    )  # fmt: skip


def mixer_for(spec, cfg: dict, source: str, where: str) -> tuple[str, dict, bool]:
    """(our sequence mixer, its kwargs, whether `conv1.` keys become `conv.`) for one spec."""
    if spec is None:
        return "attention", attention_kwargs(cfg, source), False
    target = _short_target(spec, where, source)
    if target in CONV_TARGETS:
        return conv_mixer(spec, target, source)
    if target in LINEAR_TARGETS:
        return linear_mixer(spec, target, cfg, source)
    if target in SLIDING_TARGETS:
        return sliding_mixer(spec, target, cfg, source)
    if target in PREFIX_TARGETS:
        return prefix_mixer(spec, target, cfg, source)
    implemented = CONV_TARGETS + LINEAR_TARGETS + SLIDING_TARGETS + PREFIX_TARGETS
    raise ArSliceError(
        f"{source}: {where} {spec['_target_']!r} is not implemented; implemented: "
        f"{', '.join(implemented)} (and no spec: attention)"
    )


def normalized_config(raw: dict, source: str) -> dict:
    """The published config with GPT2Config's defaults and attribute aliases applied."""
    cfg = dict(raw)
    for alias, name in GPT2_ALIASES.items():
        if alias in cfg and name not in cfg:
            cfg[name] = cfg[alias]
    # GPT2Config maps max_position_embeddings onto n_positions, so a given one wins
    if "max_position_embeddings" in cfg:
        cfg["n_positions"] = cfg["max_position_embeddings"]
    for key, value in GPT2_DEFAULTS.items():
        cfg.setdefault(key, value)
    for key, expected in UNSUPPORTED_GLOBAL.items():
        if key in cfg and cfg[key] != expected:
            raise ArSliceError(
                f"{source}: {key}={cfg[key]!r} is not implemented (only {expected!r})"
            )
    if cfg["activation_function"] != "swiglu":
        raise ArSliceError(
            f"{source}: activation_function {cfg['activation_function']!r} is not implemented; "
            "only 'swiglu' (the MLP of Based and Transformer++)"
        )
    return cfg


def is_based_config(cfg: dict) -> bool:
    """upstream's GPT2Config-style dict: GPT-2's keys and no transformers `model_type` (the
    suite's Mamba, whose config carries `n_embd` too, is mamba_ssm's layout: mamba_ssm.py)."""
    from models.checkpoints.mamba_ssm import is_mamba_ssm_config

    if not isinstance(cfg, dict) or "model_type" in cfg or is_mamba_ssm_config(cfg):
        return False
    return "n_embd" in cfg or "mixer" in cfg or "alt_mixer" in cfg


def model_config_from_based(raw: dict, state: dict, source: str):
    """(this project's ModelConfig, the layers whose convolution keys are `conv1.` upstream) for
    a published config; the MLP width is read from the weights, as upstream's rounding of
    `n_inner` differs between its versions."""
    from models.backbone import ModelConfig

    cfg = normalized_config(raw, source)
    n_layers = int(cfg["n_layer"])
    default = mixer_for(cfg.get("mixer"), cfg, source, "mixer")
    alt = [
        ("alt_mixer_2", set(cfg.get("alt_mixer_2_layers") or ())),
        ("alt_mixer", set(cfg.get("alt_mixer_layers") or ())),
    ]
    layer_mixers, conv1_layers = [], []
    for i in range(n_layers):
        # upstream's create_mixer_cls: alt_mixer_2 first, then alt_mixer; a missing spec is MHA
        tag = next((t for t, layers in alt if i in layers), "mixer")
        name, kwargs, conv1 = (
            default if tag == "mixer" else mixer_for(cfg.get(tag), cfg, source, tag)
        )
        if conv1:
            conv1_layers.append(i)
        if (name, kwargs) == default[:2]:
            continue
        same = next((m for m in layer_mixers if (m["name"], m["kwargs"]) == (name, kwargs)), None)
        if same:
            same["layers"].append(i)
        else:
            layer_mixers.append({"layers": [i], "name": name, "kwargs": kwargs})
    fc2 = state.get("transformer.layers.0.mlp.fc2.weight")
    if fc2 is None:
        raise ArSliceError(f"{source}: the weights have no transformer.layers.0.mlp.fc2.weight")
    l_max = next(
        (int(s["l_max"]) for s in (cfg.get(k) for k in ("mixer", "alt_mixer", "alt_mixer_2"))
         if isinstance(s, dict) and s.get("l_max")),
        int(cfg["n_positions"]) or 2048,
    )  # fmt: skip
    try:
        config = ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=int(cfg["n_embd"]),
            n_layers=n_layers,
            sequence_mixer=default[0],
            sequence_mixer_kwargs=default[1],
            state_mixer="swiglu",
            state_mixer_kwargs={
                "hidden": int(fc2.shape[1]),
                "fc1_bias": bool(cfg.get("mlp_fc1_bias", True)),
                "fc2_bias": bool(cfg.get("mlp_fc2_bias", True)),
            },
            l_max=l_max,
            max_position_embeddings=int(cfg["n_positions"]),
            layer_norm_epsilon=float(cfg["layer_norm_epsilon"]),
            pad_vocab_size_multiple=int(cfg.get("pad_vocab_size_multiple", 1)),
            norm="rmsnorm" if cfg.get("rms_norm") else "layernorm",
            residual_in_fp32=bool(cfg.get("residual_in_fp32", False)),
            layer_mixers=layer_mixers,
        )
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: invalid model config ({e})") from None
    return config, conv1_layers


def clean_state(state: dict) -> dict:
    """As upstream's from_pretrained_hf: drop training-metric entries, strip a `model.` prefix."""
    state = {k: v for k, v in state.items() if "metrics" not in k}
    return {re.sub(r"^model\.", "", k): v for k, v in state.items()}


def convert_based_state(
    state: dict, conv1_layers: list[int], raw: dict, source: str
) -> tuple[dict, dict]:
    """Published key names -> models.backbone's, checking what is dropped on the way; also
    returns the stored rotary frequencies (checked against the model's by `_check_inv_freq`)."""
    import torch

    if "transformer.ln_0.weight" in state:
        raise ArSliceError(f"{source}: the post-norm layout (transformer.ln_0) is not implemented")
    out = {}
    for key, value in state.items():
        if key == "transformer.decay.decay":
            # built by fixed_decay; upstream's current mixers take it and never read it
            continue
        if key.endswith(".rotary_emb.inv_freq"):
            continue  # checked below against the model's own
        if key == "lm_head.weight":
            emb = state.get("transformer.embeddings.word_embeddings.weight")
            if emb is None or emb.shape != value.shape or not torch.equal(emb, value):
                raise ArSliceError(
                    f"{source}: lm_head.weight differs from the word embeddings; an untied head "
                    "is not implemented"
                )
            continue
        key = re.sub(r"^transformer\.", "backbone.", key)
        key = re.sub(r"^(backbone\.layers\.\d+)\.mixer\.", r"\1.sequence_mixer.", key)
        key = re.sub(r"^(backbone\.layers\.\d+)\.mlp\.", r"\1.state_mixer.", key)
        m = re.match(r"^backbone\.layers\.(\d+)\.sequence_mixer\.conv1\.", key)
        if m and int(m.group(1)) in conv1_layers:
            key = key.replace(".sequence_mixer.conv1.", ".sequence_mixer.conv.", 1)
        out[key] = value
    if "transformer.decay.decay" in state and not raw.get("fixed_decay"):
        raise ArSliceError(f"{source}: transformer.decay.decay without fixed_decay in the config")
    return out, {k: v for k, v in state.items() if k.endswith(".rotary_emb.inv_freq")}


def _check_inv_freq(model, stored: dict, source: str) -> None:
    """Stored rotary frequencies (older flash-attn saved them) must be the ones recomputed here."""
    import torch

    buffers = dict(model.named_buffers())
    for key, value in stored.items():
        ours = re.sub(r"^transformer\.", "backbone.", key)
        ours = re.sub(r"\.mixer\.", ".sequence_mixer.", ours)
        if ours not in buffers:
            raise ArSliceError(f"{source}: {key} belongs to no rotary layer of this config")
        if not torch.allclose(value.float(), buffers[ours].float(), rtol=1e-6, atol=0):
            raise ArSliceError(f"{source}: {key} differs from base^(-2i/dim); not implemented")


def resolve_files(target: str, spec: str, revision: str | None = None) -> tuple[Path, Path]:
    """(config.json, weights file) of a local directory or, when none exists, a hub repo id (at
    `revision`, a commit load_model resolved)."""
    path = Path(target).expanduser()
    if path.is_dir():
        folder = path
    elif path.exists():
        raise ArSliceError(f"{spec}: {path} is not a directory (expected config.json + weights)")
    elif target.startswith((".", "/", "~")) or target.count("/") != 1:
        raise ArSliceError(f"{spec}: no such directory {path}, and not a hub id (owner/name)")
    else:
        folder = _download(target, spec, revision)
    config = folder / CONFIG_NAME
    if not config.is_file():
        raise ArSliceError(f"{spec}: {config} not found")
    weights = [folder / n for n in WEIGHT_NAMES if (folder / n).is_file()]
    if not weights:
        raise ArSliceError(f"{spec}: no {' or '.join(WEIGHT_NAMES)} in {folder}")
    return config, weights[0]


def _download(repo_id: str, spec: str, revision: str | None) -> Path:
    from ar_slicing.machinery import hub

    patterns = [CONFIG_NAME, *WEIGHT_NAMES, "*.json"]
    instead = "a local directory holding its config.json and pytorch_model.bin"
    return hub.fetch(repo_id, revision, patterns, spec, instead)


def load_based(
    target: str, spec: str, model_config: str | None = None, revision: str | None = None
):
    """(LanguageModel with the checkpoint's weights, directory to look for a tokenizer in).
    `model_config`: a config.json to read instead of the published one (e.g. with `fla_version`)."""
    from ar_slicing.machinery.io import read_json
    from models.backbone import LanguageModel
    from models.checkpoints.io import load_state_dict_checked, read_checkpoint, state_dict_from
    from models.checkpoints.mamba_ssm import is_mamba_ssm_config

    config_file, weights_file = resolve_files(target, spec, revision)
    if model_config is not None:
        config_file = Path(model_config)
        if not config_file.is_file():
            raise ArSliceError(f"{spec}: --model-config {config_file}: no such file")
    raw = read_json(config_file)
    if not isinstance(raw, dict):
        raise ArSliceError(f"{config_file}: expected a JSON object")
    if is_mamba_ssm_config(raw):  # load_spec reads these with hf:'s loader
        raise ArSliceError(
            f"{config_file}: a mamba_ssm (Mamba) config, not Based or Transformer++; load it "
            "with models.load_model (hf: or based:)"
        )
    state = clean_state(state_dict_from(read_checkpoint(weights_file), weights_file))
    source = str(config_file)
    config, conv1_layers = model_config_from_based(raw, state, source)
    try:
        model = LanguageModel(config)
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: cannot build the model ({e})") from None
    converted, inv_freq = convert_based_state(state, conv1_layers, raw, str(weights_file))
    _check_inv_freq(model, inv_freq, str(weights_file))
    load_state_dict_checked(model, converted, source=str(weights_file), tied=("lm_head.weight",))
    log.info("%s: %s, %d layers", spec, describe(config), config.n_layers)
    return model.eval(), weights_file.parent


def describe(config) -> str:
    """ "based (based_conv + linear_attention + sliding_attention)" or "attention"."""
    names = sorted({config.sequence_mixer} | {m["name"] for m in config.layer_mixers})
    return "attention" if names == ["attention"] else f"based ({' + '.join(names)})"


def architecture_of(config: Any) -> str:
    """The architecture a based: model records: "attention" for Transformer++, "jrt" for JRT-RNN
    (prefix linear attention), else "based"."""
    if any(m["name"] == "prefix_linear_attention" for m in config.layer_mixers):
        return "jrt"
    return "attention" if describe(config) == "attention" else "based"


@register_loader("based", order=4, hub=True, model_config=True)
def load_spec(request: LoadRequest) -> LoadedModel:
    from models.checkpoints.mamba_ssm import is_mamba_ssm_config, read_config_json

    # the suite's Mamba (hazyresearch/mamba-1.3b) is published in mamba_ssm's layout: read as
    # the hf: format reads it (found by its prefix: hf.py imports this module for is_based_config)
    if is_mamba_ssm_config(read_config_json(request.target, not request.is_hub, request.commit)):
        return checkpoint_format("hf").load(request)
    model, tokenizer_dir = load_based(
        request.target, request.spec, request.model_config, request.commit
    )
    return loaded_language_model(
        model, request, tokenizer_dir, architecture=architecture_of(model.config)
    )
