"""Mamba-1 checkpoints in their two published layouts, mapped onto models/mixers/mamba.py's
`MambaLM`.

* transformers (`MambaForCausalLM`, `state-spaces/mamba-*-hf`): `mamba_from_transformers` copies a
  loaded model's weights (`backbone.embeddings` is our `backbone.embedding`; every other name is
  the same).
* mamba_ssm (`state-spaces/mamba-*`, `hazyresearch/mamba-1.3b`): `config.json` with `d_model`,
  `n_layer`, `vocab_size`, `pad_vocab_size_multiple`, `ssm_cfg`, ... as mamba_ssm's
  `MambaConfig` (`mamba_ssm/models/config_mamba.py`) writes it, and `pytorch_model.bin` (or
  `model.safetensors`) with `backbone.layers.N.mixer.*` keys: `read_mamba_ssm_config` and
  `load_mamba_ssm`. `hf:` recognises it by its config (no `model_type`, `d_model` and `n_layer`).

mamba_ssm settings that do not change the function are accepted (`fused_add_norm`: a fused
kernel for the same add + norm; `use_fast_path`: the CUDA kernel; the `dt_*` initialisation
ranges; the attention-model fields HazyResearch's `based` repo adds to the same config, which its
Mamba LM never reads); any other setting the model does not implement is refused by name.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

# mamba_ssm `MambaConfig` fields and their defaults (mamba_ssm/models/config_mamba.py)
_MAMBA_SSM_DEFAULTS = {
    "d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277, "ssm_cfg": {},
    "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
    "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True,
}  # fmt: skip
# fields HazyResearch/based `based/models/mamba.py` adds to its MambaConfig; its Mamba LM never
# reads them (attention-model settings shared with its GPT config) or only picks a kernel
_BASED_UNUSED = {
    "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx", "n_positions", "n_embd",
    "n_head", "use_flash_attn", "fused_dropout_add_ln", "fused_mlp", "fused_bias_fc",
    "use_fast_path",
}  # fmt: skip
# hub bookkeeping, not model settings
_METADATA = {"architectures", "transformers_version", "torch_dtype", "dtype"}
# `Mamba(...)` keyword arguments in ssm_cfg (mamba_ssm/modules/mamba_simple.py) that we read
_SSM_READ = {"d_state": 16, "d_conv": 4, "expand": 2, "dt_rank": "auto", "conv_bias": True,
             "bias": False}  # fmt: skip
# ...and those that only initialise weights or choose a kernel: the same function either way
_SSM_NO_EFFECT = {"dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"}
# `Mamba2(...)` keyword arguments (mamba_ssm/modules/mamba2.py) that we read, with its defaults
_MAMBA2_READ = {
    "d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "d_ssm": None, "ngroups": 1,
    "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False,
    "dt_limit": (0.0, float("inf")), "bias": False, "conv_bias": True, "chunk_size": 256,
}  # fmt: skip
# ...initialisation ranges, the fused-kernel switch and tensor-parallel settings: no effect here
_MAMBA2_NO_EFFECT = {
    "conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path",
    "sequence_parallel",
}  # fmt: skip
# `MHA(...)` keyword arguments (mamba_ssm/modules/mha.py) that we read, with its defaults
_MHA_READ = {
    "num_heads": None, "num_heads_kv": None, "head_dim": None, "mlp_dim": 0,
    "qkv_proj_bias": True, "out_proj_bias": True, "softmax_scale": None, "causal": False,
    "d_conv": 0, "rotary_emb_dim": 0, "rotary_emb_base": 10000.0, "rotary_emb_interleaved": False,
}  # fmt: skip
_MHA_NO_EFFECT: set[str] = set()
# torchmetrics states a Lightning checkpoint keeps next to the model (HazyResearch's training code)
_METRIC_KEYS = re.compile(r"^(train|val|test)_metrics\.")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_mamba_ssm_config(raw) -> bool:
    """A mamba_ssm `config.json`: no transformers `model_type`, and `d_model` and `n_layer`."""
    return isinstance(raw, dict) and "model_type" not in raw and {"d_model", "n_layer"} <= set(raw)


def read_mamba_ssm_config(raw: dict, source: str, chunk_size: int = 16):
    """mamba_ssm's config dict -> `MambaLMConfig` (Mamba-1 alone) or `MixerModelConfig` (Mamba-2,
    attention layers, a gated MLP); refuses what neither implements, by name."""
    from models.mixers.mamba import MambaLMConfig

    unknown = sorted(
        k for k in raw
        if k not in _MAMBA_SSM_DEFAULTS and k not in _BASED_UNUSED and k not in _METADATA
        and not k.startswith("_")
    )  # fmt: skip
    if unknown:
        raise _refuse(source, f"config key(s) {', '.join(unknown)}")
    cfg = {**_MAMBA_SSM_DEFAULTS, **raw}
    ssm = dict(cfg["ssm_cfg"] or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise _refuse(source, f"ssm_cfg.layer = {layer!r} (only Mamba1 and Mamba2 are read)")
    vocab, multiple = int(cfg["vocab_size"]), int(cfg["pad_vocab_size_multiple"])
    if vocab % multiple:  # mamba_ssm's MambaLMHeadModel pads the embedding to a multiple
        vocab += multiple - vocab % multiple
    n_layer, attn_layers = int(cfg["n_layer"]), cfg["attn_layer_idx"] or []
    if not isinstance(attn_layers, list) or any(
        not isinstance(i, int) or not 0 <= i < n_layer for i in attn_layers
    ):
        raise ArSliceError(
            f"{source}: attn_layer_idx {attn_layers!r} must list layers 0..{n_layer - 1}"
        )
    if layer == "Mamba1":
        ssm = _mamba1_options(ssm, source, chunk_size)
        if not attn_layers and not cfg["d_intermediate"]:
            return MambaLMConfig(
                d_model=int(cfg["d_model"]), n_layer=n_layer, vocab_size=vocab,
                d_state=ssm["d_state"], d_conv=ssm["d_conv"], expand=ssm["expand"],
                dt_rank=ssm["dt_rank"], conv_bias=ssm["conv_bias"], bias=ssm["bias"],
                rms_norm=bool(cfg["rms_norm"]), residual_in_fp32=bool(cfg["residual_in_fp32"]),
                tie_embeddings=bool(cfg["tie_embeddings"]), chunk_size=chunk_size,
            )  # fmt: skip
    else:
        ssm = _mamba2_options(ssm, source)
    from models.mixer_model import MixerModelConfig

    return MixerModelConfig(
        d_model=int(cfg["d_model"]), n_layer=n_layer, vocab_size=vocab, ssm_layer=layer,
        ssm_cfg=ssm, attn_layer_idx=sorted(set(attn_layers)),
        attn_cfg=_attention_options(cfg["attn_cfg"] or {}, source) if attn_layers else {},
        d_intermediate=int(cfg["d_intermediate"]), rms_norm=bool(cfg["rms_norm"]),
        residual_in_fp32=bool(cfg["residual_in_fp32"]),
        tie_embeddings=bool(cfg["tie_embeddings"]),
    )  # fmt: skip


def _refuse(source: str, what: str) -> ArSliceError:
    return ArSliceError(f"{source}: {what} is not implemented by this project's mamba_ssm reader")


def _known_keys(options: dict, read: dict, no_effect: set, source: str, where: str) -> dict:
    """`read`'s defaults updated by `options`; keys outside `read` and `no_effect` refused."""
    unknown = sorted(k for k in options if k not in read and k not in no_effect)
    if unknown:
        raise _refuse(source, f"{where} key(s) {', '.join(unknown)}")
    return {**read, **{k: v for k, v in options.items() if k in read}}


