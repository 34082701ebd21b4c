"""Zero-shot key-value recall (in-context MQAR for a pretrained LM; docs/design.md, "Probes of a
checkpoint"): the per-position table of a model's NLL and argmax on `k` pairs and their queries,
accuracy and NLL of the value at each query by `k` and by the distance between the pair and its
query, and the baselines they are read against.

Body positions (1-based, the prefix is 0): pair i (0-based) has its key at 2i+1 and its value at
2i+2; the j-th query (0-based) asks for pair `order[j]`, its key at 2k+2j+1 and its value at
2k+2j+2, so the distance from pair to query is `2(k + j - order[j])`, from 2 to 4k-2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ar_slicing.analysis.probes.induction import check_scores
from ar_slicing.analysis.probes.intervals import bootstrap_interval, frame
from ar_slicing.analysis.probes.sequences import RecallSequences
from ar_slicing.errors import ArSliceError

# what each body position holds; only a query_value is scored (accuracy, NLL at the query)
ROLES = ("pair_key", "pair_value", "query_key", "query_value")


def recall_schema():
    """One row per predicted position of a sequence, keyed by (seq_id, pos); seq_id runs over
    every k of the table."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("seq_id", pa.int32(), nullable=False),
            pa.field("k", pa.int32(), nullable=False),  # pairs in the sequence
            pa.field("pos", pa.int32(), nullable=False),  # 1..4k, in the body
            pa.field("token", pa.int32(), nullable=False),  # the target at pos
            pa.field("role", pa.string(), nullable=False),  # one of ROLES
            pa.field("pair", pa.int32(), nullable=False),  # the pair (0-based) the token is of
            pa.field("distance", pa.int32()),  # query rows: query pos - pair pos; else null
            pa.field("nll", pa.float32(), nullable=False),
            pa.field("argmax", pa.int32(), nullable=False),
        ]
    )


def _layout(seqs: RecallSequences) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(role index (T-1,), pair (N, T-1), distance (N, T-1), is query (T-1,)) of every target
    column, from the body's layout and each sequence's query order."""
    k = seqs.k
    pos = seqs.positions[1:]
    slot = (pos - 1) // 2  # pair index in the first half, query index j in the second
    query = pos > 2 * k
    role = 2 * query + (pos % 2 == 0)  # pair_key, pair_value, query_key, query_value
    j = np.where(query, slot - k, 0)
    asked = seqs.order[:, j]  # (N, T-1) the pair each query column asks for
    pair = np.where(query, asked, slot)
    distance = np.where(query, 2 * (k + j - asked), -1)
    return role, pair, distance, query


def recall_table(parts: Sequence[tuple[RecallSequences, np.ndarray, np.ndarray]]):
    """The pyarrow table (`recall_schema`) of `(sequences of one k, nll, argmax)` parts, in
    order (their seq_ids follow one another); `nll`, `argmax` (N, T-1) as `induction_table`'s."""
    import pyarrow as pa

    tables, first_id = [], 0
    for seqs, nll, argmax in parts:
        check_scores(seqs.tokens, nll, argmax)
        n_seq, width = seqs.tokens.shape
        role, pair, distance, query = _layout(seqs)
        columns = {
            "seq_id": np.repeat(np.arange(first_id, first_id + n_seq, dtype=np.int32), width - 1),
            "k": np.full(n_seq * (width - 1), seqs.k, dtype=np.int32),
            "pos": np.tile(seqs.positions[1:].astype(np.int32), n_seq),
            "token": seqs.tokens[:, 1:].astype(np.int32).ravel(),
            "role": np.tile(np.array(ROLES, dtype=object)[role], n_seq),
            "pair": pair.astype(np.int32).ravel(),
            "distance": pa.array(distance.astype(np.int32).ravel(), mask=np.tile(~query, n_seq)),
            "nll": np.asarray(nll, dtype=np.float32).ravel(),
            "argmax": np.asarray(argmax).astype(np.int32).ravel(),
        }
        tables.append(pa.table(columns, schema=recall_schema()))
        first_id += n_seq
    if not tables:
        return recall_schema().empty_table()
    return pa.concat_tables(tables)


def _per_sequence(queries) -> np.ndarray:
    """(S, 3): per sequence, its queries, how many the argmax answered, and their NLL sum."""
    import polars as pl

    return (
        queries.group_by("seq_id")
        .agg(
            pl.len().cast(pl.Float64).alias("queries"),
            (pl.col("argmax") == pl.col("token")).sum().cast(pl.Float64).alias("correct"),
            pl.col("nll").cast(pl.Float64).sum().alias("nll"),
        )
        .sort("seq_id")
        .select("queries", "correct", "nll")
        .to_numpy()
    )


def recall_by_k(table, head_rows: int, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95):
    """Per k (polars DataFrame, by k): `queries`; `accuracy` (argmax = value at the query) and
    `nll` (mean NLL of the value there), each with a percentile bootstrap interval over the
    sequences of that k; `pair_value_nll`, the mean NLL of the same values where their pair
    states them (nothing in the context predicts them there); and the baselines: a model
    uniform over its `head_rows` ids (`chance_accuracy` 1/V, `chance_nll` ln V) and one that
    knows a value follows the key but not which of the k (`guess_accuracy` 1/k, `guess_nll`
    ln k)."""
    import polars as pl

    df = frame(table)
    rows = []
    for k in sorted(df["k"].unique().to_list()):
        of_k = df.filter(pl.col("k") == k)
        queries = of_k.filter(pl.col("role") == "query_value")
        per_seq = _per_sequence(queries)
        totals = per_seq.sum(axis=0)
        acc_lo, acc_hi = bootstrap_interval(
            per_seq, lambda t: t[:, 1] / t[:, 0], n_bootstrap, seed, level
        )
        nll_lo, nll_hi = bootstrap_interval(
            per_seq, lambda t: t[:, 2] / t[:, 0], n_bootstrap, seed, level
        )
        stated = of_k.filter(pl.col("role") == "pair_value")["nll"].cast(pl.Float64).mean()
        rows.append(
            {
                "k": int(k),
                "sequences": len(per_seq),
                "queries": int(totals[0]),
                "accuracy": float(totals[1] / totals[0]),
                "accuracy_lo": acc_lo,
                "accuracy_hi": acc_hi,
                "nll": float(totals[2] / totals[0]),
                "nll_lo": nll_lo,
                "nll_hi": nll_hi,
                "pair_value_nll": float(stated),
                "chance_accuracy": 1.0 / head_rows,
                "chance_nll": math.log(head_rows),
                "guess_accuracy": 1.0 / k,
                "guess_nll": math.log(k),
            }
        )
    if not rows:
        raise ArSliceError("recall by k: the table has no rows")
    return pl.DataFrame(rows)


def recall_by_distance(table):
    """Per (k, distance) (polars DataFrame): the queries at that distance from their pair, their
    accuracy and mean NLL."""
    import polars as pl

    return (
        frame(table)
        .filter(pl.col("role") == "query_value")
        .group_by("k", "distance")
        .agg(
            pl.len().alias("queries"),
            (pl.col("argmax") == pl.col("token")).mean().alias("accuracy"),
            pl.col("nll").cast(pl.Float64).mean().alias("nll"),
        )
        .sort("k", "distance")
    )
