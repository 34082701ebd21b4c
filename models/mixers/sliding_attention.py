"""Sliding-window causal attention, Based's local mixer (Arora et al., 2024, "Simple linear attention
language models balance the recall-throughput tradeoff"; HazyResearch/based
`based/models/mixers/slide_attention.py`), in pure PyTorch instead of flash-attn's window kernel.

Each query sees itself and the `window` tokens before it. HazyResearch/based's `SlidingAttention`
takes a `window_size` and hands flash-attn `window_size=(window_size // 2, 0)`, so its
`window_size: 128` is `window = 64` here. Projections and rotary are those of attention.py's `MHA`
(`Wqkv`, `out_proj`, the same key names).

The attention is computed block by block: queries in blocks of `block` positions, each block
against its own keys and the `window` keys before them, so the cost grows as T · (block + window)
rather than T².
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.mixers.attention import MHA, MHAOptions


@dataclass
class SlidingWindowOptions(MHAOptions):
    window: int = 64  # earlier tokens in view; Based's window_size 128 -> 64
    block: int = 64  # query positions per block; any value gives the same result

    def __post_init__(self):
        if self.window < 0 or self.block < 1:
            raise ValueError(
                f"window must be >= 0 and block >= 1 (got {self.window}, {self.block})"
            )


class SlidingWindowAttention(MHA):
    """Causal softmax attention restricted to the last `window` positions (and the current one)."""

    Options = SlidingWindowOptions
    mixer_name = "sliding_attention"

    def build(self, opts: SlidingWindowOptions) -> None:
        super().build(opts)
        self.window = opts.window
        self.block = opts.block

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, T, Dh = q.shape
        W, S = self.window, self.block
        if T <= W + 1:  # every query sees its whole prefix: plain causal attention
            return super().attend(q, k, v)
        n = -(-T // S)  # query blocks
        pad_right = n * S - T
        q = F.pad(q, (0, 0, 0, pad_right)).view(B, H, n, S, Dh)  # (B, H, n, S, Dh)
        # keys of block b: absolute positions b*S - W .. b*S + S - 1 (left-padded with W zeros)
        k = F.pad(k, (0, 0, W, pad_right)).unfold(2, S + W, S).transpose(-1, -2)  # (B,H,n,S+W,Dh)
        v = F.pad(v, (0, 0, W, pad_right)).unfold(2, S + W, S).transpose(-1, -2)  # (B,H,n,S+W,Dh)
        r = torch.arange(S, device=q.device)[:, None]  # query offset in its block
        c = torch.arange(S + W, device=q.device)[None, :]  # key offset in the block's keys
        start = torch.arange(n, device=q.device)[:, None, None] * S  # (n, 1, 1)
        # key position s = b*S - W + c is visible from t = b*S + r when t - W <= s <= t and s >= 0
        mask = (c >= r) & (c <= r + W) & (c >= W - start)  # (n, S, S+W)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )  # (B, H, n, S, Dh)
        return y.reshape(B, H, n * S, Dh)[:, :, :T]  # (B, H, T, Dh)
