"""The induction score (Olsson et al. 2022, repeated random tokens; docs/design.md, "Probes of a
checkpoint"): the per-position table of a model's NLL and argmax on `x + x`, the score with its
bootstrap interval over sequences, and the loss curve by position.

Positions counted: index i = 2..n of each copy (pos 2..n and n+2..2n), the same targets x_2..x_n
after the same previous tokens in both copies; so a model whose prediction depends on the current
token alone scores exactly 0, and a perfect copier scores its whole first-copy loss. The first
token of each copy is in the curve, not in the score: x_1 has no context but the prefix, and in
the second copy it follows x_n, a bigram that never occurred.
"""

from __future__ import annotations

import numpy as np

from ar_slicing.analysis.probes.intervals import bootstrap_interval, frame
from ar_slicing.analysis.probes.sequences import InductionSequences
from ar_slicing.errors import ArSliceError


def induction_schema():
    """One row per predicted position of a sequence, keyed by (seq_id, pos)."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("seq_id", pa.int32(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),  # 1..2n, in the body x + x
            pa.field("token", pa.int32(), nullable=False),  # the target at pos
            pa.field("copy", pa.int8(), nullable=False),  # 1: pos <= n, 2: pos > n
            pa.field("scored", pa.bool_(), nullable=False),  # counted in the score
            pa.field("nll", pa.float32(), nullable=False),  # -log p(token | what precedes it)
            pa.field("argmax", pa.int32(), nullable=False),  # the id the model ranks first
        ]
    )


def check_scores(tokens: np.ndarray, nll: np.ndarray, argmax: np.ndarray) -> None:
    """`nll` and `argmax` hold one prediction per token after the first of each row."""
    want = (tokens.shape[0], tokens.shape[1] - 1)
    for name, a in (("nll", nll), ("argmax", argmax)):
        if a.shape != want:
            raise ArSliceError(f"probe scores: {name} of shape {a.shape}, expected {want}")
    bad = np.flatnonzero(~np.isfinite(nll))
    if bad.size:
        s, j = divmod(int(bad[0]), want[1])
        raise ArSliceError(
            f"probe scores: non-finite NLL ({nll.flat[bad[0]]}) at sequence {s}, column {j + 1} "
            f"({bad.size} such); the model overflows in this dtype (try fp32) or is broken"
        )


def induction_table(seqs: InductionSequences, nll: np.ndarray, argmax: np.ndarray):
    """The pyarrow table (`induction_schema`) of `nll`, `argmax` (N, T-1): column j is the
    model's prediction after reading `seqs.tokens[:, :j+1]`, of the token at column j + 1."""
    import pyarrow as pa

    tokens = seqs.tokens
    check_scores(tokens, nll, argmax)
    n_seq, width = tokens.shape
    pos = seqs.positions[1:]  # (T-1,) the targets' positions
    copy = np.where(pos <= seqs.n, 1, 2)
    index = pos - seqs.n * (copy - 1)  # i of x_i
    columns = {
        "seq_id": np.repeat(np.arange(n_seq, dtype=np.int32), width - 1),
        "pos": np.tile(pos.astype(np.int32), n_seq),
        "token": tokens[:, 1:].astype(np.int32).ravel(),
        "copy": np.tile(copy.astype(np.int8), n_seq),
        "scored": np.tile(index >= 2, n_seq),
        "nll": np.asarray(nll, dtype=np.float32).ravel(),
        "argmax": np.asarray(argmax).astype(np.int32).ravel(),
    }
    return pa.table(columns, schema=induction_schema())


def _per_sequence(table) -> np.ndarray:
    """(S, 4): per sequence, the NLL sum and count of its scored first-copy and second-copy
    positions."""
    import polars as pl

    first, second = pl.col("copy") == 1, pl.col("copy") == 2
    nll = pl.col("nll").cast(pl.Float64)
    sums = (
        frame(table)
        .filter(pl.col("scored"))
        .group_by("seq_id")
        .agg(
            nll.filter(first).sum().alias("sum1"),
            first.sum().cast(pl.Float64).alias("n1"),
            nll.filter(second).sum().alias("sum2"),
            second.sum().cast(pl.Float64).alias("n2"),
        )
        .sort("seq_id")
    )
    return sums.select("sum1", "n1", "sum2", "n2").to_numpy()


def _score(totals: np.ndarray) -> np.ndarray:
    """mean first-copy NLL − mean second-copy NLL of totals (..., 4) as `_per_sequence` sums."""
    return totals[..., 0] / totals[..., 1] - totals[..., 2] / totals[..., 3]


def induction_score(table, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """The induction score of a table: `first_nll` and `second_nll` (mean NLL of the scored
    positions of each copy), `score = first_nll - second_nll` (nats) with its percentile
    bootstrap interval over sequences (`score_lo`, `score_hi`), `second_accuracy` (argmax =
    token on the scored second-copy positions), `sequences` and `n`."""
    import polars as pl

    df = frame(table)
    if df.is_empty():
        raise ArSliceError("induction score: the table has no rows")
    per_seq = _per_sequence(df)
    totals = per_seq.sum(axis=0)
    lo, hi = bootstrap_interval(per_seq, _score, n_bootstrap, seed, level)
    second = df.filter(pl.col("scored") & (pl.col("copy") == 2))
    return {
        "sequences": len(per_seq),
        "n": int(df["pos"].max()) // 2,
        "first_nll": float(totals[0] / totals[1]),
        "second_nll": float(totals[2] / totals[3]),
        "score": float(_score(totals)),
        "score_lo": lo,
        "score_hi": hi,
        "second_accuracy": float((second["argmax"] == second["token"]).mean()),
    }


def induction_curve(table):
    """The loss curve by position: per `pos` (and its `copy`), the sequences it holds, their
    mean NLL and the share whose argmax is the token (polars DataFrame, by pos)."""
    import polars as pl

    return (
        frame(table)
        .group_by("pos", "copy")
        .agg(
            pl.len().alias("sequences"),
            pl.col("nll").cast(pl.Float64).mean().alias("mean_nll"),
            (pl.col("argmax") == pl.col("token")).mean().alias("accuracy"),
        )
        .sort("pos")
    )
