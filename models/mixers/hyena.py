"""The Hyena operator of order 2 (Poli et al., 2023, arXiv:2302.10866) with Zoology's parameter names.

Follows HazyResearch/zoology `zoology/mixers/hyena.py` (itself from HazyResearch/safari
`src/models/sequence/hyena.py`): `in_proj` to 3·d, a short depthwise causal filter over all three
projections, an implicit long filter (positional embedding -> MLP with `Sin` activations ->
exponential decay modulation), FFT causal convolution with a per-channel bias (skip) term, gating
before and after it, and `out_proj`. The filter pieces are shared with base_conv.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.mixers.base import Mixer


def fft_causal_conv(
    u: torch.Tensor, k: torch.Tensor, skip: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal convolution `y[..., t] = sum_{s<=t} k[..., s] u[..., t-s] (+ skip * u[..., t])` via FFT.

    u (B, D, L), k (D, L), skip (D,) or None. Zero-padding to 2L makes the circular FFT product a
    linear (causal) convolution. Computed in fp32 (FFTs in bf16 lose too much); returns u's dtype.
    """
    L = u.shape[-1]
    n = 2 * L
    k_f = torch.fft.rfft(k.float(), n=n)  # (D, n//2+1)
    u_f = torch.fft.rfft(u.float(), n=n)  # (B, D, n//2+1)
    y = torch.fft.irfft(u_f * k_f, n=n)[..., :L]  # (B, D, L)
    if skip is not None:
        y = y + u.float() * skip.float()[:, None]
    return y.to(u.dtype)


class Sin(nn.Module):
    """Periodic activation `sin(freq * x)` with a learned frequency per channel."""

    def __init__(self, dim: int, w: float = 10.0):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.freq * x)


class PositionalEmbedding(nn.Module):
    """Filter input features: normalised time t in [0, 1] and `(emb_dim - 1) // 2` complex bands."""

    def __init__(self, emb_dim: int, seq_len: int, with_time: bool = True):
        super().__init__()
        self.seq_len = seq_len
        t = torch.linspace(0, 1, seq_len)[None, :, None]  # (1, L, 1)
        bands = (emb_dim - 1) // 2
        t_rescaled = torch.linspace(0, seq_len - 1, seq_len)[None, :, None]
        w = 2 * math.pi * t_rescaled / seq_len  # (1, L, 1)
        f = torch.linspace(1e-4, bands - 1, bands)[None, None]  # (1, 1, bands)
        z = torch.exp(-1j * f * w)
        z = torch.cat([t, z.real, z.imag], dim=-1)  # (1, L, emb_dim)
        # z is trainable (with a tiny learning rate) in Zoology/safari, t is a buffer; BaseConv's
        # current implicit filter keeps no t
        self.z = nn.Parameter(z)
        if with_time:
            self.register_buffer("t", t)
        else:
            self.t = None

    def forward(self, L: int):
        return self.z[:, :L], None if self.t is None else self.t[:, :L]


class ExponentialModulation(nn.Module):
    """Multiplies the filter by `exp(-t |delta_d|)`: channel d decays to `target` over a set fraction."""

    def __init__(
        self,
        d_model: int,
        fast_decay_pct: float = 0.3,
        slow_decay_pct: float = 1.5,
        target: float = 1e-2,
        modulate: bool = True,
        shift: float = 0.0,
    ):
        super().__init__()
        self.modulate = modulate
        self.shift = shift
        max_decay = math.log(target) / fast_decay_pct
        min_decay = math.log(target) / slow_decay_pct
        self.register_buffer("deltas", torch.linspace(min_decay, max_decay, d_model)[None, None])

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not self.modulate:
            return x
        return x * (torch.exp(-t * self.deltas.abs()) + self.shift)


