"""Tiny randomly initialised models, built from a seed and saved as their loaders read them: a
transformers GPT-NeoX (`save_pretrained`) and this project's LM (`native`), each with the
tokenizer.json it is scored with beside it. The tests and the eval benchmark build theirs here."""

from __future__ import annotations

import shutil
from pathlib import Path

# a GPT-NeoX as small as a test wants, unless it says otherwise
TINY_NEOX = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
# what a tiny model of a mixer takes besides its defaults: a narrower Hyena filter MLP
TINY_MIXER_OPTIONS = {"hyena": {"filter_order": 16}}


def neox_lm(vocab_size: int, *, seed: int = 0, **shape):
    """A transformers GPT-NeoX of `TINY_NEOX` (what `shape` names replaced) drawn from `seed`."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    config = GPTNeoXConfig(vocab_size=vocab_size, **{**TINY_NEOX, **shape})
    return GPTNeoXForCausalLM(config).eval()


def save_neox(path: Path, vocab_size: int, *, tokenizer=None, **lm) -> Path:
    """`neox_lm(vocab_size, **lm)` saved under `path` with `save_pretrained`, the tokenizer.json
    `tokenizer` (when given) copied beside it."""
    neox_lm(vocab_size, **lm).save_pretrained(path)
    if tokenizer is not None:
        shutil.copy(tokenizer, Path(path) / "tokenizer.json")
    return Path(path)


def native_lm(
    vocab_size: int,
    *,
    mixer: str = "attention",
    d_model: int = 32,
    l_max: int = 128,
    seed: int = 0,
    spread: float | None = None,
    **mixer_options,
):
    """A two-block `LanguageModel` of `mixer` drawn from `seed`; `spread` redraws the word
    embeddings from N(0, spread), for logits wide enough that a misaligned target shows."""
    import torch

    from models.backbone import LanguageModel, ModelConfig

    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=2,
        sequence_mixer=mixer,
        sequence_mixer_kwargs=mixer_options,
        l_max=l_max,
    )
    model = LanguageModel(config)
    if spread is not None:
        with torch.no_grad():
            model.backbone.embeddings.word_embeddings.weight.normal_(0, spread)
    return model


def tiny_mixer_lm(mixer: str, vocab_size: int, *, d_model: int, l_max: int):
    """`native_lm` of `mixer` with the options a tiny model of it takes (seed 0)."""
    return native_lm(
        vocab_size, mixer=mixer, d_model=d_model, l_max=l_max, **TINY_MIXER_OPTIONS.get(mixer, {})
    )


def save_native_lm(out: Path, vocab_size: int, *, tokenizer=None, **lm) -> Path:
    """`native_lm(vocab_size, **lm)` in eval mode, saved under `out` in the native format."""
    from models.checkpoints.native import save_native

    return save_native(native_lm(vocab_size, **lm).eval(), out, tokenizer_json=tokenizer)
