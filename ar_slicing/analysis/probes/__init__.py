"""Probes of a checkpoint (docs/design.md, "Probes of a checkpoint"): the induction score on
repeated random tokens, zero-shot key-value recall, and the loss by position on the run's own
windows with the in-context learning score. Pure functions over numpy arrays and long tables;
the model's side is one callable, `score(rows (N, T)) -> (nll, argmax)` (N, T-1), which the
eval stage's forward provides (`pipeline.eval.forward.score_rows`):

    vocab = tokenizer_probe_vocabulary(load_tokenizer(...), head_rows=loaded.vocab_size)
    tables = run_probes(partial(score_rows, loaded, device="cpu", dtype="fp32", batch_size=16),
                        vocab, ProbeSizes(), seed=0)
    induction_score(tables.induction), recall_by_k(tables.recall, vocab.head_rows)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ar_slicing.analysis.probes.induction import (
    induction_curve,
    induction_schema,
    induction_score,
    induction_table,
)
from ar_slicing.analysis.probes.position import icl_positions, icl_score, loss_by_position
from ar_slicing.analysis.probes.recall import (
    ROLES,
    recall_by_distance,
    recall_by_k,
    recall_schema,
    recall_table,
)
from ar_slicing.analysis.probes.sequences import (
    InductionSequences,
    ProbeVocabulary,
    RecallSequences,
    induction_sequences,
    probe_vocabulary,
    recall_sequences,
    tokenizer_probe_vocabulary,
)
from ar_slicing.errors import ArSliceError

Scorer = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class ProbeSizes:
    """How many sequences of what size each probe draws."""

    induction_length: int = 64  # n: the body x + x is 128 tokens, half the demo's window
    induction_sequences: int = 128  # interval ±0.08 nats on the demo's Transformer++ (score 2.2)
    recall_pairs: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # k: 4k tokens, up to half the window
    recall_queries: int = 512  # per k, in ceil(512 / k) sequences: one precision for every k

    def recall_sequences(self, k: int) -> int:
        """Sequences of k pairs: enough to hold `recall_queries` queries."""
        return -(-self.recall_queries // k)

    def longest_input(self, prefix: bool) -> int:
        """The most tokens a model reads at once (a sequence less its last token)."""
        body = max(2 * self.induction_length, 4 * max(self.recall_pairs, default=0))
        return body + int(prefix) - 1

    def tokens_read(self, prefix: bool) -> int:
        """Every token the probes feed a model (the work of one model or checkpoint)."""
        rows = [(self.induction_sequences, 2 * self.induction_length)]
        rows += [(self.recall_sequences(k), 4 * k) for k in self.recall_pairs]
        return sum(n * (body + int(prefix) - 1) for n, body in rows)


@dataclass(frozen=True)
class ProbeSequenceSet:
    """Every sequence the probes read: one induction set, one recall set per k."""

    induction: InductionSequences
    recall: tuple[RecallSequences, ...]

    @property
    def digest(self) -> str:
        """One digest of every sequence: equal digests, the same sequences (meta.json records it
        so a report can tell which models read the same ones)."""
        h = hashlib.sha256(self.induction.digest.encode())
        for part in self.recall:
            h.update(part.digest.encode())
        return h.hexdigest()


def probe_sequences(
    vocab: ProbeVocabulary, sizes: ProbeSizes, seed: int = 0, prefix: int | None = None
) -> ProbeSequenceSet:
    """The sequences of both probes for `vocab` (the same for every model of that vocabulary)."""
    if prefix is not None and not 0 <= prefix < vocab.head_rows:
        raise ArSliceError(
            f"prefix token {prefix}: outside the model's head of {vocab.head_rows} ids"
        )
    if len(set(sizes.recall_pairs)) != len(sizes.recall_pairs):
        raise ArSliceError(f"recall pairs {list(sizes.recall_pairs)}: each k once")
    return ProbeSequenceSet(
        induction_sequences(vocab, sizes.induction_length, sizes.induction_sequences, seed, prefix),
        tuple(
            recall_sequences(vocab, k, sizes.recall_sequences(k), seed, prefix)
            for k in sizes.recall_pairs
        ),
    )


@dataclass(frozen=True)
class ProbeTables:
    """A model's probe tables (pyarrow, `induction_schema` and `recall_schema`) and the digests
    of what it read."""

    induction: Any
    recall: Any
    vocabulary_digest: str
    sequences_digest: str


def run_probes(
    score: Scorer,
    vocab: ProbeVocabulary,
    sizes: ProbeSizes,
    seed: int = 0,
    prefix: int | None = None,
) -> ProbeTables:
    """Both probes' tables for the model behind `score`, over `probe_sequences(vocab, sizes,
    seed, prefix)`."""
    seqs = probe_sequences(vocab, sizes, seed, prefix)
    induction = induction_table(seqs.induction, *score(seqs.induction.tokens))
    recall = recall_table([(part, *score(part.tokens)) for part in seqs.recall])
    return ProbeTables(induction, recall, vocab.digest, seqs.digest)


__all__ = [
    "ROLES",
    "InductionSequences",
    "ProbeSequenceSet",
    "ProbeSizes",
    "ProbeTables",
    "ProbeVocabulary",
    "RecallSequences",
    "icl_positions",
    "icl_score",
    "induction_curve",
    "induction_schema",
    "induction_score",
    "induction_sequences",
    "induction_table",
    "loss_by_position",
    "probe_sequences",
    "probe_vocabulary",
    "recall_by_distance",
    "recall_by_k",
    "recall_schema",
    "recall_sequences",
    "recall_table",
    "run_probes",
    "tokenizer_probe_vocabulary",
]
