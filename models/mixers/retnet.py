"""Multi-scale retention, the RetNet layer (Sun et al., 2023, arXiv:2307.08621; Zoology's appendix
H.2.3), as microsoft/torchscale's `MultiScaleRetention` and `RetNetRelPos` compute it, with its key
names (`q_proj`, `k_proj`, `v_proj`, `g_proj`, `out_proj`, no biases).

Head h decays by `γ_h = 1 - 2^(-5-h)` per step; queries and keys are rotated by torchscale's
interleaved rotary (`theta_shift`, angles `10000^-linspace(0, 1, key_dim/2)`), keys scaled by
`key_dim^-1/2`. The recurrence the paper defines, per head,

    S_t = γ S_{t-1} + k_tᵀ v_t,    o_t = q_t S_t,

is computed in its parallel form with torchscale's normalisations: the decay mask `γ^(i-j)` of
each row divided by the root of its sum, then `q k ⊙ mask` by its row's absolute sum (clamped to
[1, 5e4]). Each normalisation scales a whole (token, head) row, which the group norm (an RMSNorm
over each head's values, no affine) undoes, so they keep the numbers in range without changing the
function beyond the norm's epsilon. The parallel form here takes `chunk_size` query rows at a time
(memory (chunk, T) per head instead of (T, T)); `recurrent_forward` is torchscale's
`recurrent_forward`, the paper's recurrence token by token, the reference the tests hold it to.
Then `out_proj(swish(g_proj(x)) ⊙ group_norm(o))`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import Mixer

GATES = {"swish": F.silu, "gelu": F.gelu}


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...) over the last dimension."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def retention_angles(key_dim: int) -> torch.Tensor:
    """torchscale's `RetNetRelPos.angle`: key_dim/2 frequencies, each repeated for its pair."""
    angle = 1.0 / (10000 ** torch.linspace(0, 1, key_dim // 2))
    return angle.unsqueeze(-1).repeat(1, 2).flatten()  # (key_dim,)


def retention_decays(num_heads: int) -> torch.Tensor:
    """torchscale's `RetNetRelPos.decay`: log γ_h = log(1 - 2^(-5-h))."""
    return torch.log(1 - 2 ** (-5 - torch.arange(num_heads, dtype=torch.float)))  # (H,)


@dataclass
class RetentionOptions:
    num_heads: int = 4  # key_dim = d_model / num_heads must be even (rotated in pairs)
    value_dim: int | None = None  # None: 2 d_model, the paper's; torchscale sets it absolutely
    gate_fn: str = "swish"  # torchscale's default gate (swish = SiLU)
    group_norm_eps: float = 1e-6  # torchscale's layernorm_eps, also that of its group norm
    # query rows per step of the parallel form: (chunk_size, T) scores per head in memory
    chunk_size: int = 256

    def __post_init__(self):
        if self.gate_fn not in GATES:
            raise ValueError(f"gate_fn {self.gate_fn!r}: choose one of {', '.join(GATES)}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, not {self.chunk_size}")


class MultiScaleRetention(Mixer):
    """Multi-scale retention: per-head decayed linear attention, group-normed and swish-gated."""

    Options = RetentionOptions
    mixer_name = "retnet"

    def build(self, opts: RetentionOptions) -> None:
        d_model, H = self.d_model, opts.num_heads
        value_dim = 2 * d_model if opts.value_dim is None else opts.value_dim
        if d_model % H or value_dim % H or (d_model // H) % 2:
            raise ValueError(
                f"d_model {d_model} and value_dim {value_dim} must divide into {H} heads of an "
                "even key size"
            )
        self.num_heads, self.key_dim, self.head_dim = H, d_model // H, value_dim // H
        self.scaling = self.key_dim**-0.5
        self.gate = GATES[opts.gate_fn]
        self.eps, self.chunk_size = opts.group_norm_eps, opts.chunk_size
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.out_proj = nn.Linear(value_dim, d_model, bias=False)
        # recomputed from the shape, as torchscale's RetNetRelPos does: checkpoints need not carry them
        self.register_buffer("angle", retention_angles(self.key_dim), persistent=False)
        self.register_buffer("decay", retention_decays(H), persistent=False)

    def project(self, x: torch.Tensor):
        """(rotated q, rotated and scaled k, each (B, H, T, key_dim); v, g, each (B, T, value_dim))."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.key_dim).transpose(1, 2)
        k = (self.k_proj(x) * self.scaling).view(B, T, self.num_heads, self.key_dim).transpose(1, 2)
        index = torch.arange(T, device=x.device).to(self.angle)
        sin = torch.sin(index[:, None] * self.angle[None, :])  # (T, key_dim)
        cos = torch.cos(index[:, None] * self.angle[None, :])
        qr = q * cos + rotate_every_two(q) * sin
        kr = k * cos + rotate_every_two(k) * sin
        return qr, kr, self.v_proj(x), self.g_proj(x)

    def decay_rows(self, start: int, stop: int, T: int) -> torch.Tensor:
        """Rows start..stop of torchscale's normalised decay mask, (H, stop - start, T)."""
        i = torch.arange(start, stop, device=self.decay.device).to(self.decay)[:, None]
        j = torch.arange(T, device=self.decay.device).to(self.decay)[None, :]
        distance = (i - j).masked_fill(j > i, float("inf"))  # (rows, T)
        mask = torch.nan_to_num(torch.exp(distance * self.decay[:, None, None]))  # 0 above
        # the row sums of γ^(i-j) over j <= i, as torchscale sums its full (T, T) mask
        return mask / mask.sum(dim=-1, keepdim=True).sqrt()

    def retention(self, qr, kr, v) -> torch.Tensor:
        """The parallel form, `chunk_size` query rows at a time: (B, T, H, head_dim)."""
        B, H, T, _ = qr.shape
        vr = v.view(B, T, H, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        out = []
        for start in range(0, T, self.chunk_size):
            stop = min(T, start + self.chunk_size)
            # keys past `stop` are masked to 0: leave them out
            scores = qr[:, :, start:stop] @ kr[:, :, :stop].transpose(-1, -2)  # (B, H, c, stop)
            scores = scores * self.decay_rows(start, stop, stop)
            scores = scores / scores.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1, max=5e4)
            out.append(scores @ vr[:, :, :stop])  # (B, H, c, hd)
        return torch.cat(out, dim=2).transpose(1, 2)  # (B, T, H, hd)

    def recurrent_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer token by token: torchscale's `recurrent_forward`, whose state is
        `S_t / sqrt(scale_t)` with `scale_t = Σ_{j<=t} γ^(t-j)` (the decay mask's row sum)."""
        qr, kr, v, g = self.project(x)
        B, H, T, _ = qr.shape
        gamma = self.decay.exp().view(H, 1, 1)
        state = scale = None
        out = []
        for t in range(T):
            kv = kr[:, :, t, :, None] * v[:, t].view(B, H, 1, self.head_dim)  # (B, H, kd, hd)
            if state is None:
                scale = torch.ones_like(gamma)
            else:
                prev = scale
                scale = prev * gamma + 1
                kv = state * (prev.sqrt() * gamma / scale.sqrt()) + kv / scale.sqrt()
            state = kv
            out.append(torch.sum(qr[:, :, t, :, None] * state, dim=2))  # (B, H, hd)
        return self.read_out(torch.stack(out, dim=1), g)

    def read_out(self, o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Group norm of (B, T, H, hd) retention outputs, swish gate, out_proj: (B, T, D)."""
        B, T = o.shape[:2]
        o = o.float()
        o = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)).to(g.dtype)
        return self.out_proj(self.gate(g) * o.reshape(B, T, -1))

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        qr, kr, v, g = self.project(x)
        return self.read_out(self.retention(qr, kr, v), g)
