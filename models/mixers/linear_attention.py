"""Causal linear attention with the 2nd-order Taylor feature map: Based's global mixer (Arora et al.,
2024, "Simple linear attention language models balance the recall-throughput tradeoff";
HazyResearch/based `based/models/mixers/linear_attention.py`).

    phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]      (1 + d + d² features)
    y_t    = sum_{s<=t} (phi(q_t) . phi(k_s)) v_s  /  (sum_{s<=t} phi(q_t) . phi(k_s) + eps)

so that phi(q) . phi(k) = 1 + q.k / sqrt(d) + (q.k)² / (2d), the Taylor expansion of exp(q.k/sqrt(d)).
Keys `proj_q`, `proj_k` (to `num_heads * feature_dim`), `proj_v`, `out_proj`, all without bias.

Computed in chunks of `chunk_size` positions, in fp32 whatever the model's dtype: inside a chunk the
weights come from q.k directly (no d² expansion); across chunks a running state
sum phi(k)^T v (and sum phi(k) for the denominator) is carried, so the cost grows linearly in T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.mixers.base import Mixer

FEATURE_MAPS = ("taylor_exp",)


def taylor_features(x: torch.Tensor, scale_dim: int) -> torch.Tensor:
    """(..., d) -> (..., 1 + d + d²): `phi` above, with `scale_dim` in the place of d."""
    rd = math.sqrt(scale_dim)
    x2 = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(start_dim=-2) / math.sqrt(2)  # (..., d²)
    return torch.cat([torch.ones_like(x[..., :1]), x / math.sqrt(rd), x2 / rd], dim=-1)


def causal_taylor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_dim: int,
    eps: float,
    chunk_size: int = 64,
    state: torch.Tensor | None = None,
    k_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k (B, H, T, d), v (B, H, T, Dv), all fp32 -> (B, H, T, Dv): `y_t` above, with the sums
    over s starting from `state` (B, H, F, Dv) and `k_sum` (B, H, F) when given (keys every
    position sees, as JRT's encoder: models/mixers/prefix_linear_attention.py)."""
    B, H, T, d = q.shape
    n_features = 1 + d + d * d
    if state is None:  # sum of phi(k_s)^T v_s so far
        state = q.new_zeros(B, H, n_features, v.shape[-1])
    if k_sum is None:  # sum of phi(k_s) so far
        k_sum = q.new_zeros(B, H, n_features)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    rd = math.sqrt(scale_dim)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        n = end - start
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        s = qc @ kc.transpose(-1, -2)  # (B, H, n, n)
        a = (1 + s / rd + s * s / (2 * scale_dim)).masked_fill(~causal[:n, :n], 0.0)
        phi_q = taylor_features(qc, scale_dim)  # (B, H, n, F)
        num = a @ vc + phi_q @ state  # (B, H, n, Dv)
        den = a.sum(-1) + (phi_q @ k_sum.unsqueeze(-1)).squeeze(-1)  # (B, H, n)
        out[:, :, start:end] = num / (den.unsqueeze(-1) + eps)
        phi_k = taylor_features(kc, scale_dim)  # (B, H, n, F)
        state = state + phi_k.transpose(-1, -2) @ vc
        k_sum = k_sum + phi_k.sum(2)
    return out


@dataclass
class LinearAttentionOptions:
    feature_dim: int = 16  # Based's default: 16 -> 273 features per head
    num_heads: int = 16
    head_dim: int | None = None  # value width per head; None: d_model / num_heads
    feature_map: str = "taylor_exp"
    scale_dim: int | None = None  # the d in phi's scaling; None: feature_dim
    eps: float = 1e-12  # upstream's; its flash-linear-attention kernels use 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature map {self.feature_map!r} is not implemented; choose one of {FEATURE_MAPS}"
            )


class LinearAttention(Mixer):
    """Based's Taylor linear attention: `num_heads` heads of `feature_dim` query/key features."""

    Options = LinearAttentionOptions
    mixer_name = "linear_attention"

    def build(self, opts: LinearAttentionOptions) -> None:
        d_model, feature_dim, num_heads = self.d_model, opts.feature_dim, opts.num_heads
        self.feature_dim = feature_dim
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads if opts.head_dim is None else opts.head_dim
        self.scale_dim = feature_dim if opts.scale_dim is None else opts.scale_dim
        self.eps = opts.eps
        self.chunk_size = opts.chunk_size
        self.proj_q = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_k = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_v = nn.Linear(d_model, num_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(num_heads * self.head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        q = self.proj_q(x).view(B, T, H, self.feature_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.proj_k(x).view(B, T, H, self.feature_dim).transpose(1, 2)  # (B, H, T, d)
        v = self.proj_v(x).view(B, T, H, self.head_dim).transpose(1, 2)  # (B, H, T, Dv)
        y = causal_taylor_attention(
            q.float(), k.float(), v.float(), self.scale_dim, self.eps, self.chunk_size
        )  # (B, H, T, Dv) fp32
        y = y.transpose(1, 2).reshape(B, T, H * self.head_dim).to(x.dtype)  # (B, T, H*Dv)
        return self.out_proj(y)
