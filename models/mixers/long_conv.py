"""Long convolutions as sequence mixers on their own, the "Long Conv" row of Zoology's Table 1:
Zoology's `LongConvolution` and `ImplicitLongConvolution` (`zoology/mixers/convolution.py`) used
directly as a block's sequence mixer, with their key names (`filter`; `pos_emb.z`, `mlp.{0,2}.*`).

Both compute `y = h * u + u`, a causal depthwise convolution over the whole sequence by FFT plus
the input: `long_conv` learns every tap of `h` (d_model, l_max), after Fu et al., 2023, "Simple
Hardware-Efficient Long Convolutions" (arXiv:2302.06646); `implicit_long_conv` computes `h` from
the positions by a Linear-ReLU-Linear MLP. The convolutions themselves are BaseConv's long filters
(base_conv.py), so the two stay one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.mixers.base import Mixer
from models.mixers.base_conv import ImplicitLongConvolution, LongConvolution


class LongConv(Mixer):
    """`y = h * u + u` with an explicit filter of one learned tap per channel and position."""

    mixer_name = "long_conv"

    def build(self, opts) -> None:
        self.filter = nn.Parameter(torch.randn(self.d_model, self.l_max))  # (D, l_max)

    # the first L taps of `filter`, causal at every length (see LongConvolution)
    forward = LongConvolution.forward


@dataclass
class ImplicitLongConvOptions:
    d_emb: int = (
        3  # positional features: time and (d_emb - 1) / 2 complex bands (Zoology's default)
    )
    d_hidden: int = 16  # width of the filter MLP (Zoology's default)

    def __post_init__(self):
        if self.d_emb % 2 == 0 or self.d_emb < 3:
            raise ValueError(f"d_emb must be odd and >= 3 (time, cosine, sine), got {self.d_emb}")


class ImplicitLongConv(Mixer):
    """`y = h * u + u` with `h = mlp(z)`, z the positional features of `pos_emb`."""

    Options = ImplicitLongConvOptions
    mixer_name = "implicit_long_conv"

    def build(self, opts: ImplicitLongConvOptions) -> None:
        conv = ImplicitLongConvolution(self.d_model, self.l_max, opts.d_emb, opts.d_hidden)
        self.pos_emb, self.mlp = conv.pos_emb, conv.mlp

    filter = ImplicitLongConvolution.filter
    forward = ImplicitLongConvolution.forward
