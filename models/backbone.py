"""The language model: token (+ optional position) embeddings, pre-norm blocks, final norm, LM head.

Parameter names follow HazyResearch/zoology `zoology/model.py`, so a Zoology state dict loads as is:

    backbone.embeddings.word_embeddings.weight        (V, D)
    backbone.embeddings.position_embeddings.weight    (P, D)   only when max_position_embeddings > 0
    backbone.layers.{i}.sequence_mixer.*              the mixer's own keys (mixers/attention.py, ...)
    backbone.layers.{i}.state_mixer.*                 mixers/mlp.py (fc1, fc2) or RWKV channel mixing
    backbone.layers.{i}.norm1.{weight,bias}, norm2.*
    backbone.ln_f.{weight,bias}
    lm_head.weight                                    tied to the word embeddings (unless untied)

Each block is Zoology's `TransformerBlock`: the residual stream is carried beside the hidden state,
`h = mixer(norm(residual))`, `residual = residual + h`. HazyResearch/based's `GPTModel` (Based,
Transformer++) is the same block with RMSNorm, a SwiGLU state mixer and other sequence mixers on
some layers (`layer_mixers`); `models/checkpoints/based.py` maps its key names onto these.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import StateMixer
from models.options import options_dict, options_from

# name -> (module, class) of every mixer: each lives in its own file, imported when it is built
SEQUENCE_MIXERS: dict[str, tuple[str, str]] = {
    "attention": ("models.mixers.attention", "MHA"),
    "base_conv": ("models.mixers.base_conv", "BaseConv"),
    "hyena": ("models.mixers.hyena", "Hyena"),
    "rwkv": ("models.mixers.rwkv", "RWKVTimeMixer"),
    "based_conv": ("models.mixers.base_conv", "GatedConv"),
    "linear_attention": ("models.mixers.linear_attention", "LinearAttention"),
    "sliding_attention": ("models.mixers.sliding_attention", "SlidingWindowAttention"),
    "h3": ("models.mixers.h3", "H3"),
    "long_conv": ("models.mixers.long_conv", "LongConv"),
    "implicit_long_conv": ("models.mixers.long_conv", "ImplicitLongConv"),
    "retnet": ("models.mixers.retnet", "MultiScaleRetention"),
    "prefix_linear_attention": ("models.mixers.prefix_linear_attention", "PrefixLinearAttention"),
}
# "rwkv" as a state mixer is RWKV-4's channel mixing; "base_conv" is a second BaseConv, as the
# Zoology of 2023-10-28 .. 2023-11-20 built every block's state mixer from the sequence mixer's config
STATE_MIXERS: dict[str, tuple[str, str]] = {
    "mlp": ("models.mixers.mlp", "MLP"),
    "glu": ("models.mixers.mlp", "GLU"),
    "swiglu": ("models.mixers.mlp", "SwiGLU"),
    "gated_ffn": ("models.mixers.mlp", "GatedFFN"),
    "rwkv": ("models.mixers.rwkv", "RWKVChannelMixer"),
    "identity": ("models.backbone", "IdentityMixer"),
    "base_conv": SEQUENCE_MIXERS["base_conv"],
}
MIXERS = {"sequence": SEQUENCE_MIXERS, "state": STATE_MIXERS}
NORMS = ("layernorm", "rmsnorm")


def check_mixer(kind: str, name: Any) -> None:
    """Refuse a `kind` ("sequence" or "state") mixer name that is not in its table."""
    table = MIXERS[kind]
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"unknown {kind} mixer {name!r}; choose one of {', '.join(table)}")


def mixer_class(kind: str, name: str) -> type[nn.Module]:
    """The class behind a `kind` ("sequence" or "state") mixer name."""
    check_mixer(kind, name)
    module, cls = MIXERS[kind][name]
    return getattr(importlib.import_module(module), cls)


def resolved_options(kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every option of mixer `name` (kind "sequence" or "state"), defaults filled in; unknown
    keys are refused by name (ArSliceError)."""
    cls = mixer_class(kind, name)
    return options_dict(options_from(cls.Options, options, f"{kind} mixer {name!r}"))


