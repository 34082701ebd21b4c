"""Multi-head causal self-attention, with the parameter names of Zoology's `zoology/mixers/attention.py`.

A fused `Wqkv` projection laid out as `(three, heads, head_dim)` along its output, PyTorch's
`scaled_dot_product_attention` with a causal mask, and `out_proj`. Optionally rotary embeddings on
the first `rotary_emb_dim` channels of each head and bias-free projections, as flash-attn's `MHA`
builds them for HazyResearch/based's Transformer++ (the same `Wqkv` / `out_proj` layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MHA(nn.Module):
    """Causal multi-head self-attention (Zoology `MHA`): `Wqkv` -> causal softmax attention -> `out_proj`."""

    def __init__(
        self,
        d_model: int,
        l_max: int | None = None,
        layer_idx: int | None = None,
        num_heads: int = 1,
        bias: bool = True,
        dropout: float = 0.0,
        out_proj_bias: bool = True,  # Zoology's out_proj always has one; Transformer++ has none
        rotary_emb_dim: int = 0,  # 0: no rotary (Zoology adds learned positions instead)
        rotary_emb_base: float = 10000.0,
        softmax_scale: float | None = None,  # None: 1/sqrt(head_dim)
        **kwargs,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
        self.d_model = d_model
        self.l_max = l_max
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.softmax_scale = softmax_scale
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=out_proj_bias)
        self.rotary_emb = None
        if rotary_emb_dim:
            from models.rotary import RotaryEmbedding

            if rotary_emb_dim > self.head_dim:
                raise ValueError(f"rotary_emb_dim {rotary_emb_dim} > head_dim {self.head_dim}")
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base)

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
