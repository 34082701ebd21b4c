"""What every mixer shares: Zoology's mixer signature, `(d_model, l_max, layer_idx=None, **kwargs)`
(plus the depth some initialisations read), with the keyword options resolved once into the
mixer's own `Options` dataclass before `build` makes its layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from models.options import options_from


@dataclass
class NoOptions:
    pass  # a mixer without options refuses every key


class Mixer(nn.Module):
    """A sequence mixer, (B, T, D) -> (B, T, D).

    A subclass declares its `Options` (a `@dataclass`: one field per keyword option, each default
    with the reason for it), its `mixer_name` (the name configs use and messages show) and
    `build(opts)`, which makes its layers; `__init__` is this one. A key `Options` does not define
    is refused by name: "sequence mixer 'hyena': unknown option 'filter_ordr'; it accepts ...".
    """

    Options: ClassVar[type] = NoOptions
    kind: ClassVar[str] = "sequence mixer"
    mixer_name: ClassVar[str]

    def __init__(
        self,
        d_model: int,
        l_max: int | None = None,
        layer_idx: int | None = None,
        n_layers: int = 1,
        **options: Any,
    ):
        super().__init__()
        self.options = options_from(self.Options, options, f"{self.kind} {self.mixer_name!r}")
        self.d_model = d_model
        self.l_max = l_max  # the longest sequence it is built for (filter length, positions)
        self.layer_idx = layer_idx
        self.n_layers = n_layers  # the depth: RWKV-4's initialisation depends on it
        self.build(self.options)

    def build(self, opts) -> None:
        """Make the layers for the resolved options `opts` (`self.options`); none by default."""


class StateMixer(Mixer):
    """A state mixer (the MLP, GLU, RWKV-4 channel mixing): per token, the same signature."""

    kind = "state mixer"
