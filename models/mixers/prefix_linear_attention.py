"""JRT-RNN's prefix linear attention (Arora et al., 2024, "Just read twice: closing the recall gap
for recurrent language models"; HazyResearch/prefix-linear-attention
`based/models/mixers/prefix_linear_attention.py`, `PrefixLinearAttention`).

Based's Taylor linear attention (models/mixers/linear_attention.py) with an encoder: the first
`enc_length` tokens are projected a second time (`proj_k_enc`, `proj_v_enc`), and every position
reads all of them, before and after it, beside its own causal sum:

    y_t = phi(q_t) . (sum_{s<=t} phi(k_s) v_s^T + sum_{s<E} phi(ke_s) ve_s^T)
          / (phi(q_t) . (sum_{s<=t} phi(k_s) + sum_{s<E} phi(ke_s)) + eps),   E = min(enc_length, T)

(upstream's "default" and "fla_parallel" implementations compute the same y). Inside the prefix
a position therefore sees tokens after it, its own next token among them: run on a whole window,
the model's next-token losses at positions < E - 1 are not predictions. What upstream computes
for a context shorter than `enc_length` is the model run on that context alone (E = its length),
and that is what `prefix_causal_hidden` gives every position: positions from E - 1 on from one
pass over the window, each earlier position t from a pass whose encoder covers tokens 0..t only
(the other mixers are causal, so later tokens change nothing there).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from models.mixers.base import Mixer
from models.mixers.linear_attention import causal_taylor_attention, taylor_features

log = logging.getLogger(__name__)
# tokens per forward pass of prefix_causal_hidden's re-runs (rows x length): bounds the memory
# of one pass at about what an 8 x 2048 batch takes
RERUN_TOKENS = 1 << 14


@dataclass
class PrefixLinearAttentionOptions:
    enc_length: int = 1024  # tokens the encoder reads (the JRT checkpoints': 1024 of 2048)
    feature_dim: int = 16  # as Based: 16 -> 273 features per head
    num_heads: int = 16
    scale_dim: int | None = None  # the d in phi's scaling; None: feature_dim
    eps: float = 1e-12  # upstream's
    chunk_size: int = 64  # tokens per chunk of the causal part

    def __post_init__(self):
        if self.enc_length < 1:
            raise ValueError(f"enc_length must be positive, not {self.enc_length}")


class PrefixLinearAttention(Mixer):
    """JRT's prefix linear attention: causal Taylor linear attention plus an encoder over the first
    `enc_length` tokens (module docstring). `encoder_lengths` (B,), set by `encoder_lengths_of`,
    shortens each row's encoder."""

    Options = PrefixLinearAttentionOptions
    mixer_name = "prefix_linear_attention"

    def build(self, opts: PrefixLinearAttentionOptions) -> None:
        d_model, fd, H = self.d_model, opts.feature_dim, opts.num_heads
        if d_model % H:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {H}")
        self.enc_length, self.feature_dim, self.num_heads = opts.enc_length, fd, H
        self.head_dim = d_model // H
        self.scale_dim = fd if opts.scale_dim is None else opts.scale_dim
        self.eps, self.chunk_size = opts.eps, opts.chunk_size
        self.proj_q = nn.Linear(d_model, fd * H, bias=False)
        self.proj_k = nn.Linear(d_model, fd * H, bias=False)
        self.proj_v = nn.Linear(d_model, H * self.head_dim, bias=False)
        self.proj_k_enc = nn.Linear(d_model, fd * H, bias=False)
        self.proj_v_enc = nn.Linear(d_model, H * self.head_dim, bias=False)
        self.out_proj = nn.Linear(H * self.head_dim, d_model, bias=False)
        self.encoder_lengths: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        B, T, _ = x.shape
        H, fd, Dv = self.num_heads, self.feature_dim, self.head_dim
        E = min(self.enc_length, T)
        q = self.proj_q(x).view(B, T, H, fd).transpose(1, 2).float()  # (B, H, T, d)
        k = self.proj_k(x).view(B, T, H, fd).transpose(1, 2).float()
        v = self.proj_v(x).view(B, T, H, Dv).transpose(1, 2).float()  # (B, H, T, Dv)
        x_enc = x[:, :E]
        k_enc = self.proj_k_enc(x_enc).view(B, E, H, fd).transpose(1, 2).float()  # (B, H, E, d)
        v_enc = self.proj_v_enc(x_enc).view(B, E, H, Dv).transpose(1, 2).float()
        phi_k_enc = taylor_features(k_enc, self.scale_dim)  # (B, H, E, F)
        if self.encoder_lengths is not None:  # phi(0) is not 0: drop the features themselves
            keep = torch.arange(E, device=x.device)[None, :] < self.encoder_lengths[:, None]
            phi_k_enc = phi_k_enc * keep[:, None, :, None]
        y = causal_taylor_attention(
            q, k, v, self.scale_dim, self.eps, self.chunk_size,
            state=phi_k_enc.transpose(-1, -2) @ v_enc,  # (B, H, F, Dv)
            k_sum=phi_k_enc.sum(2),  # (B, H, F)
        )  # (B, H, T, Dv)  # fmt: skip
        y = y.transpose(1, 2).reshape(B, T, H * Dv).to(x.dtype)
        return self.out_proj(y)


