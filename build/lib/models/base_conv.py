"""BaseConv (Arora et al., 2023, "Zoology", §4): `y = (u W + b1) ⊙ conv(u) + u`, as in Zoology's
`zoology/mixers/base_conv.py` and `convolution.py`.

`conv` is a short causal depthwise convolution with bias (`kernel_size` taps; the
`(h * u + b2)` of the paper) or, with `kernel_size=-1`, a long convolution `h * u + u` over the
whole sequence: Zoology's implicit one (a Hyena-style filter; its `bias` parameter exists but, as
in Zoology, is not applied: the FFT path adds `u` itself) or, with `implicit_long_conv=False`, its
explicit `LongConvolution` (one learned filter tap per channel and position, key `conv.filter`).

`GatedConv` is the BaseConv of the Based LM (HazyResearch/based
`based/models/mixers/convolution.py`): `out_proj(silu(conv(u1)) ⊙ u2)` with `(u1, u2)` the two
halves of `in_proj(u)` and a bias-free short convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.hyena import ImplicitFilter, fft_causal_conv


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


class ImplicitLongConvolution(ImplicitFilter):
    """Long causal convolution with an implicit filter; `y = h * u + u` (Zoology's fft_conv)."""

    def __init__(
        self,
        d_model: int,
        l_max: int,
        emb_dim: int = 3,
        order: int = 16,
        frequency: float = 1.0,
        **kw,
    ):
        super().__init__(d_model, l_max, emb_dim=emb_dim, order=order, w=frequency, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        u = x.transpose(1, 2)  # (B, D, L)
        ones = torch.ones(self.d_model, device=x.device)
        return fft_causal_conv(u, self.filter(L), ones).transpose(1, 2)  # (B, L, D)


class LongConvolution(nn.Module):
    """Long causal convolution with an explicit filter `(d_model, l_max)`; `y = h * u + u`.

    For a sequence of length L the first L taps are used. Zoology's `fft_conv` zero-pads to 2L but
    keeps up to 2L taps, so for L < l_max its taps L..2L-1 wrap around and let later inputs reach
    earlier outputs; at L = l_max (the length it trains at) the two agree exactly, and here every
    length is causal.
    """

    def __init__(self, d_model: int, l_max: int, **kwargs):
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


class BaseConv(nn.Module):
    """`projection(u) ⊙ conv(u) + u` (optionally with SiLU on both factors)."""

    def __init__(
        self,
        d_model: int,
        l_max: int,
        layer_idx: int | None = None,
        kernel_size: int | list[int] = 3,
        implicit_long_conv: bool = True,
        use_act: bool = False,
        **kwargs,
    ):
        super().__init__()
        kwargs.pop("n_layers", None)
        self.d_model = d_model
        self.l_max = l_max
        self.layer_idx = layer_idx
        self.use_act = use_act
        if isinstance(kernel_size, (list, tuple)):  # one kernel size per layer, as Zoology allows
            if layer_idx is None or layer_idx >= len(kernel_size):
                raise ValueError("a list kernel_size needs one entry per layer")
            kernel_size = kernel_size[layer_idx]
        self.projection = nn.Linear(d_model, d_model)
        if kernel_size == -1 and implicit_long_conv:
            self.conv = ImplicitLongConvolution(d_model, l_max=l_max, **kwargs)
        elif kernel_size == -1:
            self.conv = LongConvolution(d_model, l_max=l_max)
        else:
            self.conv = ShortConvolution(d_model, kernel_size=kernel_size)

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        u_conv = self.conv(u)  # (B, L, D)
        u_proj = self.projection(u)  # (B, L, D)
        if self.use_act:
            return F.silu(u_conv) * F.silu(u_proj) + u
        return u_conv * u_proj + u


class GatedConv(nn.Module):
    """Based's BaseConv: `out_proj(silu(conv(u1)) ⊙ u2)`, `(u1, u2) = in_proj(u)` split in halves."""

    def __init__(
        self,
        d_model: int,
        l_max: int | None = None,
        layer_idx: int | None = None,
        kernel_size: int = 3,
        expand_proj: int = 2,  # in_proj width / d_model; Based's LMs use 4 (u1, u2 of 2 d_model)
        bias: bool = True,  # on in_proj and out_proj
        conv_bias: bool = False,  # Based's convolution has none (its causal_conv1d path has one)
        **kwargs,
    ):
        super().__init__()
        if expand_proj * d_model % 2:
            raise ValueError(f"expand_proj {expand_proj} x d_model {d_model} must be even")
        self.d_model = d_model
        self.layer_idx = layer_idx
        self.d_inner = expand_proj * d_model // 2
        self.in_proj = nn.Linear(d_model, expand_proj * d_model, bias=bias)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        self.conv = ShortConvolution(self.d_inner, kernel_size=kernel_size, bias=conv_bias)

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        u1, u2 = self.in_proj(u).split(self.d_inner, dim=-1)  # each (B, L, d_inner)
        return self.out_proj(F.silu(self.conv(u1)) * u2)  # (B, L, D)