def _mamba1_options(ssm: dict, source: str, chunk_size: int) -> dict:
    """ssm_cfg of a Mamba1 layer -> models/mixers/mamba.py's MambaMixerOptions."""
    ssm = _known_keys(ssm, _SSM_READ, _SSM_NO_EFFECT, source, "ssm_cfg")
    return {
        "d_state": int(ssm["d_state"]), "d_conv": int(ssm["d_conv"]),
        "expand": int(ssm["expand"]),
        "dt_rank": None if ssm["dt_rank"] == "auto" else int(ssm["dt_rank"]),
        "conv_bias": bool(ssm["conv_bias"]), "bias": bool(ssm["bias"]), "chunk_size": chunk_size,
    }  # fmt: skip


def _mamba2_options(ssm: dict, source: str) -> dict:
    """ssm_cfg of a Mamba2 layer -> models/mixers/mamba2.py's Mamba2Options."""
    from models.mixers.mamba2 import LOADED_CHUNK_SIZE

    ssm = _known_keys(ssm, _MAMBA2_READ, _MAMBA2_NO_EFFECT, source, "ssm_cfg (Mamba2)")
    limit = ssm["dt_limit"]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ArSliceError(f"{source}: ssm_cfg.dt_limit {limit!r} must be [low, high]")
    return {
        "d_state": int(ssm["d_state"]), "d_conv": int(ssm["d_conv"]),
        "expand": int(ssm["expand"]), "headdim": int(ssm["headdim"]),
        "d_ssm": None if ssm["d_ssm"] is None else int(ssm["d_ssm"]),
        "ngroups": int(ssm["ngroups"]), "D_has_hdim": bool(ssm["D_has_hdim"]),
        "rmsnorm": bool(ssm["rmsnorm"]), "norm_before_gate": bool(ssm["norm_before_gate"]),
        "dt_limit": (float(limit[0]), float(limit[1])), "bias": bool(ssm["bias"]),
        # the scan's chunk changes nothing but rounding (models/mixers/mamba2.py)
        "conv_bias": bool(ssm["conv_bias"]), "chunk_size": LOADED_CHUNK_SIZE,
    }  # fmt: skip


