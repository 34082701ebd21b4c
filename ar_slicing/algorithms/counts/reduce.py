"""The reduce step: one range of `prev` values out of every partial, merged in bounded memory.

A reduce task holds at most REDUCE_RANGE_ENTRIES partial entries plus its running result and
writes its range of bigrams.parquet as a Parquet part (`parquet.write_bigrams_part`); the driver
joins the parts in order (`parquet.write_bigrams`). More data means more ranges, not bigger ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ar_slicing.algorithms.counts.keys import merge_counted
from ar_slicing.algorithms.counts.parquet import write_bigrams_part
from ar_slicing.algorithms.counts.partials import (
    Compact16,
    merge16,
    read_partial_slice,
    read_slice16,
)

# Partial entries one reduce task merges (~20 bytes each while merging: ~170 MB per task).
REDUCE_RANGE_ENTRIES = 1 << 23


@dataclass(frozen=True)
class ReduceTask:
    """Merge fine buckets b_lo..b_hi-1 of every partial into `out`, a Parquet part of the result."""

    partials: tuple[str, ...]
    b_lo: int
    b_hi: int
    out: str
    shift: int = 16
    # partial entries read before merging them into the running result: what a task holds
    # stays the same however many partials (shards) there are
    batch_entries: int = REDUCE_RANGE_ENTRIES


def reduce_range(task: ReduceTask) -> dict:
    """Reduce step: one `prev` range of all partials -> that range of bigrams.parquet, encoded.

    Memory stays bounded: slices are merged into the running result whenever `batch_entries`
    have been read, and the result itself is at most the distinct pairs of the range. Encoding
    the Parquet part here, not in the driver, spreads the encoding over the workers; the driver
    only joins the parts (see `write_bigrams`).
    """
    if task.shift == 16:
        keys, counts = _reduce16(task)
    else:
        acc: list[tuple[np.ndarray, np.ndarray]] = []
        held = 0
        for path in task.partials:
            k, c = read_partial_slice(path, task.b_lo, task.b_hi)
            if k.size == 0:
                continue
            if held and held + k.size > task.batch_entries and len(acc) > 1:
                acc = [merge_counted(acc)]
                held = acc[0][0].size
            acc.append((k, c))
            held += k.size
        keys, counts = merge_counted(acc)
        del acc
    pairs = write_bigrams_part(task.out, keys, counts, task.shift)
    return {"distinct": int(keys.size), "pairs": pairs}


def _reduce16(task: ReduceTask) -> tuple[np.ndarray, np.ndarray]:
    acc: list[Compact16] = []
    held = 0
    p_lo = p_hi = 0
    for path in task.partials:
        part = read_slice16(path, task.b_lo, task.b_hi)
        p_lo, p_hi = part.p_lo, part.p_lo + part.prev_offsets.size - 1
        if part.size == 0:
            continue
        if held and held + part.size > task.batch_entries and len(acc) > 1:
            acc = [Compact16.encode(*merge16(acc, p_lo, p_hi), p_lo, p_hi)]
            held = acc[0].size
        acc.append(part)
        held += part.size
    return merge16(acc, p_lo, p_hi)


def plan_ranges(sizes: np.ndarray, target_entries: int) -> list[tuple[int, int]]:
    """Group consecutive fine buckets into ranges of about `target_entries` partial entries."""
    ranges = []
    lo, held = 0, 0
    for b, s in enumerate(sizes.tolist()):
        if held and held + s > target_entries:
            ranges.append((lo, b))
            lo, held = b, 0
        held += s
    ranges.append((lo, len(sizes)))
    return ranges
