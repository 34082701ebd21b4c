"""A count's tasks, planned: the map shards of the stores' concatenation (`plan_map_tasks`,
over `pair_ranges`), the pairs across two stores (`boundary_keys`) and how many pairs the stream
has in a unit (`stream_pairs`). The count stage runs them (`pipeline.count_work`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts.keys import key_dtype_for
from ar_slicing.algorithms.counts.partials import MapTask
from ar_slicing.machinery.layout import COUNT_PARTIALS_DIR, TOKENS_NAME


def pair_ranges(stores, size: int) -> Iterator[tuple[int, int, dict]]:
    """Every store of the concatenation cut into ranges of at most `size` pairs, in order, as
    (store index, range index, the fields of a task over the range: the store's file, dtype and
    length, pairs start..stop-1 and the store's offset in the stream). Consecutive ranges
    overlap by one token, so no pair is lost."""
    offset = 0
    for s, store in enumerate(stores):
        n_pairs = max(store.n_tokens - 1, 0)
        for k, start in enumerate(range(0, n_pairs, size)):
            yield (
                s,
                k,
                {
                    "tokens_path": str((store.path / TOKENS_NAME).resolve()),
                    "dtype": store.dtype.name,
                    "n_tokens": store.n_tokens,
                    "start": start,
                    "stop": min(start + size, n_pairs),
                    "stream_offset": offset,
                },
            )
        offset += store.n_tokens


def plan_map_tasks(
    stores, work: Path, row: int | None, shard_tokens: int, shift: int, vocab_size: int
):
    """One MapTask per shard of every store (`pair_ranges`)."""
    return [
        MapTask(
            **pairs,
            row=row,
            shift=shift,
            vocab_size=vocab_size,
            out=str(work / COUNT_PARTIALS_DIR / f"s{s:04d}-{k:06d}.bin"),
        )
        for s, k, pairs in pair_ranges(stores, shard_tokens)
    ]


def boundary_keys(stores, row: int | None, shift: int) -> np.ndarray:
    """Keys of the pairs that span two consecutive (non-empty) stores of the concatenation."""
    pairs, offset, last = [], 0, None
    for store in stores:
        if store.n_tokens:
            if last is not None and (row is None or offset % row != 0):
                pairs.append((last, int(store.tokens[0])))
            last = int(store.tokens[-1])
        offset += store.n_tokens
    kd = key_dtype_for(shift)
    return np.array([(p << shift) | n for p, n in pairs], dtype=kd)


def stream_pairs(stores, row: int | None) -> int:
    """Pairs of the concatenated stream in the unit: N - 1, less those ending a row of `row`."""
    n = max(sum(s.n_tokens for s in stores) - 1, 0)
    return n - (n // row if row else 0)