def _attention_options(attn: dict, source: str) -> dict:
    """attn_cfg -> models/mixers/mamba_mha.py's MambaMHAOptions. Upstream's MHA is bidirectional
    unless `causal` is set: such a layer reads the tokens it is asked to predict, so it is
    refused rather than scored."""
    attn = _known_keys(attn, _MHA_READ, _MHA_NO_EFFECT, source, "attn_cfg")
    if "num_heads" not in attn or attn["num_heads"] is None:
        raise ArSliceError(f"{source}: attn_cfg needs num_heads (mamba_ssm's MHA requires it)")
    if not attn["causal"]:
        raise _refuse(
            source, "attn_cfg.causal = false (bidirectional attention sees the tokens it predicts)"
        )
    return {
        "num_heads": int(attn["num_heads"]),
        "num_heads_kv": None if attn["num_heads_kv"] is None else int(attn["num_heads_kv"]),
        "head_dim": None if attn["head_dim"] is None else int(attn["head_dim"]),
        "mlp_dim": int(attn["mlp_dim"]), "qkv_proj_bias": bool(attn["qkv_proj_bias"]),
        "out_proj_bias": bool(attn["out_proj_bias"]),
        "softmax_scale": None if attn["softmax_scale"] is None else float(attn["softmax_scale"]),
        "causal": True, "d_conv": int(attn["d_conv"]),
        "rotary_emb_dim": int(attn["rotary_emb_dim"]),
        "rotary_emb_base": float(attn["rotary_emb_base"]),
        "rotary_emb_interleaved": bool(attn["rotary_emb_interleaved"]),
    }  # fmt: skip


