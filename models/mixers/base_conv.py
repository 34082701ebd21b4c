"""BaseConv (Arora et al., 2023, "Zoology", §4): `y = (u W + b1) ⊙ conv(u) + u`, as in Zoology's
`zoology/mixers/base_conv.py` and `convolution.py`.

`conv` is a short causal depthwise convolution with bias (`kernel_size` taps; the
`(h * u + b2)` of the paper) or, with `kernel_size=-1`, a long convolution `h * u + u` over the
whole sequence, in one of Zoology's three forms (each with its own keys):

    implicit_filter="mlp"    Zoology since 2023-10-29: h = Linear-ReLU-Linear of the positional
                             features (`conv.pos_emb.z`, `conv.mlp.{0,2}.*`)
    implicit_filter="hyena"  Zoology before 2023-10-29: Hyena's Sin MLP with exponential decay
                             (`conv.implicit_filter.*`, `conv.modulation.deltas`; its `conv.bias`
                             exists but, as there, is not applied: the FFT path adds `u` itself)
    implicit_long_conv=False Zoology's explicit `LongConvolution`: one learned tap per channel and
                             position (`conv.filter`)

Zoology's BaseConv passes none of its own options to these filters, so their sizes are Zoology's
defaults (3 positional features, a 16-wide MLP).

`GatedConv` is the BaseConv of the Based LM (HazyResearch/based
`based/models/mixers/convolution.py`): `out_proj(silu(conv(u1)) ⊙ u2)` with `(u1, u2)` the two
halves of `in_proj(u)` and a bias-free short convolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import Mixer
from models.mixers.hyena import ImplicitFilter, PositionalEmbedding, fft_causal_conv

IMPLICIT_FILTERS = ("mlp", "hyena")


class ShortConvolution(nn.Module):
    """Causal depthwise Conv1d over time (Zoology key: `conv.conv.{weight,bias}`)."""

    def __init__(self, d_model: int, kernel_size: int, bias: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(
            d_model,
            d_model,
            kernel_size=kernel_size,
            groups=d_model,
            padding=kernel_size - 1,
            bias=bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        weight = self.conv.weight[:, 0]  # (D, K)
        K = weight.shape[-1]
        if K > 16:  # long kernels: one convolution over the left-padded, channel-first input
            y = F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), self.conv.weight, groups=x.shape[2])
            y = y.transpose(1, 2)  # (B, L, D)
        else:  # a few taps: K shifted multiply-adds, several times faster than Conv1d on a CPU
            padded = F.pad(x, (0, 0, K - 1, 0))  # (B, K-1+L, D)
            y = padded[:, K - 1 :] * weight[:, K - 1]
            for k in range(K - 1):
                y = y + padded[:, k : k + L] * weight[:, k]
        return y if self.conv.bias is None else y + self.conv.bias


class _LongConvolution(nn.Module):
    """`y = h * u + u` for a filter `filter(L)` of shape (d_model, L)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        u = x.transpose(1, 2)  # (B, D, L)
        ones = torch.ones(self.d_model, device=x.device)
        return fft_causal_conv(u, self.filter(L), ones).transpose(1, 2)  # (B, L, D)


class ImplicitLongConvolution(_LongConvolution):
    """Zoology's implicit filter since 2023-10-29: `h = mlp(z)`, Linear(3, 16)-ReLU-Linear(16, D)."""

    def __init__(self, d_model: int, l_max: int, d_emb: int = 3, d_hidden: int = 16):
        super().__init__()
        self.d_model = d_model
        self.pos_emb = PositionalEmbedding(d_emb, l_max, with_time=False)
        self.mlp = nn.Sequential(
            nn.Linear(d_emb, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_model)
        )

    def filter(self, L: int) -> torch.Tensor:
        """The first L taps, (d_model, L), computed in fp32."""
        if L > self.pos_emb.seq_len:
            raise ValueError(
                f"sequence length {L} exceeds the filter length l_max={self.pos_emb.seq_len}"
            )
        z, _ = self.pos_emb(L)  # (1, L, d_emb)
        with torch.autocast(z.device.type, enabled=False):
            return self.mlp(z.float())[0].transpose(0, 1)  # (D, L)


class HyenaImplicitLongConvolution(ImplicitFilter, _LongConvolution):
    """Zoology's implicit filter before 2023-10-29: Hyena's `h = modulation(t, SinMLP(z))`; `y = h * u + u`."""

    def __init__(self, d_model: int, l_max: int):
        super().__init__(d_model, l_max, emb_dim=3, order=16, w=1.0)