class IdentityMixer(StateMixer):
    """No state mixing (a Zoology `torch.nn.Identity` state mixer); it takes no options."""

    mixer_name = "identity"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class ModelConfig:
    """Everything needed to rebuild a `LanguageModel`; saved as `config.json` by `save_native`."""

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    # one of SEQUENCE_MIXERS
    sequence_mixer: str = "attention"
    # the mixer's options (its `Options` dataclass), e.g. {"num_heads": 4} for attention,
    # {"kernel_size": 3} for base_conv; stored resolved, every option with its value
    sequence_mixer_kwargs: dict[str, Any] = field(default_factory=dict)
    # None picks RWKV channel mixing for "rwkv" (an RWKV-4 block) and the MLP for the others
    state_mixer: str | None = None
    # e.g. {"hidden_mult": 4} (the MLP's default, as in GPT-2 / Pythia; Zoology's MLP default is 1)
    state_mixer_kwargs: dict[str, Any] = field(default_factory=dict)
    # longest sequence the model is built for: Hyena's implicit filter length, attention's context
    l_max: int = 2048
    # learned absolute positions as in Zoology's TokenEmbeddings; None = l_max for attention
    # (which has no other notion of order) and 0 (none) for the convolutional/recurrent mixers
    max_position_embeddings: int | None = None
    layer_norm_epsilon: float = 1e-5
    # epsilon of the blocks' norm1/norm2; None = layer_norm_epsilon (safari, this project).
    # Zoology's TransformerBlock builds them with LayerNorm's 1e-5 whatever layer_norm_epsilon
    # says and uses that for ln_f alone
    block_norm_epsilon: float | None = None
    # False: a separate lm_head.weight (Zoology with learnable_word_embeddings=False)
    tie_word_embeddings: bool = True
    # round the vocabulary up (e.g. 8 for GPT-2's 50257 -> 50264, as safari does) for fast matmuls
    pad_vocab_size_multiple: int = 1
    embed_dropout: float = 0.0
    resid_dropout: float = 0.0
    # "layernorm" (Zoology, GPT-2) or "rmsnorm" (Based, Transformer++; weight only)
    norm: str = "layernorm"
    # keep the residual stream in fp32 under a bf16/fp16 model, as HazyResearch/based trains it
    residual_in_fp32: bool = False
    # other sequence mixers on some layers, e.g. Based's
    # [{"layers": [1, 6], "name": "linear_attention", "kwargs": {...}}]; later entries win
    layer_mixers: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self):
        for name in [self.sequence_mixer] + [m.get("name") for m in self.layer_mixers]:
            check_mixer("sequence", name)
        if self.norm not in NORMS:
            raise ValueError(f"unknown norm {self.norm!r}; choose one of {', '.join(NORMS)}")
        if self.state_mixer is None:
            self.state_mixer = "rwkv" if self.sequence_mixer == "rwkv" else "mlp"
        check_mixer("state", self.state_mixer)
        self.sequence_mixer_kwargs = resolved_options(
            "sequence", self.sequence_mixer, self.sequence_mixer_kwargs
        )
        self.layer_mixers = [
            {**m, "kwargs": resolved_options("sequence", m["name"], m.get("kwargs") or {})}
            for m in self.layer_mixers
        ]
        self.state_mixer_kwargs = resolved_options(
            "state", self.state_mixer, self.state_mixer_kwargs
        )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.l_max if self.sequence_mixer == "attention" else 0

    def mixer_of_layer(self, layer_idx: int) -> tuple[str, dict[str, Any]]:
        """(sequence-mixer name, its kwargs) of one layer: `layer_mixers` over the default."""
        for entry in reversed(self.layer_mixers):
            if layer_idx in entry["layers"]:
                return entry["name"], dict(entry.get("kwargs") or {})
        return self.sequence_mixer, dict(self.sequence_mixer_kwargs)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {', '.join(sorted(unknown))}")
        return cls(**data)


class TokenEmbeddings(nn.Module):
    """Word embeddings plus optional learned absolute position embeddings (Zoology `TokenEmbeddings`)."""

    def __init__(self, d_model: int, vocab_size: int, max_position_embeddings: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, d_model)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, d_model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)  # (B, T, D)
        if self.max_position_embeddings > 0:
            T = input_ids.shape[1]
            if T > self.max_position_embeddings:
                raise ValueError(
                    f"sequence length {T} exceeds the model's {self.max_position_embeddings} positions"
                )
            x = x + self.position_embeddings(torch.arange(T, device=input_ids.device))
        return x