def mamba_ssm_state_dict(state: dict) -> dict:
    """A mamba_ssm state dict as `MambaLM` names it: Lightning's metric states dropped (counted),
    a shared `model.` prefix stripped."""
    from models.checkpoints.io import strip_key_prefixes

    metrics = [k for k in state if _METRIC_KEYS.match(k)]
    if metrics:
        log.info("dropped %d training-metric entries (%s, ...)", len(metrics), metrics[0])
    return strip_key_prefixes({k: v for k, v in state.items() if not _METRIC_KEYS.match(k)})


def _find_file(target: str, local: bool, names, revision: str | None = None) -> str | None:
    """The first of `names` in a local directory, or downloaded from the hub repo `target` (at
    `revision`, a commit load_model resolved)."""
    for name in names:
        if local:
            if (Path(target) / name).is_file():
                return str(Path(target) / name)
            continue
        try:
            from huggingface_hub import hf_hub_download

            from ar_slicing.machinery import hub

            return hf_hub_download(target, name, revision=revision, **hub.files_only())
        except Exception as e:  # not in the repo, or the hub unreachable: try the next name
            log.debug("hf:%s: no %s (%s)", target, name, e)
    return None


def load_mamba_ssm(
    target: str,
    raw: dict,
    spec: str,
    local: bool,
    as_transformers: bool = False,
    revision: str | None = None,
):
    """The checkpoint of a mamba_ssm directory or hub repo (config dict `raw` already read).

    Returns `MambaLM` (Mamba-1) or `MixerLM` (Mamba-2, attention, gated MLP) in eval mode, or
    with `as_transformers` the same weights in transformers' `MambaForCausalLM` /
    `Mamba2ForCausalLM` (their own forward: `--no-fast-path`)."""
    from models.checkpoints.io import load_state_dict_checked, read_weights
    from models.mixer_model import MixerLM, MixerModelConfig
    from models.mixers.mamba import MambaLM

    cfg = read_mamba_ssm_config(raw, spec)
    path = _find_file(target, local, WEIGHT_FILES, revision)
    if path is None:
        raise ArSliceError(f"{spec}: no {' or '.join(WEIGHT_FILES)} beside the mamba_ssm config")
    state = mamba_ssm_state_dict(read_weights(path))
    tied = ("lm_head.weight",) if cfg.tie_embeddings else ()
    source = f"{spec} ({Path(path).name})"
    if as_transformers and isinstance(cfg, MixerModelConfig):
        chunk = int((raw.get("ssm_cfg") or {}).get("chunk_size", _MAMBA2_READ["chunk_size"]))
        return _transformers_mamba2(cfg, state, source, tied, chunk)
    if as_transformers:
        return _transformers_mamba(cfg, state, source, tied)
    model = MixerLM(cfg) if isinstance(cfg, MixerModelConfig) else MambaLM(cfg)
    load_state_dict_checked(model, state, source=source, tied=tied)
    return model.eval()


def architecture_of(cfg) -> str:
    """What a mamba_ssm model records as its architecture: "mamba" (Mamba-1), "mamba2",
    "attention" (every layer attention: Transformer++), or "<ssm layer>-hybrid"."""
    from models.mixer_model import MixerModelConfig

    if not isinstance(cfg, MixerModelConfig):
        return "mamba"
    if len(cfg.attn_layer_idx) == cfg.n_layer:
        return "attention"
    name = "mamba" if cfg.ssm_layer == "Mamba1" else "mamba2"
    return f"{name}-hybrid" if cfg.attn_layer_idx else name


