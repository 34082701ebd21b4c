"""Restricted counts: the training counts of exactly the bigrams that occur in given stores.

The analysis only reads the training count of bigrams of the evaluated (validation) text, so
`arslice count --only-bigrams-of VAL` counts those and no others. Their sorted keys (`key_set`:
every adjacent pair of each evaluated store's own stream) are written once to a file that every
task memory-maps. A task counts a contiguous group of a training store's pairs, shard by shard,
into one dense int64 array over that key set, written as its partial; the partials are summed
range by range into bigrams.parquet, whose rows are the keys with a count of at least one (a
bigram of the evaluated stores never seen in training has no row and reads as 0, as in a full
count). Memory and temporary disk are a few bytes per evaluated bigram per group, and the number
of groups depends on the workers, not on the training set.

`restriction_of(store)` and `check_covers` identify an evaluated store by its tokenizer
fingerprint and the sha256 of its tokens.bin, so `tag` accepts restricted counts only for a
store they were made for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts.kernels import kernels
from ar_slicing.algorithms.counts.keys import key_dtype_for, merge_counted, pair_keys
from ar_slicing.algorithms.counts.partials import Compact16, count_u16, merge16
from ar_slicing.errors import ArSliceError

# Keys per step when the key set, the partials and the rows are read in ranges.
KEY_CHUNK = 1 << 21


# ---- the key set of the evaluated stores -----------------------------------------------------


def key_set(stores, shift: int, shard_tokens: int) -> np.ndarray:
    """Sorted distinct keys of every adjacent pair inside each store (not across stores)."""
    parts = []
    for store in stores:
        n_pairs = max(store.n_tokens - 1, 0)
        for start in range(0, n_pairs, shard_tokens):
            tokens = store.slice(start, min(start + shard_tokens, n_pairs) + 1)
            parts.append(_shard_keys(tokens, shift))
            if len(parts) > 1:  # fold as we go: the union never holds more than two shards
                parts = [_union(parts, shift)]
    return _union(parts, shift) if parts else np.zeros(0, key_dtype_for(shift))


def _shard_keys(tokens: np.ndarray, shift: int):
    if kernels() is not None and shift == 16 and tokens.dtype.itemsize == 2:
        return count_u16(tokens, 0, 0)[0]
    return np.unique(pair_keys(tokens, shift, 0, None))


def _union(parts, shift: int) -> np.ndarray:
    """One sorted key array from shard results (compact 16-bit partials or key arrays)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        keys, _ = merge_counted([(p, np.ones(p.size, np.int64)) for p in parts])
        return keys.astype(key_dtype_for(shift), copy=False)
    compact = [
        Compact16.encode(p, np.ones(p.size, np.int64), 0, 1 << 16)
        if isinstance(p, np.ndarray)
        else p
        for p in parts
    ]
    return merge16(compact, 0, 1 << 16)[0]


def key_offsets16(keys: np.ndarray) -> np.ndarray:
    """Where each prev's keys start in a sorted uint32 key array (65537 entries)."""
    bounds = np.arange(1 << 16, dtype=np.uint64) << np.uint64(16)
    return np.append(np.searchsorted(keys, bounds.astype(np.uint32)), keys.size).astype(np.int64)


def write_keys(path: Path, keys: np.ndarray) -> None:
    from ar_slicing.machinery.io import atomic_path

    with atomic_path(path) as tmp:
        keys.astype(keys.dtype.newbyteorder("<"), copy=False).tofile(tmp)


def read_keys(path: str | Path, shift: int) -> np.ndarray:
    """The key set written by `write_keys`, memory-mapped (shared by every task on a node)."""
    dtype = key_dtype_for(shift).newbyteorder("<")
    if Path(path).stat().st_size == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# ---- map: a group of training pairs -> dense counts over the key set ---------------------------


@dataclass(frozen=True)
class RestrictedTask:
    """Count pairs start..stop-1 of one store file into counts over the key set at `keys`."""

    tokens_path: str
    dtype: str
    n_tokens: int
    start: int
    stop: int
    stream_offset: int
    row: int | None
    shift: int
    shard_tokens: int  # pairs counted per step (the kernels' scratch space is this size)
    keys: str  # the key set file
    out: str  # the partial: a count per key (uint32, or int64 for 2**32 pairs and more)

    @property
    def n_pairs(self) -> int:
        return self.stop - self.start


