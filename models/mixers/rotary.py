"""Rotary position embeddings (Su et al., 2021, RoFormer) as flash-attn's `layers/rotary.py` applies
them: GPT-NeoX style (the first and second halves of the rotated dimensions pair up; GPT-J style,
adjacent channels paired, with `interleaved`), on the first
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

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        self.interleaved = interleaved
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
        rotate = self.interleaved
        return apply_rotary(q, cos, sin, rotate), apply_rotary(k, cos, sin, rotate)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x (B, T, H, Dh), cos/sin (T, R/2) -> x with channels [0, R) rotated, the rest unchanged:
    channel i paired with i + R/2, or with `interleaved` channel 2i with 2i + 1."""
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        cos = cos.repeat_interleave(2, dim=-1)[:, None, :]  # (T, 1, R): c0 c0 c1 c1 ...
        sin = sin.repeat_interleave(2, dim=-1)[:, None, :]
        x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
        turned = torch.stack([-x2, x1], dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    else:
        cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # (T, 1, R)
        sin = torch.cat([sin, sin], dim=-1)[:, None, :]
        x1, x2 = x_rot.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + turned * sin, x_pass], dim=-1)
