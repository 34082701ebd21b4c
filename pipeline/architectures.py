"""The architectures this project trains, in one table: which `arslice train --arch` takes, which
`arslice mqar --archs` takes and which its default sweep trains (the panel docs/ shows), and
what each is. The trainer's and the MQAR sweep's choices and help texts read it.

The names are sequence mixers of `models/` (`models.backbone.SEQUENCE_MIXERS`), plus two recipes:
"transformer_pp", attention in the Transformer++ recipe (rotary, SwiGLU, RMSNorm, no biases;
`pipeline.train.model.TRANSFORMER_PP`), the attention baseline HazyResearch/based and later
gated-convolution papers compare against; and "based", Based's pair of a short gated
convolution and Taylor linear attention (`pipeline.mqar.build_model`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    name: str
    what: str
    train: bool = True  # `arslice train --arch` takes it
    mqar: bool = True  # `arslice mqar --archs` takes it
    mqar_default: bool = False  # the default MQAR sweep trains it


ARCHITECTURE_TABLE = (
    Architecture("attention", "softmax attention", mqar_default=True),
    Architecture("base_conv", "BaseConv (gated convolution)", mqar_default=True),
    Architecture("hyena", "Hyena", mqar_default=True),
    Architecture("rwkv", "RWKV-4 time mixing", mqar_default=True),
    Architecture("transformer_pp", "attention with rotary, SwiGLU, RMSNorm, no biases", mqar=False),
    Architecture("based", "Based: short gated convolution + Taylor linear attention", train=False,
                 mqar_default=True),
    # the paper's other Table 1 rows, and RetNet's retention
    Architecture("h3", "H3 (shift and diagonal SSMs)"),
    Architecture("long_conv", "long convolution, explicit filters"),
    Architecture("implicit_long_conv", "long convolution, implicit filters"),
    Architecture("retnet", "multi-scale retention (RetNet)"),
)  # fmt: skip

TRAIN_ARCHITECTURES = [a.name for a in ARCHITECTURE_TABLE if a.train]
MQAR_ARCHITECTURES = [a.name for a in ARCHITECTURE_TABLE if a.mqar]
MQAR_DEFAULT = [a.name for a in ARCHITECTURE_TABLE if a.mqar_default]


def described(names: list[str]) -> str:
    """`name (what), ...` for help texts."""
    what = {a.name: a.what for a in ARCHITECTURE_TABLE}
    return ", ".join(f"{n} ({what[n]})" for n in names)
