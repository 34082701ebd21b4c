"""Pair keys: counting units, the packed (prev, next) key, `prev` buckets, and numpy counting.

A pair is packed into one integer key `prev << shift | next` (`shift` = 16 for uint16 stores,
so a key is a uint32 and sorting it sorts by (prev, next); 32 for uint32 stores, uint64 keys).

What is counted. Stores counted together are one stream: their concatenation, in the order
given, so the pair across the boundary of two stores (last token of one, first of the next)
is counted, as a model trained on the packed stores saw it. Pair `i` is (S[i], S[i+1]) of that
stream. Unit "stream" counts every pair; unit "row:N" counts pair `i` only when `i` and `i+1`
fall in the same row of N tokens of the stream (rows start at stream index 0; a trailing
partial row counts too), i.e. it drops the pairs with `(i + 1) % N == 0`.
"""

from __future__ import annotations

import numpy as np

from ar_slicing.errors import BadInput

# A fine bucket spans at most this many keys, so a reduce task merging one bucket never holds
# more than 4 M distinct pairs whatever the corpus size (uint16: 64 prev values per bucket).
BUCKET_KEYS = 1 << 22
MAX_BUCKETS = 1 << 14


def parse_unit(unit: str) -> int | None:
    """ "stream" -> None; "row:N" -> N (N >= 2). Anything else is refused with the valid forms."""
    if unit == "stream":
        return None
    if unit.startswith("row:"):
        try:
            n = int(unit[4:])
        except ValueError:
            n = 0
        if n >= 2:
            return n
    raise BadInput(
        f"--unit {unit!r}: expected 'stream' or 'row:N' with N >= 2 (Pythia rows: row:2049)"
    )


def key_shift_for(dtype: np.dtype) -> int:
    """Bits of `next` in a pair key: 16 for uint16 stores (uint32 keys), 32 otherwise (uint64)."""
    return 16 if np.dtype(dtype).itemsize <= 2 else 32


def key_dtype_for(shift: int) -> np.dtype:
    """uint32 keys for 16-bit ids, uint64 otherwise."""
    return np.dtype(np.uint32) if shift == 16 else np.dtype(np.uint64)


def bucket_bounds(shift: int, vocab_size: int) -> np.ndarray:
    """Start key of every fine `prev` bucket (the last bucket is open-ended)."""
    id_space = 1 << 16 if shift == 16 else max(int(vocab_size), 1)
    # at most MAX_BUCKETS buckets, so a partial's bucket offsets stay small for huge vocabularies
    prev_width = max(1, BUCKET_KEYS // id_space, -(-id_space // MAX_BUCKETS))
    starts = np.arange(0, id_space, prev_width, dtype=np.uint64)
    return starts << np.uint64(shift)


def pair_keys(tokens: np.ndarray, shift: int, first_index: int, row: int | None) -> np.ndarray:
    """Keys of the pairs (tokens[j], tokens[j+1]); `first_index` = stream index of tokens[0].

    With `row` = N, pairs that straddle a row boundary (stream index i with (i+1) % N == 0)
    are dropped.
    """
    kd = key_dtype_for(shift)
    keys = tokens[:-1].astype(kd)
    keys <<= kd.type(shift)
    keys |= tokens[1:]
    if row is not None and keys.size:
        # pair j has stream index i = first_index + j; drop j with (first_index + j + 1) % row == 0
        first_cut = (-(first_index + 1)) % row
        keep = np.ones(keys.size, dtype=bool)
        keep[first_cut::row] = False
        keys = keys[keep]
    return keys


def count_sorted(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values and run lengths of a sorted array."""
    if keys.size == 0:
        return keys[:0], np.zeros(0, dtype=np.int64)
    starts = np.empty(keys.size, dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    counts = np.diff(idx, append=keys.size)
    return keys[idx], counts


def count_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (sorted) and how often each occurs. Sorts `keys` in place."""
    keys.sort()
    return count_sorted(keys)


def merge_counted(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Merge (sorted distinct keys, counts) parts into one, adding counts of equal keys.

    The concatenated parts are sorted runs, which numpy's stable sort (timsort) merges in
    O(n log k). uint32 keys with counts below 2**32 travel packed as one uint64
    (key << 32 | count), so the sort moves the counts along without an argsort and gathers.
    """
    parts = [(k, c) for k, c in parts if k.size]
    if not parts:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    if len(parts) == 1:
        k, c = parts[0]
        return np.ascontiguousarray(k), np.asarray(c, dtype=np.int64)
    if parts[0][0].dtype == np.uint32 and all(int(c.max()) < 1 << 32 for _, c in parts):
        packed = np.empty(sum(k.size for k, _ in parts), dtype=np.uint64)
        at = 0
        for k, c in parts:
            view = packed[at : at + k.size]
            np.left_shift(k, np.uint64(32), out=view, dtype=np.uint64)
            view |= c.astype(np.uint64, copy=False)
            at += k.size
        packed.sort(kind="stable")
        keys = (packed >> np.uint64(32)).astype(np.uint32)
        counts = (packed & np.uint64(0xFFFFFFFF)).view(np.int64)
    else:
        keys = np.concatenate([k for k, _ in parts])
        counts = np.concatenate([np.asarray(c, dtype=np.int64) for _, c in parts])
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        counts = counts[order]
        del order
    starts = np.empty(keys.size, dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    return keys[idx], np.add.reduceat(counts, idx)