@contextlib.contextmanager
def encoder_lengths_of(model: nn.Module, lengths: torch.Tensor | None):
    """Every prefix linear attention of `model` reads only `lengths[b]` encoder tokens of row b
    while the block runs."""
    layers = [m for m in model.modules() if isinstance(m, PrefixLinearAttention)]
    for m in layers:
        m.encoder_lengths = lengths
    try:
        yield
    finally:
        for m in layers:
            m.encoder_lengths = None


def prefix_enc_length(model: nn.Module) -> int:
    """The longest encoder of the model's prefix linear attention layers (0: none)."""
    return max(
        (m.enc_length for m in model.modules() if isinstance(m, PrefixLinearAttention)), default=0
    )


def prefix_causal_hidden(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The final hidden state (B, T, D) at each position t as the model gives it for the context
    input_ids[:, :t+1] alone (module docstring): one pass for positions >= E - 1, and for each
    earlier t a pass over the first E - 1 tokens whose encoder reads tokens 0..t only, batched
    RERUN_TOKENS tokens at a time. `model.backbone` maps (B, T) ids to (B, T, D)."""
    hidden = model.backbone(input_ids)  # (B, T, D): exact from position E - 1 on
    B, T = input_ids.shape
    n = min(prefix_enc_length(model) - 1, T)  # positions whose encoder would see their future
    if n <= 0:
        return hidden
    hidden = hidden.clone()
    rows = max(1, RERUN_TOKENS // n)
    for b in range(B):
        prefix = input_ids[b, :n]
        for t0 in range(0, n, rows):
            ts = torch.arange(t0, min(n, t0 + rows), device=input_ids.device)  # positions
            with encoder_lengths_of(model, ts + 1):
                rerun = model.backbone(prefix.expand(len(ts), n))  # (rows, n, D)
            hidden[b, ts] = rerun[torch.arange(len(ts)), ts]
    return hidden


def prefix_scoring(model: nn.Module, spec: str):
    """(hidden_and_head, loader settings) scoring every position of a model with prefix linear
    attention from its own context (`prefix_causal_hidden`), or None for a model without it. Its
    encoder would otherwise show the positions inside the prefix their own next tokens."""
    enc = prefix_enc_length(model)
    if not enc:
        return None
    log.warning(
        "%s: JRT-RNN reads its first %d tokens non-causally; each of the first %d positions of a "
        "window is scored from a pass over its own context (about %dx the work of one window)",
        spec, enc, enc - 1, max(1, (enc - 1) // 2),
    )  # fmt: skip

    def hidden_and_head(input_ids):
        return prefix_causal_hidden(model, input_ids), model.lm_head.weight, None

    note = f"positions < {enc - 1} scored from their own context (enc_length {enc})"
    return hidden_and_head, {"prefix_scoring": note}