def count_restricted(task: RestrictedTask) -> dict:
    """Map step of a restricted count. Returns {pairs: pairs of the group in the unit}."""
    from ar_slicing.machinery.io import atomic_path

    keys = read_keys(task.keys, task.shift)
    # a group of fewer than 2**32 pairs has no count of 2**32: half the memory and disk
    acc = np.zeros(keys.size, np.uint32 if task.n_pairs < 1 << 32 else np.int64)
    dtype = np.dtype(task.dtype).newbyteorder("<")
    compiled = kernels() if task.shift == 16 and dtype.itemsize == 2 else None
    offsets = key_next = nexts = None
    if compiled is not None:
        offsets = key_offsets16(keys)
        key_next = (np.asarray(keys) & np.uint32(0xFFFF)).astype(np.uint16)
        nexts = np.empty(min(task.shard_tokens, max(task.n_pairs, 1)), np.uint16)
    pairs = 0
    # read, not memory-mapped: a group is many shards, and pages of a mapping it walks through
    # stay resident (and counted against the worker) until the mapping is closed
    with open(task.tokens_path, "rb") as f:
        for a in range(task.start, task.stop, task.shard_tokens):
            b = min(a + task.shard_tokens, task.stop)
            f.seek(a * dtype.itemsize)
            tokens = np.fromfile(f, dtype=dtype, count=b + 1 - a)
            pairs += _count_shard(task, keys, acc, tokens, a, compiled, offsets, key_next, nexts)
    with atomic_path(task.out) as tmp:
        acc.astype(acc.dtype.newbyteorder("<"), copy=False).tofile(tmp)
    return {"pairs": pairs}


def _count_shard(task, keys, acc, tokens, a, compiled, offsets, key_next, nexts) -> int:
    """Add one shard's pairs (tokens[0] is stream index stream_offset + a) to `acc`."""
    if compiled is not None:
        phase = (task.stream_offset + a) % task.row if task.row else 0
        return int(
            compiled["count_restricted_u16"](
                tokens, task.row or 0, phase, nexts, offsets, key_next, acc
            )
        )
    shard = pair_keys(tokens, task.shift, task.stream_offset + a, task.row)
    acc += key_counts(keys, shard).astype(acc.dtype, copy=False)
    return shard.size


def key_counts(keys: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """How often each of the sorted `keys` occurs in the key array `pairs` (int64, len(keys))."""
    if keys.size == 0 or pairs.size == 0:
        return np.zeros(keys.size, np.int64)
    at = np.minimum(np.searchsorted(keys, pairs), keys.size - 1)
    hit = keys[at] == pairs
    return np.bincount(at[hit], minlength=keys.size).astype(np.int64)


# ---- reduce: the partials summed, range by range, into rows ------------------------------------


def restricted_rows(keys: np.ndarray, partials: list[str], extra: np.ndarray):
    """(keys, counts) of the key set's rows with a count of at least one, in ranges of KEY_CHUNK
    keys: every partial's counts plus `extra` (counts of pairs across stores) added up."""
    maps = []
    for path in partials:
        size = Path(path).stat().st_size
        if size:  # uint32 or int64 counts, as the file's size says
            maps.append(np.memmap(path, dtype="<u4" if size == 4 * keys.size else "<i8", mode="r"))
    for a in range(0, keys.size, KEY_CHUNK):
        b = min(a + KEY_CHUNK, keys.size)
        total = np.array(extra[a:b], dtype=np.int64)
        for m in maps:
            total += m[a:b]
        seen = np.flatnonzero(total)
        yield np.asarray(keys[a:b])[seen], total[seen]


# ---- which stores restricted counts cover --------------------------------------------------------


def restriction_of(store) -> dict:
    """What identifies an evaluated store in a restricted count's meta.json."""
    return {
        "path": str(store.path.resolve()),
        "fingerprint": store.fingerprint,
        "n_tokens": store.n_tokens,
        "tokens_sha256": store.tokens_sha256,
    }


def check_covers(counts_meta: dict, counts_dir, store) -> None:
    """Refuse restricted counts for a store they were not made for, naming both."""
    covered = counts_meta.get("only_bigrams_of")
    if not covered:
        return
    for entry in covered:
        if (
            entry.get("fingerprint") == store.fingerprint
            and entry.get("n_tokens") == store.n_tokens
            and entry.get("tokens_sha256") == store.tokens_sha256
        ):
            return
    made_for = ", ".join(
        f"{e.get('path')} ({e.get('n_tokens'):,} tokens, sha256 {str(e.get('tokens_sha256'))[:12]}…)"
        for e in covered
    )
    raise ArSliceError(
        f"counts {counts_dir} hold only the bigrams of {made_for}, but token store {store.path} "
        f"({store.n_tokens:,} tokens, sha256 {store.tokens_sha256[:12]}…) is not one of them: "
        f"count with --only-bigrams-of {store.path}, or use full counts"
    )
