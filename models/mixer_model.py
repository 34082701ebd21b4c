"""mamba_ssm's language model with a mixer chosen per layer (state-spaces/mamba
`mamba_ssm/models/mixer_seq_simple.py`: `MixerModel`, `create_block`, `MambaLMHeadModel`): Mamba-2
(or Mamba-1) layers, attention (`MHA`) at the layers `attn_layer_idx` names, and a gated MLP after
every mixer when `d_intermediate` > 0. Mamba-2, the hybrid (state-spaces/mamba2attn-2.7b) and
Transformer++ (state-spaces/transformerpp-2.7b, attention at every layer) are all this model.

Keys are upstream's: `backbone.embedding`, `backbone.layers.{i}.{norm,mixer,norm2,mlp}`,
`backbone.norm_f`, `lm_head`. Each block is upstream's `Block` (add, norm, mixer; add, norm2, MLP)
with its residual stream carried beside the hidden state, in fp32 with `residual_in_fp32`.
Plain Mamba-1 models (no attention, no MLP) keep models/mixers/mamba.py's `MambaLM`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# the mixer class (and its module) of each mamba_ssm layer name; attention is "MHA"
LAYER_MIXERS = {
    "Mamba1": ("models.mixers.mamba", "MambaMixer"),
    "Mamba2": ("models.mixers.mamba2", "Mamba2Mixer"),
    "MHA": ("models.mixers.mamba_mha", "MambaMHA"),
}
GATED_MLP_MULTIPLE = 128  # mamba_ssm's GatedMLP rounds its width up to a multiple of this


@dataclass
class MixerModelConfig:
    d_model: int = 2560
    n_layer: int = 64
    vocab_size: int = 50288  # rows of the embedding, already padded (pad_vocab_size_multiple)
    ssm_layer: str = "Mamba2"  # the mixer of every layer not in attn_layer_idx
    ssm_cfg: dict[str, Any] = field(default_factory=dict)  # its options (Mamba2Options, ...)
    attn_layer_idx: list[int] = field(default_factory=list)
    attn_cfg: dict[str, Any] = field(default_factory=dict)  # MambaMHAOptions
    d_intermediate: int = 0  # the gated MLP's width before rounding; 0: no MLP
    rms_norm: bool = True  # False: LayerNorm with a bias
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True

    def layer_mixer(self, i: int) -> tuple[str, dict[str, Any]]:
        """(mamba_ssm layer name, its options) of layer i."""
        if i in self.attn_layer_idx:
            return "MHA", dict(self.attn_cfg)
        return self.ssm_layer, dict(self.ssm_cfg)


def make_norm(cfg: MixerModelConfig) -> nn.Module:
    from models.mixers.mamba import RMSNorm

    if cfg.rms_norm:
        return RMSNorm(cfg.d_model, eps=cfg.norm_epsilon)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_epsilon)


class MixerBlock(nn.Module):
    """mamba_ssm's `Block`: residual += hidden; hidden = mixer(norm(residual)); and again with the
    MLP when there is one. Returns (hidden, residual)."""

    def __init__(self, cfg: MixerModelConfig, layer_idx: int):
        import importlib

        super().__init__()
        name, options = cfg.layer_mixer(layer_idx)
        module, cls = LAYER_MIXERS[name]
        mixer_cls = getattr(importlib.import_module(module), cls)
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = make_norm(cfg)
        self.mixer = mixer_cls(cfg.d_model, layer_idx=layer_idx, **options)
        self.mlp = None
        if cfg.d_intermediate:
            from models.mixers.mlp import SwiGLU

            m = GATED_MLP_MULTIPLE
            hidden = (cfg.d_intermediate + m - 1) // m * m
            self.norm2 = make_norm(cfg)
            # mamba_ssm's GatedMLP: fc1 -> (y, gate), y * silu(gate), fc2, no biases
            self.mlp = SwiGLU(cfg.d_model, hidden=hidden, fc1_bias=False, fc2_bias=False)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        residual = hidden if residual is None else hidden + residual
        hidden = self.mixer(self.norm(residual.to(self.norm.weight.dtype)))
        if self.residual_in_fp32:
            residual = residual.float()
        if self.mlp is not None:
            residual = hidden + residual
            hidden = self.mlp(self.norm2(residual.to(self.norm2.weight.dtype)))
            if self.residual_in_fp32:
                residual = residual.float()
        return hidden, residual


class MixerBackbone(nn.Module):
    def __init__(self, cfg: MixerModelConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MixerBlock(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embedding(input_ids), None  # (B, T, D)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        residual = hidden if residual is None else hidden + residual
        return self.norm_f(residual.to(self.norm_f.weight.dtype))  # (B, T, D)


class MixerLM(nn.Module):
    """mamba_ssm's `MambaLMHeadModel` with per-layer mixers: embedding, blocks, norm_f, lm_head."""

    def __init__(self, cfg: MixerModelConfig):
        super().__init__()
        self.config = cfg
        self.backbone = MixerBackbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def set_mode(self, mode: str) -> None:
        """Every Mamba layer's scan: "chunked" (the fast one) or "sequential" (the reference)."""
        for layer in self.backbone.layers:
            if hasattr(layer.mixer, "mode"):
                layer.mixer.mode = mode

    def hidden_and_head(self, input_ids: torch.Tensor):
        return self.backbone(input_ids), self.lm_head.weight, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone(input_ids))  # (B, T, V) logits
