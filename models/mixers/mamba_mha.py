"""The attention layer of mamba_ssm's hybrids and Transformer++ (state-spaces/mamba
`mamba_ssm/modules/mha.py`, `MHA`): one `in_proj` to [q, k, v] (+ an optional gated MLP), an
optional depthwise causal conv over qkv (`d_conv`), rotary on q and k (flash-attn's
`RotaryEmbedding`, optionally interleaved), grouped-query heads (`num_heads_kv`), softmax
attention, `out_proj`. Parameter names are upstream's: `in_proj`, `conv1d`, `out_proj`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import Mixer


@dataclass
class MambaMHAOptions:
    num_heads: int = 1
    num_heads_kv: int | None = None  # None: num_heads; fewer: grouped-query attention
    head_dim: int | None = None  # None: d_model // num_heads
    mlp_dim: int = 0  # an in-layer gated MLP beside attention (rounded up to 256, as upstream)
    qkv_proj_bias: bool = True
    out_proj_bias: bool = True
    softmax_scale: float | None = None  # None: 1/sqrt(head_dim)
    causal: bool = True  # upstream's default is False; the published LMs set True
    d_conv: int = 0  # 0: no convolution over qkv
    rotary_emb_dim: int = 0  # 0: no rotary
    rotary_emb_base: float = 10000.0
    rotary_emb_interleaved: bool = False  # True: GPT-J's adjacent pairs


class MambaMHA(Mixer):
    """mamba_ssm's `MHA` as its forward computes without an inference cache."""

    Options = MambaMHAOptions
    mixer_name = "mamba_mha"

    def build(self, opts: MambaMHAOptions) -> None:
        self.num_heads = opts.num_heads
        self.num_heads_kv = opts.num_heads_kv or opts.num_heads
        if self.num_heads % self.num_heads_kv:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_heads_kv {self.num_heads_kv}"
            )
        if opts.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model {self.d_model} is not divisible by num_heads {opts.num_heads}"
            )
        self.head_dim = opts.head_dim or self.d_model // self.num_heads
        self.mlp_dim = math.ceil(opts.mlp_dim / 256) * 256
        self.causal, self.softmax_scale, self.d_conv = opts.causal, opts.softmax_scale, opts.d_conv
        self.qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.in_proj = nn.Linear(self.d_model, self.qkv_dim + self.mlp_dim, bias=opts.qkv_proj_bias)
        if opts.d_conv > 0:  # nn.Conv1d's default bias, as upstream builds it
            self.conv1d = nn.Conv1d(
                self.qkv_dim, self.qkv_dim, opts.d_conv, padding=opts.d_conv - 1,
                groups=self.qkv_dim,
            )  # fmt: skip
        self.rotary_emb = None
        if opts.rotary_emb_dim > 0:
            from models.mixers.rotary import RotaryEmbedding, rotated_channels

            if rotated_channels(opts.rotary_emb_dim) > self.head_dim:
                raise ValueError(
                    f"rotary_emb_dim {opts.rotary_emb_dim} is more than head_dim {self.head_dim}"
                )
            self.rotary_emb = RotaryEmbedding(
                opts.rotary_emb_dim, base=opts.rotary_emb_base,
                interleaved=opts.rotary_emb_interleaved,
            )  # fmt: skip
        out_dim = self.head_dim * self.num_heads + self.mlp_dim // 2
        self.out_proj = nn.Linear(out_dim, self.d_model, bias=opts.out_proj_bias)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        Bsz, T, _ = x.shape
        qkv = self.in_proj(x)  # (B, T, qkv_dim + mlp_dim)
        if self.mlp_dim:
            qkv, x_mlp = qkv.split([self.qkv_dim, self.mlp_dim], dim=-1)
            up, gate = x_mlp.chunk(2, dim=-1)
            x_mlp = up * F.silu(gate)  # (B, T, mlp_dim / 2)
        if self.d_conv:  # causal: padded both sides, the tail dropped
            qkv = self.conv1d(qkv.transpose(1, 2))[..., :T].transpose(1, 2)
        H, Hkv, Dh = self.num_heads, self.num_heads_kv, self.head_dim
        q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q, k, v = q.view(Bsz, T, H, Dh), k.view(Bsz, T, Hkv, Dh), v.view(Bsz, T, Hkv, Dh)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k)
        k = k.repeat_interleave(H // Hkv, dim=2)  # (B, T, H, Dh): query head i reads kv i // group
        v = v.repeat_interleave(H // Hkv, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal,
            scale=self.softmax_scale,
        ).transpose(1, 2)  # (B, T, H, Dh)  # fmt: skip
        y = y.reshape(Bsz, T, H * Dh)
        if self.mlp_dim:
            y = torch.cat([y, x_mlp], dim=-1)
        return self.out_proj(y)