def make_norm(config: ModelConfig, eps: float | None = None) -> nn.Module:
    eps = config.layer_norm_epsilon if eps is None else eps
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=eps)
    return nn.LayerNorm(config.d_model, eps=eps)


class Block(nn.Module):
    """Pre-norm block: sequence mixer then state mixer, each reading the normalised residual.

    Every mixer is built as `cls(d_model, l_max, layer_idx, n_layers, **options)`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        mixer, mixer_kwargs = config.mixer_of_layer(layer_idx)
        shape = dict(
            d_model=config.d_model,
            l_max=config.l_max,
            layer_idx=layer_idx,
            n_layers=config.n_layers,
        )
        self.sequence_mixer = mixer_class("sequence", mixer)(**shape, **mixer_kwargs)
        self.state_mixer = mixer_class("state", config.state_mixer)(
            **shape, **config.state_mixer_kwargs
        )
        self.dropout1 = nn.Dropout(config.embed_dropout if layer_idx == 0 else config.resid_dropout)
        self.norm1 = make_norm(config, config.block_norm_epsilon)
        self.dropout2 = nn.Dropout(config.resid_dropout)
        self.norm2 = make_norm(config, config.block_norm_epsilon)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        dropped = self.dropout1(hidden)
        residual = dropped if residual is None else residual + dropped
        hidden = self.sequence_mixer(self.norm1(residual.to(self.norm1.weight.dtype)))
        if self.residual_in_fp32:
            residual = residual.float()
        residual = residual + self.dropout2(hidden)
        hidden = self.state_mixer(self.norm2(residual.to(self.norm2.weight.dtype)))
        return hidden, residual


class LMBackbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embeddings = TokenEmbeddings(
            config.d_model, config.padded_vocab_size, config.max_position_embeddings
        )
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.drop_f = nn.Dropout(config.resid_dropout)
        self.ln_f = make_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)  # (B, T, D)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        residual = self.drop_f(hidden) + residual if residual is not None else hidden
        return self.ln_f(residual.to(self.ln_f.weight.dtype))  # (B, T, D)


def _init_weights(module: nn.Module, n_layers: int, initializer_range: float = 0.02) -> None:
    """GPT-2 / Zoology initialisation, applied to every Linear and Embedding as Zoology does."""
    if isinstance(module, nn.Linear):
        std = initializer_range
        if getattr(module, "is_residual_out", False):
            # two residual additions per block: scale the branch outputs by 1/sqrt(2 n_layers)
            std = initializer_range / math.sqrt(2 * n_layers)
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)


class LanguageModel(nn.Module):
    """A causal LM over one of the sequence mixers, with the Zoology state-dict layout.

    forward(input_ids (B, T) long, targets=None, loss_reduction="mean"):
      - targets None: logits (B, T, V_padded) in the compute dtype;
      - targets (B, T) long (-1 = ignore) and loss_reduction "mean": scalar mean cross-entropy (fp32);
      - loss_reduction "none": per-token NLL (B, T) float32 (0 where ignored), computed in chunks
        so no (B, T, V) fp32 tensor is built (see `models.nll`).
    `hidden_and_head(input_ids)` -> (final hidden (B, T, D), head weight (V, D), head bias None).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.backbone = LMBackbone(config)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        for name, module in self.named_modules():
            if name.endswith(("out_proj", "fc2", "fc3")) and isinstance(module, nn.Linear):
                module.is_residual_out = True
        self.apply(lambda m: _init_weights(m, config.n_layers))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.word_embeddings.weight

    def hidden_and_head(self, input_ids: torch.Tensor):
        return self.backbone(input_ids), self.lm_head.weight, None

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_reduction: str = "mean",
    ) -> torch.Tensor:
        if targets is None:
            return self.lm_head(self.backbone(input_ids))
        if loss_reduction == "none":
            from models.nll import chunked_nll

            hidden = self.backbone(input_ids)
            return chunked_nll(hidden, self.lm_head.weight, None, targets)
        if loss_reduction != "mean":
            raise ValueError(f"loss_reduction must be 'mean' or 'none', not {loss_reduction!r}")
        logits = self.lm_head(self.backbone(input_ids))
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1
        )

    def num_params(self) -> int:
        """Parameters counted once (the tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())
