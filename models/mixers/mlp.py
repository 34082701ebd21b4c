"""State mixers: the two-layer MLP and the GLU of Zoology's `zoology/mixers/mlp.py` (keys fc1, fc2[, fc3]),
the SwiGLU of flash-attn / HazyResearch/based's `GatedMlp` (one fused `fc1`, then `fc2`), and
torchscale's RetNet FFN (`GatedFFN`: keys fc1, fc2, gate)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import StateMixer

ACTIVATIONS = {
    "gelu": F.gelu,  # Zoology's default (exact erf form)
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # safari / flash-attn `Mlp`
    "relu": F.relu,
    "silu": F.silu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}"
        ) from None


@dataclass
class MLPOptions:
    hidden_mult: int = 4  # GPT-style width; Zoology's own default is 1 but its LM configs use 4
    activation: str = "gelu"  # one of ACTIVATIONS
    hidden: int | None = None  # an explicit width (safari's d_inner needs no multiple of d_model)

    def __post_init__(self):
        get_activation(self.activation)


def hidden_width(d_model: int, opts: MLPOptions | SwiGLUOptions | GatedFFNOptions) -> int:
    """The hidden width: `opts.hidden` when given, else `d_model * opts.hidden_mult`."""
    return d_model * opts.hidden_mult if opts.hidden is None else opts.hidden


class MLP(StateMixer):
    """`fc2(act(fc1(x)))` with hidden width `hidden`, or `d_model * hidden_mult` without one."""

    Options = MLPOptions
    mixer_name = "mlp"

    def build(self, opts: MLPOptions) -> None:
        hidden = hidden_width(self.d_model, opts)
        self.fc1 = nn.Linear(self.d_model, hidden)
        self.fc2 = nn.Linear(hidden, self.d_model)
        self.act = get_activation(opts.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GLU(StateMixer):
    """Gated linear unit: `fc3(fc1(x) * act(fc2(x)))`."""

    Options = MLPOptions
    mixer_name = "glu"

    def build(self, opts: MLPOptions) -> None:
        hidden = hidden_width(self.d_model, opts)
        self.fc1 = nn.Linear(self.d_model, hidden)
        self.fc2 = nn.Linear(self.d_model, hidden)
        self.fc3 = nn.Linear(hidden, self.d_model)
        self.act = get_activation(opts.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc1(x) * self.act(self.fc2(x)))


@dataclass
class SwiGLUOptions:
    hidden: int | None = None  # None: d_model * hidden_mult
    hidden_mult: int = 4
    fc1_bias: bool = True
    fc2_bias: bool = True


class SwiGLU(StateMixer):
    """`fc2(y ⊙ silu(gate))` with `(y, gate)` the two halves of `fc1(x)` (Shazeer, 2020; flash-attn
    `GatedMlp`, the MLP of HazyResearch/based's Based and Transformer++)."""

    Options = SwiGLUOptions
    mixer_name = "swiglu"

    def build(self, opts: SwiGLUOptions) -> None:
        hidden = hidden_width(self.d_model, opts)
        self.fc1 = nn.Linear(self.d_model, 2 * hidden, bias=opts.fc1_bias)
        self.fc2 = nn.Linear(hidden, self.d_model, bias=opts.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, gate = self.fc1(x).chunk(2, dim=-1)  # each (B, T, hidden)
        return self.fc2(y * F.silu(gate))  # (B, T, D)


@dataclass
class GatedFFNOptions:
    hidden: int | None = None  # None: d_model * hidden_mult (torchscale sets decoder_ffn_embed_dim)
    hidden_mult: int = 2  # the RetNet paper's FFN width
    activation: str = "gelu"  # torchscale's default activation_fn (exact erf GELU)

    def __post_init__(self):
        get_activation(self.activation)


class GatedFFN(StateMixer):
    """torchscale's `GLU` (RetNet's FFN): `fc2(act(fc1(x)) ⊙ gate(x))`, no biases."""

    Options = GatedFFNOptions
    mixer_name = "gated_ffn"

    def build(self, opts: GatedFFNOptions) -> None:
        hidden = hidden_width(self.d_model, opts)
        self.fc1 = nn.Linear(self.d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, self.d_model, bias=False)
        self.gate = nn.Linear(self.d_model, hidden, bias=False)
        self.act = get_activation(opts.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x).float()).to(x.dtype) * self.gate(x))