def _transformers_mamba(cfg, state: dict, source: str, tied):
    """transformers' `MambaForCausalLM` holding a mamba_ssm checkpoint (RMSNorm models only:
    transformers' Mamba has no LayerNorm option)."""
    import transformers

    from models.checkpoints.io import load_state_dict_checked

    if not cfg.rms_norm:
        raise ArSliceError(
            f"{source}: rms_norm = false (LayerNorm) has no transformers MambaForCausalLM; "
            "evaluate it with the fast path"
        )
    hf_cfg = transformers.MambaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
        num_hidden_layers=cfg.n_layer, layer_norm_epsilon=cfg.norm_epsilon, expand=cfg.expand,
        conv_kernel=cfg.d_conv, use_bias=cfg.bias, use_conv_bias=cfg.conv_bias,
        time_step_rank=cfg.dt_rank or "auto", residual_in_fp32=cfg.residual_in_fp32,
        tie_word_embeddings=cfg.tie_embeddings,
    )  # fmt: skip
    model = transformers.MambaForCausalLM(hf_cfg)
    renamed = {
        re.sub(r"^backbone\.embedding\.", "backbone.embeddings.", k): v for k, v in state.items()
    }
    load_state_dict_checked(model, renamed, source=source, tied=tied)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    return model.eval()


def _transformers_mamba2(cfg, state: dict, source: str, tied, chunk_size: int):
    """transformers' `Mamba2ForCausalLM` holding a mamba_ssm Mamba-2 checkpoint: only the
    settings transformers' Mamba-2 has (no attention, no MLP, RMSNorm, the gated norm after
    the gate, D per head, d_ssm = d_inner)."""
    import transformers

    from models.checkpoints.io import load_state_dict_checked

    ssm = cfg.ssm_cfg
    others = {
        "attn_layer_idx": cfg.attn_layer_idx, "d_intermediate": cfg.d_intermediate,
        "rms_norm": not cfg.rms_norm, "ssm_cfg.layer": cfg.ssm_layer != "Mamba2",
        "ssm_cfg.d_ssm": ssm.get("d_ssm") not in (None, cfg.d_model * ssm.get("expand", 2)),
        "ssm_cfg.D_has_hdim": ssm.get("D_has_hdim"), "ssm_cfg.rmsnorm": not ssm.get("rmsnorm"),
        "ssm_cfg.norm_before_gate": ssm.get("norm_before_gate"),
    }  # fmt: skip
    differs = [k for k, v in others.items() if v]
    if differs:
        raise ArSliceError(
            f"{source}: transformers' Mamba2ForCausalLM has no {', '.join(differs)} of this "
            "checkpoint; evaluate it with the fast path"
        )
    d_inner = ssm["expand"] * cfg.d_model
    hf_cfg = transformers.Mamba2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        state_size=ssm["d_state"], num_heads=d_inner // ssm["headdim"], head_dim=ssm["headdim"],
        n_groups=ssm["ngroups"], expand=ssm["expand"], conv_kernel=ssm["d_conv"],
        use_bias=ssm["bias"], use_conv_bias=ssm["conv_bias"], chunk_size=chunk_size,
        time_step_limit=tuple(ssm["dt_limit"]), layer_norm_epsilon=cfg.norm_epsilon,
        residual_in_fp32=cfg.residual_in_fp32, tie_word_embeddings=cfg.tie_embeddings,
    )  # fmt: skip
    model = transformers.Mamba2ForCausalLM(hf_cfg)
    renamed = {
        re.sub(r"^backbone\.embedding\.", "backbone.embeddings.", k): v for k, v in state.items()
    }
    load_state_dict_checked(model, renamed, source=source, tied=tied)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    return model.eval()


