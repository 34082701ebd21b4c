"""The probes' token sequences (docs/design.md, "Probes of a checkpoint"): the ids a probe draws
from (a model's vocabulary less its special tokens), the repeated random tokens of the induction
score and the key-value pairs and queries of zero-shot recall.

Every draw comes from a generator seeded with `(seed, probe, size)` alone, so two models whose
vocabularies give the same drawable ids read the same sequences, and a model of another
vocabulary draws its own from the same seed. Sequences are drawn one after another from that
generator, so a run of N + M sequences begins with the N of a smaller run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ar_slicing.errors import ArSliceError

# the second word of a probe's seed: which probe draws (its size is the third)
INDUCTION_STREAM = 1
RECALL_STREAM = 2


def array_digest(a: np.ndarray) -> str:
    """sha256 of an integer array's shape and little-endian int64 bytes: the same ids, the same
    digest, whatever dtype they were held in."""
    h = hashlib.sha256(str(tuple(a.shape)).encode())
    h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class ProbeVocabulary:
    """The ids a probe draws from, and the rows of the model's head (the V of the random-token
    baseline: a model uniform over its head has NLL ln V)."""

    ids: np.ndarray  # (A,) int64, increasing
    head_rows: int

    @property
    def digest(self) -> str:
        """What the draws depend on besides the seed: equal digests, equal sequences."""
        return array_digest(self.ids)


def probe_vocabulary(
    vocab_size: int, special_ids: Iterable[int] = (), head_rows: int | None = None
) -> ProbeVocabulary:
    """Ids `0 .. vocab_size-1` less `special_ids`, and less any id at or beyond `head_rows` (a
    head smaller than the tokenizer cannot score them).

    >>> probe_vocabulary(6, special_ids=[0, 4]).ids.tolist()
    [1, 2, 3, 5]
    >>> probe_vocabulary(6, special_ids=[0], head_rows=4).ids.tolist()
    [1, 2, 3]
    """
    head_rows = vocab_size if head_rows is None else int(head_rows)
    if vocab_size < 1 or head_rows < 1:
        raise ArSliceError(
            f"a probe vocabulary of {vocab_size} ids and a head of {head_rows} rows: both must "
            "hold at least one id"
        )
    ids = np.arange(min(vocab_size, head_rows), dtype=np.int64)
    ids = ids[~np.isin(ids, np.fromiter(special_ids, dtype=np.int64))]
    if ids.size == 0:
        raise ArSliceError(
            f"every id of the vocabulary ({vocab_size} ids, head of {head_rows} rows) is special: "
            "a probe has nothing to draw"
        )
    return ProbeVocabulary(ids, head_rows)


def tokenizer_probe_vocabulary(tokenizer, head_rows: int | None = None) -> ProbeVocabulary:
    """`probe_vocabulary` of a `tokenizers.Tokenizer`: its vocabulary with the added tokens, less
    the tokens it marks special (`<|endoftext|>`, `<pad>`, ...)."""
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    return probe_vocabulary(tokenizer.get_vocab_size(with_added_tokens=True), special, head_rows)


def probe_rng(seed: int, stream: int, size: int) -> np.random.Generator:
    """The generator of one probe at one size (`INDUCTION_STREAM` and n, `RECALL_STREAM` and k)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), stream, int(size)]))


def draw_distinct(rng: np.random.Generator, vocab: ProbeVocabulary, m: int) -> np.ndarray:
    """`m` distinct ids of `vocab`, uniformly (every ordered m-tuple of distinct ids alike)."""
    return vocab.ids[rng.choice(vocab.ids.size, size=m, replace=False)]


def _with_prefix(body: np.ndarray, prefix: int | None) -> np.ndarray:
    """(N, T) rows the model reads: `[prefix] + body` per row, or `body`."""
    if prefix is None:
        return body
    return np.concatenate([np.full((len(body), 1), prefix, dtype=np.int64), body], axis=1)


@dataclass(frozen=True, eq=False)
class ProbeSequences:
    """What a probe's model reads: `tokens[s]` is `[prefix] + body` (or the body alone), and a
    token's position `pos` is its 1-based place in the body (the prefix is position 0)."""

    tokens: np.ndarray  # (N, T) int64
    prefix: int | None

    @property
    def positions(self) -> np.ndarray:
        """(T,) the `pos` of each column of `tokens`."""
        return np.arange(self.tokens.shape[1]) + (self.prefix is None)

    @property
    def digest(self) -> str:
        return array_digest(self.tokens)


@dataclass(frozen=True, eq=False)
class InductionSequences(ProbeSequences):
    """Bodies `x_1..x_n x_1..x_n` of `n` distinct random ids."""

    n: int = 0


@dataclass(frozen=True, eq=False)
class RecallSequences(ProbeSequences):
    """Bodies `k_1 v_1 .. k_k v_k` then `k_π(1) v_π(1) .. k_π(k) v_π(k)`: `k` pairs of distinct
    random ids, then every key again followed by its value, in the order `order[s] = π - 1`."""

    k: int = 0
    order: np.ndarray | None = None  # (N, k) the pair (0-based) each query asks for, in turn


def induction_sequences(
    vocab: ProbeVocabulary, n: int, n_sequences: int, seed: int, prefix: int | None = None
) -> InductionSequences:
    """`n_sequences` bodies `x + x` of `n` distinct ids drawn uniformly from `vocab`."""
    if not 2 <= n <= vocab.ids.size:
        raise ArSliceError(
            f"induction length {n}: needs 2 to {vocab.ids.size} distinct ids (the probe "
            "vocabulary's size)"
        )
    rng = probe_rng(seed, INDUCTION_STREAM, n)
    x = np.stack([draw_distinct(rng, vocab, n) for _ in range(n_sequences)]).reshape(-1, n)
    return InductionSequences(_with_prefix(np.concatenate([x, x], axis=1), prefix), prefix, n=n)


def recall_sequences(
    vocab: ProbeVocabulary, k: int, n_sequences: int, seed: int, prefix: int | None = None
) -> RecallSequences:
    """`n_sequences` bodies of `k` key-value pairs (2k distinct ids drawn uniformly from `vocab`)
    and their `k` queries in a uniformly random order drawn with each sequence."""
    if not 1 <= 2 * k <= vocab.ids.size:
        raise ArSliceError(
            f"{k} key-value pairs: {2 * k} distinct ids, but the probe vocabulary holds "
            f"{vocab.ids.size}; give k from 1 to {vocab.ids.size // 2}"
        )
    rng = probe_rng(seed, RECALL_STREAM, k)
    bodies, orders = [], []
    for _ in range(n_sequences):
        ids = draw_distinct(rng, vocab, 2 * k)
        keys, values = ids[:k], ids[k:]
        order = rng.permutation(k)
        pairs = np.stack([keys, values], axis=1).ravel()  # (2k,) k_1 v_1 k_2 v_2 ...
        queries = np.stack([keys[order], values[order]], axis=1).ravel()
        bodies.append(np.concatenate([pairs, queries]))
        orders.append(order)
    body = np.array(bodies, dtype=np.int64).reshape(-1, 4 * k)
    order = np.array(orders, dtype=np.int64).reshape(-1, k)
    return RecallSequences(_with_prefix(body, prefix), prefix, k=k, order=order)