class LongConvolution(nn.Module):
    """Long causal convolution with an explicit filter `(d_model, l_max)`; `y = h * u + u`.

    For a sequence of length L the first L taps are used. Zoology's `fft_conv` zero-pads to 2L but
    keeps up to 2L taps, so for L < l_max its taps L..2L-1 wrap around and let later inputs reach
    earlier outputs; at L = l_max (the length it trains at) the two agree exactly, and here every
    length is causal: a window shorter than l_max gets what Zoology computes for it inside an
    l_max-long input.
    """

    def __init__(self, d_model: int, l_max: int):
        super().__init__()
        self.d_model = d_model
        self.l_max = l_max
        self.filter = nn.Parameter(torch.randn(d_model, l_max))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        if L > self.l_max:
            raise ValueError(
                f"sequence of {L} tokens is longer than the filter (l_max={self.l_max})"
            )
        u = x.transpose(1, 2)  # (B, D, L)
        ones = torch.ones(self.d_model, device=x.device)
        return fft_causal_conv(u, self.filter[:, :L], ones).transpose(1, 2)  # (B, L, D)


@dataclass
class BaseConvOptions:
    # taps of the short convolution; -1 = a long convolution over the whole sequence; a list
    # gives one value per layer (Zoology's [3, -1, 3, -1] alternates short and long)
    kernel_size: int | list[int] = 3
    implicit_long_conv: bool = True  # kernel_size -1: an implicit filter, else an explicit one
    implicit_filter: str = "mlp"  # which implicit filter: "mlp" (Zoology now) or "hyena" (before)
    use_act: bool = False  # SiLU on both factors

    def __post_init__(self):
        if self.implicit_filter not in IMPLICIT_FILTERS:
            raise ValueError(
                f"implicit_filter {self.implicit_filter!r}: choose one of {', '.join(IMPLICIT_FILTERS)}"
            )

    def kernel_size_of(self, layer_idx: int | None) -> int:
        if isinstance(self.kernel_size, (list, tuple)):  # one kernel size per layer
            if layer_idx is None or layer_idx >= len(self.kernel_size):
                raise ValueError("a list kernel_size needs one entry per layer")
            return int(self.kernel_size[layer_idx])
        return int(self.kernel_size)


class BaseConv(Mixer):
    """`projection(u) ⊙ conv(u) + u` (optionally with SiLU on both factors)."""

    Options = BaseConvOptions
    mixer_name = "base_conv"

    def build(self, opts: BaseConvOptions) -> None:
        d_model, l_max = self.d_model, self.l_max
        self.use_act = opts.use_act
        kernel_size = opts.kernel_size_of(self.layer_idx)
        self.projection = nn.Linear(d_model, d_model)
        if kernel_size == -1 and not opts.implicit_long_conv:
            self.conv = LongConvolution(d_model, l_max=l_max)
        elif kernel_size == -1 and opts.implicit_filter == "hyena":
            self.conv = HyenaImplicitLongConvolution(d_model, l_max=l_max)
        elif kernel_size == -1:
            self.conv = ImplicitLongConvolution(d_model, l_max=l_max)
        else:
            self.conv = ShortConvolution(d_model, kernel_size=kernel_size)

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        u_conv = self.conv(u)  # (B, L, D)
        u_proj = self.projection(u)  # (B, L, D)
        if self.use_act:
            return F.silu(u_conv) * F.silu(u_proj) + u
        return u_conv * u_proj + u


@dataclass
class GatedConvOptions:
    kernel_size: int = 3
    expand_proj: int = 2  # in_proj width / d_model; Based's LMs use 4 (u1, u2 of 2 d_model)
    bias: bool = True  # on in_proj and out_proj
    conv_bias: bool = False  # Based's convolution has none (its causal_conv1d path has one)


class GatedConv(Mixer):
    """Based's BaseConv: `out_proj(silu(conv(u1)) ⊙ u2)`, `(u1, u2) = in_proj(u)` split in halves."""

    Options = GatedConvOptions
    mixer_name = "based_conv"

    def build(self, opts: GatedConvOptions) -> None:
        d_model = self.d_model
        if opts.expand_proj * d_model % 2:
            raise ValueError(f"expand_proj {opts.expand_proj} x d_model {d_model} must be even")
        self.d_inner = opts.expand_proj * d_model // 2
        self.in_proj = nn.Linear(d_model, opts.expand_proj * d_model, bias=opts.bias)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=opts.bias)
        self.conv = ShortConvolution(
            self.d_inner, kernel_size=opts.kernel_size, bias=opts.conv_bias
        )

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        u1, u2 = self.in_proj(u).split(self.d_inner, dim=-1)  # each (B, L, d_inner)
        return self.out_proj(F.silu(self.conv(u1)) * u2)  # (B, L, D)
