"""Multi-head causal self-attention, with the parameter names of Zoology's `zoology/mixers/attention.py`.

A fused `Wqkv` projection laid out as `(three, heads, head_dim)` along its output, PyTorch's
`scaled_dot_product_attention` with a causal mask, and `out_proj`. Optionally rotary embeddings on
the first `rotary_emb_dim` channels of each head and bias-free projections, as flash-attn's `MHA`
builds them for HazyResearch/based's Transformer++ (the same `Wqkv` / `out_proj` layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import Mixer


@dataclass
class MHAOptions:
    num_heads: int = 1  # Zoology's default; d_model must be divisible by it
    bias: bool = True  # on Wqkv
    dropout: float = 0.0  # on the attention weights, training only
    out_proj_bias: bool = True  # Zoology's out_proj always has one; Transformer++ has none
    rotary_emb_dim: int = 0  # 0: no rotary (Zoology adds learned positions instead)
    rotary_emb_base: float = 10000.0
    softmax_scale: float | None = None  # None: 1/sqrt(head_dim)


class MHA(Mixer):
    """Causal multi-head self-attention (Zoology `MHA`): `Wqkv` -> causal softmax attention -> `out_proj`."""

    Options = MHAOptions
    mixer_name = "attention"

    def build(self, opts: MHAOptions) -> None:
        d_model = self.d_model
        if d_model % opts.num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {opts.num_heads}")
        self.num_heads = opts.num_heads
        self.head_dim = d_model // opts.num_heads
        self.dropout = opts.dropout
        self.softmax_scale = opts.softmax_scale
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=opts.bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=opts.out_proj_bias)
        self.rotary_emb = None
        if opts.rotary_emb_dim:
            from models.mixers.rotary import RotaryEmbedding, rotated_channels

            if rotated_channels(opts.rotary_emb_dim) > self.head_dim:  # flash-attn asserts it
                raise ValueError(
                    f"rotary_emb_dim {opts.rotary_emb_dim} rotates "
                    f"{rotated_channels(opts.rotary_emb_dim)} channels > head_dim {self.head_dim}"
                )
            self.rotary_emb = RotaryEmbedding(opts.rotary_emb_dim, base=opts.rotary_emb_base)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.Wqkv(x).view(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, H, Dh)
        q, k, v = qkv.unbind(2)  # each (B, T, H, Dh)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # each (B, H, T, Dh)
        y = self.attend(q, k, v)  # (B, H, T, Dh)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out_proj(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax attention over (B, H, T, Dh) heads."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