def mamba2_from_transformers(hf_model, chunk_size: int | None = None):
    """`MixerLM` of Mamba-2 layers with the weights of a loaded transformers `Mamba2ForCausalLM`
    (its gated norm's epsilon is its layer_norm_epsilon, normalised after the gate)."""
    from models.checkpoints.io import load_state_dict_checked
    from models.mixer_model import MixerLM, MixerModelConfig
    from models.mixers.mamba2 import LOADED_CHUNK_SIZE

    config = hf_model.config
    source = f"transformers {type(hf_model).__name__}"
    if config.hidden_act not in ("silu", "swish"):
        raise ArSliceError(
            f"{source}: hidden_act = {config.hidden_act!r} is not implemented by this project's "
            "Mamba-2 (mamba_ssm's is silu); pass --no-fast-path to run transformers' own forward"
        )
    head = hf_model.get_output_embeddings().weight
    tied = head is hf_model.get_input_embeddings().weight
    ssm = {
        "d_state": config.state_size, "d_conv": config.conv_kernel, "expand": config.expand,
        "headdim": config.head_dim, "ngroups": config.n_groups, "bias": config.use_bias,
        "conv_bias": config.use_conv_bias, "chunk_size": chunk_size or LOADED_CHUNK_SIZE,
        "dt_limit": tuple(float(v) for v in config.time_step_limit),
        "norm_eps": config.layer_norm_epsilon, "norm_before_gate": False,
    }  # fmt: skip
    cfg = MixerModelConfig(
        d_model=config.hidden_size, n_layer=config.num_hidden_layers,
        vocab_size=int(head.shape[0]), ssm_layer="Mamba2", ssm_cfg=ssm,
        norm_epsilon=config.layer_norm_epsilon, residual_in_fp32=config.residual_in_fp32,
        tie_embeddings=tied,
    )  # fmt: skip
    if config.num_heads * config.head_dim != config.expand * config.hidden_size:
        raise ArSliceError(f"{source}: num_heads * head_dim is not expand * hidden_size")
    state = {
        re.sub(r"^backbone\.embeddings\.", "backbone.embedding.", k): v
        for k, v in hf_model.state_dict().items()
    }
    fast = MixerLM(cfg)
    load_state_dict_checked(fast, state, source=source, tied=("lm_head.weight",) if tied else ())
    return fast.to(dtype=head.dtype).eval()


def mamba_from_transformers(hf_model, chunk_size: int = 16):
    """`MambaLM` with the weights of a loaded transformers `MambaForCausalLM`."""
    from models.checkpoints.io import load_state_dict_checked
    from models.mixers.mamba import MambaLM, MambaLMConfig

    config = hf_model.config
    source = f"transformers {type(hf_model).__name__}"
    if config.hidden_act not in ("silu", "swish"):
        raise ArSliceError(
            f"{source}: hidden_act = {config.hidden_act!r} is not implemented by this project's "
            "Mamba (mamba_ssm's is silu); pass --no-fast-path to run transformers' own forward"
        )
    head = hf_model.get_output_embeddings().weight
    tied = head is hf_model.get_input_embeddings().weight
    cfg = MambaLMConfig(
        d_model=config.hidden_size, n_layer=config.num_hidden_layers,
        vocab_size=int(head.shape[0]), d_state=config.state_size, d_conv=config.conv_kernel,
        expand=config.expand, dt_rank=int(config.time_step_rank), conv_bias=config.use_conv_bias,
        bias=config.use_bias, rms_norm=True, norm_epsilon=config.layer_norm_epsilon,
        residual_in_fp32=config.residual_in_fp32, tie_embeddings=tied, chunk_size=chunk_size,
    )  # fmt: skip
    if int(cfg.expand * cfg.d_model) != config.intermediate_size:
        raise ArSliceError(
            f"{source}: intermediate_size {config.intermediate_size} is not expand * hidden_size"
        )
    state = {
        re.sub(r"^backbone\.embeddings\.", "backbone.embedding.", k): v
        for k, v in hf_model.state_dict().items()
    }
    fast = MambaLM(cfg)
    load_state_dict_checked(fast, state, source=source, tied=("lm_head.weight",) if tied else ())
    return fast.to(dtype=head.dtype).eval()


def read_config_json(target: str, local: bool, revision: str | None = None) -> dict | None:
    """The raw `config.json` of a local directory or hub repo, or None when it cannot be read."""
    path = _find_file(target, local, ("config.json",), revision)
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
