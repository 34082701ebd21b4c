"""Checks that a model fits the tagged store: tokenizer, vocabulary and positional limit."""

from __future__ import annotations

import logging

import numpy as np

from ar_slicing.data.tokenizer import require_same_fingerprint
from ar_slicing.errors import ArSliceError
from pipeline.eval.config import EvalConfig
from pipeline.eval.inputs import TagsInput

log = logging.getLogger(__name__)


def check_model_fits(
    loaded, tags: TagsInput, n_windows: int, cfg: EvalConfig, prefix: int | None = None
) -> int:
    """Tokenizer, vocabulary and positional-limit checks (`prefix`: the rolling windows' prefix
    token). Returns the largest token id read."""
    store = tags.store
    model_fp = getattr(loaded, "tokenizer_fingerprint", None)
    if model_fp is not None and model_fp != store.fingerprint:
        if cfg.skip_tokenizer_check:
            log.warning(
                "model tokenizer %s… differs from the store's %s…; evaluating anyway "
                "(--skip-tokenizer-check)",
                model_fp[:12],
                store.fingerprint[:12],
            )
        else:
            require_same_fingerprint(
                model_fp,
                f"model {cfg.model}",
                store.fingerprint,
                f"token store {store.path} (tags {tags.dir})",
            )
    end = int(tags.starts[n_windows - 1] + tags.n_targets[n_windows - 1]) + 1 if n_windows else 0
    max_id = max_token_id(store, end)
    if prefix is not None and not 0 <= prefix < loaded.vocab_size:
        raise ArSliceError(
            f"prefix token {prefix} is outside model {cfg.model}'s vocabulary of "
            f"{loaded.vocab_size} ids; pass --prefix-token with an id of its tokenizer"
        )
    if max_id >= loaded.vocab_size:
        raise ArSliceError(
            f"model {cfg.model} has a vocabulary of {loaded.vocab_size} ids but token store "
            f"{store.path} holds id {max_id}; the model was trained with another tokenizer "
            "(or a smaller vocabulary) than the one that made the store"
        )
    limit = loaded.max_positions
    if limit is not None and tags.window > limit:
        raise ArSliceError(
            f"windows of {tags.window} tokens (tags {tags.dir}) exceed model {cfg.model}'s "
            f"positional limit of {limit}; re-tag with `arslice tag --window {limit}` or less"
        )
    return max_id


def max_token_id(store, end: int, block: int = 1 << 24) -> int:
    """Largest id in stream[0:end], read in blocks so a large store is never loaded at once."""
    best = -1
    for a in range(0, end, block):
        part = store.tokens[a : min(end, a + block)]
        if len(part):
            best = max(best, int(np.max(part)))
    return best