class ImplicitFilter(nn.Module):
    """Implicit long filter `h = modulation(t, MLP(z))`, shape (L, d_model), plus the skip `bias`.

    Zoology calls this `Filter` (hyena.py) / `ImplicitLongConvolution` (convolution.py). One `Sin`
    module is shared by all MLP layers, so its `freq` appears under each of their indices.
    """

    def __init__(
        self,
        d_model: int,
        l_max: int,
        emb_dim: int = 3,
        order: int = 16,  # width of the filter MLP
        w: float = 1.0,  # frequency of the Sin activations
        num_inner_mlps: int = 2,
        normalized: bool = False,
        bias: bool = True,
        modulate: bool = True,
        shift: float = 0.0,
        fast_decay_pct: float = 0.3,
        slow_decay_pct: float = 1.5,
        target: float = 1e-2,
    ):
        super().__init__()
        if emb_dim % 2 == 0 or emb_dim < 3:
            raise ValueError(f"emb_dim must be odd and >= 3 (time, cosine, sine), got {emb_dim}")
        self.d_model = d_model
        self.use_bias = bias
        self.normalized = normalized
        self.bias = nn.Parameter(torch.randn(d_model))
        self.pos_emb = PositionalEmbedding(emb_dim, l_max)
        act = Sin(order, w=w)
        layers: list[nn.Module] = [nn.Linear(emb_dim, order), act]
        for _ in range(num_inner_mlps):
            layers += [nn.Linear(order, order), act]
        layers.append(nn.Linear(order, d_model, bias=False))
        self.implicit_filter = nn.Sequential(*layers)
        self.modulation = ExponentialModulation(
            d_model, fast_decay_pct, slow_decay_pct, target, modulate=modulate, shift=shift
        )

    def filter(self, L: int) -> torch.Tensor:
        """The first L taps of the filter, (d_model, L), computed in fp32."""
        if L > self.pos_emb.seq_len:
            raise ValueError(
                f"sequence length {L} exceeds the filter length l_max={self.pos_emb.seq_len}"
            )
        z, t = self.pos_emb(L)  # (1, L, emb_dim), (1, L, 1)
        with torch.autocast(z.device.type, enabled=False):
            h = self.implicit_filter(z.float())  # (1, L, D)
            h = self.modulation(t.float(), h)
            if self.normalized:
                h = h / torch.norm(h, dim=-1, p=1, keepdim=True)
        return h[0].transpose(0, 1)  # (D, L)

    def skip(self) -> torch.Tensor:
        return self.bias if self.use_bias else torch.zeros_like(self.bias)


@dataclass
class HyenaOptions:
    filter_order: int = 64  # width of the implicit filter's MLP (Zoology's and safari's default)
    short_filter_order: int = 3  # taps of the short depthwise filter on the three projections
    num_heads: int = 1  # only 1 is implemented, as in Zoology's LMs and safari's Hyena-153M
    num_blocks: int = 1  # only 1 is implemented
    dropout: float = 0.0  # on the pre-gated value, training only
    filter_dropout: float = 0.0  # accepted as Zoology accepts it: its filter never applies it
    # the implicit filter h = modulation(t, MLP(z)): z holds the time t and (emb_dim - 1) / 2 bands
    emb_dim: int = 3
    w: float = 1.0  # initial frequency of the Sin activations (learned)
    num_inner_mlps: int = 2  # hidden Linear + Sin layers between the first and the last Linear
    normalized: bool = False  # divide h by its L1 norm over the channels
    bias: bool = True  # add the skip term `bias ⊙ u` to the long convolution
    modulate: bool = True  # multiply h by the decay exp(-t |delta|) (+ shift)
    shift: float = 0.0
    # the decay rates span log(target)/slow_decay_pct .. log(target)/fast_decay_pct over channels
    fast_decay_pct: float = 0.3
    slow_decay_pct: float = 1.5
    target: float = 1e-2

    def __post_init__(self):
        if self.num_heads != 1 or self.num_blocks != 1:
            raise ValueError(
                "only num_heads=1, num_blocks=1 Hyena is implemented (as in Zoology's LMs)"
            )

    def filter_kwargs(self) -> dict:
        """The ImplicitFilter arguments among these options."""
        names = ("emb_dim", "w", "num_inner_mlps", "normalized", "bias", "modulate", "shift")
        decay = ("fast_decay_pct", "slow_decay_pct", "target")
        return {k: getattr(self, k) for k in names + decay}


class Hyena(Mixer):
    """Order-2 Hyena: `out_proj(x2 ⊙ (h * (v ⊙ x1) + bias ⊙ (v ⊙ x1)))` with x1, x2, v the short-filtered
    thirds of `in_proj(u)` (Zoology's ordering: first third gates before the long convolution)."""

    Options = HyenaOptions
    mixer_name = "hyena"

    def build(self, opts: HyenaOptions) -> None:
        d_model = self.d_model
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        k = opts.short_filter_order
        self.short_filter = nn.Conv1d(
            3 * d_model, 3 * d_model, kernel_size=k, groups=3 * d_model, padding=k - 1
        )
        self.filter_fn = ImplicitFilter(
            d_model, self.l_max, order=opts.filter_order, **opts.filter_kwargs()
        )
        self.dropout = nn.Dropout(opts.dropout)

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        L = u.shape[1]
        z = self.in_proj(u).transpose(1, 2)  # (B, 3D, L)
        z = self.short_filter(z)[..., :L]  # causal: keep the first L outputs of the padded conv
        x1, x2, v = z.split(self.d_model, dim=1)  # each (B, D, L)
        v = self.dropout(v * x1)
        v = fft_causal_conv(v, self.filter_fn.filter(L), self.filter_fn.skip())  # (B, D, L)
        y = (v * x2).transpose(1, 2)  # (B, L, D)
        return self.out_proj(y)
