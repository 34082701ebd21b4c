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
# torchmetrics states a Lightning checkpoint keeps next to the model (HazyResearch's training code)
_METRIC_KEYS = re.compile(r"^(train|val|test)_metrics\.")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_mamba_ssm_config(raw) -> bool:
    """A mamba_ssm `config.json`: no transformers `model_type`, and `d_model` and `n_layer`."""
    return isinstance(raw, dict) and "model_type" not in raw and {"d_model", "n_layer"} <= set(raw)


def read_mamba_ssm_config(raw: dict, source: str, chunk_size: int = 16):
    """mamba_ssm's config dict -> `MambaLMConfig`; refuses what `MambaLM` does not implement."""
    from models.mixers.mamba import MambaLMConfig

    def refuse(what: str) -> ArSliceError:
        return ArSliceError(f"{source}: {what} is not implemented by this project's Mamba")

    unknown = sorted(
        k for k in raw
        if k not in _MAMBA_SSM_DEFAULTS and k not in _BASED_UNUSED and k not in _METADATA
        and not k.startswith("_")
    )  # fmt: skip
    if unknown:
        raise refuse(f"config key(s) {', '.join(unknown)}")
    cfg = {**_MAMBA_SSM_DEFAULTS, **raw}
    if cfg["d_intermediate"]:
        raise refuse(f"d_intermediate = {cfg['d_intermediate']} (a GatedMLP after every mixer)")
    if cfg["attn_layer_idx"]:
        raise refuse(f"attn_layer_idx = {cfg['attn_layer_idx']} (attention layers)")
    ssm = dict(cfg["ssm_cfg"] or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer != "Mamba1":
        raise refuse(
            f"ssm_cfg.layer = {layer!r} (only Mamba1 reads from this layout; a Mamba-2 saved by "
            "transformers as Mamba2ForCausalLM loads with hf:)"
        )
    unknown = sorted(k for k in ssm if k not in _SSM_READ and k not in _SSM_NO_EFFECT)
    if unknown:
        raise refuse(f"ssm_cfg key(s) {', '.join(unknown)}")
    ssm = {**_SSM_READ, **ssm}
    vocab, multiple = int(cfg["vocab_size"]), int(cfg["pad_vocab_size_multiple"])
    if vocab % multiple:  # mamba_ssm's MambaLMHeadModel pads the embedding to a multiple
        vocab += multiple - vocab % multiple
    return MambaLMConfig(
        d_model=int(cfg["d_model"]), n_layer=int(cfg["n_layer"]), vocab_size=vocab,
        d_state=int(ssm["d_state"]), d_conv=int(ssm["d_conv"]), expand=int(ssm["expand"]),
        dt_rank=None if ssm["dt_rank"] == "auto" else int(ssm["dt_rank"]),
        conv_bias=bool(ssm["conv_bias"]), bias=bool(ssm["bias"]), rms_norm=bool(cfg["rms_norm"]),
        residual_in_fp32=bool(cfg["residual_in_fp32"]),
        tie_embeddings=bool(cfg["tie_embeddings"]), chunk_size=chunk_size,
    )  # fmt: skip


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

            from ar_slicing import hub

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

    Returns `MambaLM` in eval mode, or with `as_transformers` the same weights in transformers'
    `MambaForCausalLM` (its own forward: `--no-fast-path`)."""
    from models.checkpoints.io import load_state_dict_checked, read_weights
    from models.mixers.mamba import MambaLM

    cfg = read_mamba_ssm_config(raw, spec)
    path = _find_file(target, local, WEIGHT_FILES, revision)
    if path is None:
        raise ArSliceError(f"{spec}: no {' or '.join(WEIGHT_FILES)} beside the mamba_ssm config")
    state = mamba_ssm_state_dict(read_weights(path))
    tied = ("lm_head.weight",) if cfg.tie_embeddings else ()
    if as_transformers:
        return _transformers_mamba(cfg, state, f"{spec} ({Path(path).name})", tied)
    model = MambaLM(cfg)
    load_state_dict_checked(model, state, source=f"{spec} ({Path(path).name})", tied=tied)
    return model.eval()


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
