"""Every HazyResearch id `pile-hazy.toml` and `pile-jrt.toml` name reads into the layers its
training config built: the model configs of HazyResearch/based `train/configs/experiment/
reference/*.yaml` (the based README's table) and HazyResearch/prefix-linear-attention
`train/configs/experiment/baselines/*.yaml`, flattened as their config.json holds them. The
losses of each layout are pinned by the golden fixtures (test_based.py, test_jrt.py, test_mamba.py);
this checks the published sizes and layer plans read as upstream's `create_mixer_cls` reads them."""

from __future__ import annotations

import pytest
import torch

from models.checkpoints.based import architecture_of, model_config_from_based
from models.checkpoints.mamba_ssm import read_mamba_ssm_config

# what every published GPT config of the suites shares (the yaml's `model.config` block)
GPT = {
    "_target_": "based.models.gpt.GPT2MixerConfig", "rms_norm": True, "fused_mlp": False,
    "attn_pdrop": 0, "embd_pdrop": 0, "n_positions": 2048, "resid_pdrop": 0,
    "mlp_fc1_bias": False, "mlp_fc2_bias": False, "fused_bias_fc": True, "out_proj_bias": False,
    "qkv_proj_bias": False, "use_flash_attn": True, "residual_in_fp32": True,
    "activation_function": "swiglu", "fused_dropout_add_ln": True, "max_position_embeddings": 0,
    "reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False,
    "vocab_size": 50277,
}  # fmt: skip
ATTN = {**GPT, "_target_": "transformers.GPT2Config", "rotary_emb_fraction": 0.5,
        "pad_vocab_size_multiple": 16, "ff_mult": 4}  # fmt: skip
CONV = {"_target_": "based.models.mixers.convolution.BaseConv", "l_max": 2048, "use_bias": True,
        "expand_proj": 4, "kernel_sizes": 3}  # fmt: skip
TAYLOR = {"_target_": "based.models.mixers.linear_attention.LinearAttention", "l_max": 2048,
          "feature_map": {"_target_": "based.models.mixers.linear_attention.TaylorExp",
                          "input_dim": 16},
          "feature_dim": 16, "num_heads": 16}  # fmt: skip
SLIDING = {"_target_": "based.models.mixers.slide_attention.SlidingAttention", "window_size": 256,
           "num_heads": 16, "causal": True}  # fmt: skip
PREFIX = {"_target_": "based.models.mixers.prefix_linear_attention.PrefixLinearAttention",
          "l_max": 2048, "feature_dim": 16, "feature_name": "taylor_exp", "num_heads": 16,
          "num_key_value_heads": 16, "enc_length": 1024, "dec_length": 1024,
          "implementation": "fla_parallel", "use_mask": True}  # fmt: skip
LAYERS_360M = ([1, 6, 11, 16, 21], [2, 7, 12, 17, 22])
LAYERS_1B = ([1, 6, 11, 16, 21, 27, 33], [2, 7, 12, 17, 22, 28, 34])


def based(d: int, n: int, layers, alt: dict, **extra) -> dict:
    return {
        **GPT, "n_embd": d, "n_head": 16, "n_layer": n, "n_inner": 2 * d, "special_initializer": True,
        "rotary_emb_fraction": 1, "pad_vocab_size_multiple": 8, "alt_mixer_layers": layers[0],
        "alt_mixer_2_layers": layers[1], "mixer": CONV, "alt_mixer": alt, "alt_mixer_2": SLIDING,
        **extra,
    }  # fmt: skip


PUBLISHED = {
    "based-360m": based(1024, 27, LAYERS_360M, {**TAYLOR, "parallel_implementation": "fla_parallel"}),
    "based-1b": based(1792, 36, LAYERS_1B, TAYLOR, fixed_decay=True, decay_const=-3,
                      decay_denom=False),
    "based-1b-50b": based(1792, 36, LAYERS_1B, {**TAYLOR, "parallel_implementation": "fla_parallel"},
                          fixed_decay=False, decay_const=-3, decay_denom=False),
    "attn-360m": {**ATTN, "n_embd": 1024, "n_head": 16, "n_layer": 24},
    "attn-1b": {**ATTN, "n_embd": 1680, "n_head": 24, "n_layer": 36},
    "attn-360M-30B": {**ATTN, "n_embd": 1024, "n_head": 16, "n_layer": 24},
    "JRT-360M-30B": based(1024, 26, LAYERS_360M, PREFIX, enc_length=1024, dec_length=1024,
                          data_type="mixed", mixer={**CONV, "kernel_sizes": [3]},
                          alt_mixer_2={**SLIDING, "use_mask": True}),
    "JRT-1B-50B": based(1792, 36, LAYERS_1B, PREFIX, enc_length=1024, dec_length=1024,
                        data_type="mixed", mixer={**CONV, "kernel_sizes": [3]},
                        alt_mixer_2={**SLIDING, "use_mask": True}),
}  # fmt: skip
ARCHITECTURE = {"based": "based", "attn": "attention", "JRT": "jrt"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_gpt_configs_read_their_layers(name):
    raw = PUBLISHED[name]
    d, n = raw["n_embd"], raw["n_layer"]
    width = 4 * d if name.startswith("attn") else 2 * d  # ff_mult 4 / n_inner 2d
    state = {"transformer.layers.0.mlp.fc2.weight": torch.empty(d, width)}
    config, _ = model_config_from_based(raw, state, name)
    assert architecture_of(config) == ARCHITECTURE[name.split("-")[0]]
    assert config.d_model == d and config.n_layers == n and config.padded_vocab_size % 8 == 0
    plan = [config.mixer_of_layer(i)[0] for i in range(n)]
    if name.startswith("attn"):
        assert set(plan) == {"attention"}
        head_dim = d // raw["n_head"]
        assert config.mixer_of_layer(0)[1]["rotary_emb_dim"] == head_dim // 2
        return
    alt, alt2 = LAYERS_360M if n < 30 else LAYERS_1B
    global_mixer = "prefix_linear_attention" if name.startswith("JRT") else "linear_attention"
    assert [i for i, m in enumerate(plan) if m == global_mixer] == alt
    assert [i for i, m in enumerate(plan) if m == "sliding_attention"] == alt2
    assert set(plan) == {"based_conv", global_mixer, "sliding_attention"}
    assert config.mixer_of_layer(alt2[0])[1]["window"] == 128  # flash-attn's (window // 2, 0)


@pytest.mark.parametrize(
    "name, d_model, n_layer",
    [("mamba-360m", 1024, 46), ("mamba-1b", 2048, 46), ("mamba-1b-50b", 2048, 46),
     ("mamba-360M-30B", 1024, 46)],
)  # fmt: skip
def test_published_mamba_configs_are_mamba_ssm_configs(name, d_model, n_layer):
    """The suites' Mamba: based's MambaConfig (train/configs/model/mamba.yaml: mamba_ssm's fields
    and GPT fields its Mamba never reads; the 360M's d_model is gpt3m's 1024)."""
    raw = {
        "d_model": d_model, "n_layer": n_layer, "vocab_size": 50277, "ssm_cfg": {},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": 16, "reorder_and_upcast_attn": False,
        "scale_attn_by_inverse_layer_idx": True, "n_positions": 2048, "n_embd": d_model,
        "n_head": 16, "use_flash_attn": True, "fused_dropout_add_ln": True, "fused_mlp": False,
        "fused_bias_fc": True,
    }  # fmt: skip
    cfg = read_mamba_ssm_config(raw, name)
    assert (cfg.d_model, cfg.n_layer, cfg.vocab_size) == (d_model, n_layer, 50288)
