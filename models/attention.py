"""Multi-head causal self-attention, with the parameter names of Zoology's `zoology/mixers/attention.py`.

A fused `Wqkv` projection laid out as `(three, heads, head_dim)` along its output, PyTorch's
`scaled_dot_product_attention` with a causal mask, and `out_proj`.
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
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        B, T, D = x.shape
        qkv = self.Wqkv(x).view(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, Dh)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, Dh)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out_proj(y)
