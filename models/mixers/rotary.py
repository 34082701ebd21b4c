"""Rotary position embeddings (Su et al., 2021, RoFormer) as flash-attn's `layers/rotary.py` applies
them: GPT-NeoX style (the first and second halves of the rotated dimensions pair up), on the first
`dim` dimensions of every query and key head (`dim + 1` when `dim` is odd, as flash-attn rounds),
with the angles computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


def rotated_channels(dim: int) -> int:
    """Channels a rotary of dimension `dim` turns: flash-attn's `RotaryEmbedding(dim)` makes
    ceil(dim / 2) frequencies `base^(-2i/dim)` (arange(0, dim, 2)) and its kernels rotate twice
    as many channels, so an odd `dim` (head_dim 70 at rotary_emb_fraction 0.5: 35) turns
    dim + 1 of them (36), with the frequencies still divided by 35."""
    return 2 * ((dim + 1) // 2)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotated_channels(dim)` channels of q and k by position-dependent angles
    `pos * base^(-2i/dim)`."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"rotary dimension must be positive, not {dim}")
        self.dim = dim
        self.channels = rotated_channels(dim)
        self.base = float(base)
        # not persistent: recomputed from (dim, base), so checkpoints need not carry it
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))

    def cos_sin(self, seqlen: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, ceil(dim / 2)), computed in fp32 and then cast to `dtype`."""
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device=device, dtype=torch.float32))  # (T, R/2)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, T, H, Dh) -> the same with their first `channels` channels rotated."""
        cos, sin = self.cos_sin(q.shape[1], q.device, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, Dh), cos/sin (T, R/2) -> x with channels [0, R) rotated, the rest unchanged."""
    rot = cos.shape[-1] * 2
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # (T, 1, R)
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, x_pass], dim=-1)
