"""Exact bigram counts of token stores: a map step per shard, a reduce step per `prev` range, lookups.

Counting is shaped for a distributed engine (every task is a picklable function of plain
arguments that reads and writes files, so results may arrive in any order):

  map     `count_shard(MapTask)`: one shard of one store -> a partial counts file: the shard's
          distinct pairs, sorted, their counts, and where each fine `prev` bucket starts.
  reduce  `reduce_range(ReduceTask)`: the slices of one range of `prev` values out of every
          partial, merged in bounded memory -> that range of bigrams.parquet, as a Parquet part.
  write   `write_bigrams(...)`: the parts, in order, -> `bigrams.parquet` (their row groups
          copied as they are, one footer listing them all: `ar_slicing.parquet_concat`).

A pair is packed into one integer key `prev << shift | next` (`shift` = 16 for uint16 stores,
so a key is a uint32 and sorting it sorts by (prev, next); 32 for uint32 stores, uint64 keys).
Partials are sorted, so a `prev` range is a contiguous slice of each one, found through the
bucket offsets the map step stores beside it. Partials of 16-bit ids take 3 bytes a distinct
pair (`Compact16`: per-prev offsets, a uint16 next, a one-byte count with escapes).

Memory does not grow with the corpus: a map task holds one shard (about 7 bytes a token at
most), a reduce task at most REDUCE_RANGE_ENTRIES partial entries plus its running result, and
the driver only file names and Parquet footers. More data means more tasks, not bigger ones.

What is counted. Stores counted together are one stream: their concatenation, in the order
given, so the pair across the boundary of two stores (last token of one, first of the next)
is counted, as a model trained on the packed stores saw it. Pair `i` is (S[i], S[i+1]) of that
stream. Unit "stream" counts every pair; unit "row:N" counts pair `i` only when `i` and `i+1`
fall in the same row of N tokens of the stream (rows start at stream index 0; a trailing
partial row counts too), i.e. it drops the pairs with `(i + 1) % N == 0`.

`BigramCounts.open(dir)` reads `bigrams.parquet` back and answers vectorised lookups through an
open-addressing hash table built from it once (1.5 probes per lookup on average).

Speed: with numba installed the map, reduce and lookup inner loops are compiled kernels
(counting sort by `prev` instead of a comparison sort); without it the same steps run in numpy.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.errors import BadInput

log = logging.getLogger(__name__)

BIGRAMS_NAME = "bigrams.parquet"
# A fine bucket spans at most this many keys, so a reduce task merging one bucket never holds
# more than 4 M distinct pairs whatever the corpus size (uint16: 64 prev values per bucket).
BUCKET_KEYS = 1 << 22
MAX_BUCKETS = 1 << 14
# Partial entries one reduce task merges (~20 bytes each while merging: ~170 MB per task).
REDUCE_RANGE_ENTRIES = 1 << 23
# Rows per Parquet row group of bigrams.parquet (readers can stream it group by group).
ROW_GROUP_ROWS = 1 << 21


def bigrams_schema():
    import pyarrow as pa

    return pa.schema([("prev", pa.int32()), ("next", pa.int32()), ("count", pa.int64())])


# ---- units and keys --------------------------------------------------------------------------


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


# ---- compiled kernels (numba) -----------------------------------------------------------------
#
# The same algorithms run in plain numpy when numba is missing or ARSLICE_NO_NUMBA=1; the
# kernels only avoid numpy's full sort and its extra passes. They are compiled on first use
# and cached on disk beside this file.


def _count_u16_kernel(tokens, row, phase, nexts, out_next, out_c8, prev_offsets, escaped):
    """Counts of the pairs (tokens[j], tokens[j+1]) of a uint16 shard, as a compact partial.

    A counting sort by `prev` (histogram, then scatter of `next` into per-prev segments), then
    each segment counted in a 65536-entry scratch table that stays in cache, and emitted in
    `next` order by walking a two-level bitmap of the entries it touched (no sorting at all).
    With `row` > 0, pair j is skipped when (phase + j + 1) % row == 0 (phase = stream index of
    tokens[0] % row).

    Output (see `write_partial16`): distinct pair i is (prev, out_next[i]) with prev the p for
    which prev_offsets[p] <= i < prev_offsets[p + 1]; its count is out_c8[i], or, where that is
    255, the next of `escaped`. Returns (distinct pairs, escaped counts, pairs counted).
    `nexts` (scatter space), out_next and out_c8 hold at least len(tokens) - 1 entries.
    """
    n = tokens.size - 1
    hist = np.zeros(65537, np.int64)
    c = phase
    for j in range(n):
        if row > 0:
            c += 1
            if c == row:
                c = 0
                continue
        hist[np.int64(tokens[j]) + 1] += 1
    for p in range(65536):
        hist[p + 1] += hist[p]
    pos = hist[:65536].copy()
    c = phase
    for j in range(n):
        if row > 0:
            c += 1
            if c == row:
                c = 0
                continue
        p = tokens[j]
        nexts[pos[p]] = tokens[j + 1]
        pos[p] += 1
    # uint32: a shard has fewer than 2**32 pairs, and half the table of int64 stays in L2
    scratch = np.zeros(65536, np.uint32)
    bits = np.zeros(1024, np.uint64)
    summary = np.zeros(16, np.uint64)
    d = 0
    e = 0
    for p in range(65536):
        prev_offsets[p] = d
        a = hist[p]
        b = hist[p + 1]
        if a == b:
            continue
        for i in range(a, b):
            x = np.int64(nexts[i])
            _touch(x, bits, summary)
            scratch[x] += 1
        d, e = _emit_compact(scratch, bits, summary, out_next, out_c8, escaped, d, e)
    prev_offsets[65536] = d
    return d, e, hist[65536]


def _emit_compact(scratch, bits, summary, out_next, out_c8, escaped, d, e):
    """`_emit_segment` for the compact layout: `next` and a one-byte count (255: escaped)."""
    for sw in range(16):
        s = summary[sw]
        while s != 0:
            low = s & (~s + np.uint64(1))
            w = sw * 64 + _CTZ[(low * _DEBRUIJN) >> np.uint64(58)]
            b = bits[w]
            while b != 0:
                lb = b & (~b + np.uint64(1))
                x = w * 64 + _CTZ[(lb * _DEBRUIJN) >> np.uint64(58)]
                c = scratch[x]
                out_next[d] = x
                if c >= 255:
                    out_c8[d] = 255
                    escaped[e] = c
                    e += 1
                else:
                    out_c8[d] = c
                scratch[x] = 0
                d += 1
                b ^= lb
            bits[w] = 0
            s ^= low
        summary[sw] = 0
    return d, e


@dataclass
class Compact16:
    """Counted pairs of 16-bit ids, `prev` values p_lo..p_lo+len(prev_offsets)-2 (3 bytes each).

    Pair i is (p_lo + p, next[i]) for prev_offsets[p] <= i < prev_offsets[p + 1] (offsets
    relative to this slice); its count is c8[i], or where that is 255 the next value of
    `escaped` (counts of 255 and more, in order of i).
    """

    p_lo: int
    prev_offsets: np.ndarray  # int64
    next: np.ndarray  # uint16
    c8: np.ndarray  # uint8
    escaped: np.ndarray  # int64

    @property
    def size(self) -> int:
        return int(self.next.size)

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted uint32 keys and int64 counts."""
        prevs = np.arange(self.p_lo, self.p_lo + self.prev_offsets.size - 1, dtype=np.uint32)
        keys = np.repeat(prevs << np.uint32(16), np.diff(self.prev_offsets)) | self.next
        counts = self.c8.astype(np.int64)
        counts[counts == 255] = self.escaped
        return keys, counts

    @classmethod
    def encode(cls, keys: np.ndarray, counts: np.ndarray, p_lo: int, p_hi: int) -> Compact16:
        """From sorted uint32 keys (all with p_lo <= prev < p_hi) and their counts."""
        starts = np.arange(p_lo, p_hi + 1, dtype=np.uint64) << np.uint64(16)
        prev_offsets = np.searchsorted(keys, starts).astype(np.int64)
        counts = np.asarray(counts)
        big = counts >= 255
        return cls(
            p_lo,
            prev_offsets,
            (keys & np.uint32(0xFFFF)).astype(np.uint16),
            np.where(big, 255, counts).astype(np.uint8),
            counts[big].astype(np.int64),
        )


def count_u16(tokens: np.ndarray, row: int, phase: int) -> tuple[Compact16, int]:
    """The distinct pairs of a uint16 shard and their counts (the compiled map kernel); pairs.

    The kernel's big buffers are allocated here, by numpy, which backs arrays of 4 MiB and more
    with transparent huge pages: the scatter's random writes then rarely miss the TLB, and
    first touching a fresh buffer costs 512x fewer page faults (together about half the
    kernel's time on a Zipf shard, against buffers the kernel allocates itself).
    """
    n = max(tokens.size - 1, 0)
    nexts = np.empty(n, np.uint16)
    out_next = np.empty(n, np.uint16)
    out_c8 = np.empty(n, np.uint8)
    prev_offsets = np.empty(65537, np.int64)
    escaped = np.empty(n // 255 + 1, np.int64)
    d, e, pairs = kernels()["count_u16"](
        tokens, row, phase, nexts, out_next, out_c8, prev_offsets, escaped
    )
    del nexts
    # views, not copies: the untouched tail of the buffers was never made resident
    return Compact16(0, prev_offsets, out_next[:d], out_c8[:d], escaped[:e]), int(pairs)


_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
# _CTZ[(lowest_bit * _DEBRUIJN) >> 58] = index of that bit (count of trailing zeros)
_CTZ = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _CTZ[((1 << _i) * int(_DEBRUIJN) % (1 << 64)) >> 58] = _i
del _i


def _touch(x, bits, summary):
    """Mark `next` = x as seen in the two-level bitmap (1024 words, 16 summary words).

    Unconditionally: setting a set bit again is harmless and cheaper than the branch it saves
    (whether x was seen is a coin flip on high-cardinality data, so the branch mispredicts).
    """
    w = x >> 6
    summary[w >> 6] |= np.uint64(1) << np.uint64(w & 63)
    bits[w] |= np.uint64(1) << np.uint64(x & 63)


def _emit_segment(p, scratch, bits, summary, out_keys, out_counts, d):
    """Write prev `p`'s nonzero scratch entries in `next` order (bitmap walk), clearing them."""
    base = np.uint32(p) << np.uint32(16)
    for sw in range(16):
        s = summary[sw]
        while s != 0:
            low = s & (~s + np.uint64(1))
            w = sw * 64 + _CTZ[(low * _DEBRUIJN) >> np.uint64(58)]
            b = bits[w]
            while b != 0:
                lb = b & (~b + np.uint64(1))
                x = w * 64 + _CTZ[(lb * _DEBRUIJN) >> np.uint64(58)]
                out_keys[d] = base | np.uint32(x)
                out_counts[d] = scratch[x]
                scratch[x] = 0
                d += 1
                b ^= lb
            bits[w] = 0
            s ^= low
        summary[sw] = 0
    return d


def _merge16_kernel(nexts, c8, prev_offsets, escaped, escaped_start, p_lo, out_keys, out_counts):
    """Merge k compact runs (`Compact16`, concatenated) of the same `prev` range, adding counts.

    prev_offsets[i, p]: where run i's entries of prev p_lo + p start in `nexts`/`c8`; run i's
    escaped counts are escaped[escaped_start[i]:escaped_start[i + 1]], in order. Each prev's
    entries of every run are added into the scratch table and emitted in order, as in the map
    kernel. Writes out_keys[:d], out_counts[:d] (each at least as long as `nexts`); returns d.
    """
    k = prev_offsets.shape[0]
    n_prevs = prev_offsets.shape[1] - 1
    cur = escaped_start[:-1].copy()
    scratch = np.zeros(65536, np.int64)
    bits = np.zeros(1024, np.uint64)
    summary = np.zeros(16, np.uint64)
    d = 0
    for p in range(n_prevs):
        seen = False
        for i in range(k):
            a = prev_offsets[i, p]
            b = prev_offsets[i, p + 1]
            if a == b:
                continue
            seen = True
            for j in range(a, b):
                x = np.int64(nexts[j])
                c = np.int64(c8[j])
                if c == 255:
                    c = escaped[cur[i]]
                    cur[i] += 1
                _touch(x, bits, summary)
                scratch[x] += c
        if seen:
            d = _emit_segment(p_lo + p, scratch, bits, summary, out_keys, out_counts, d)
    return d


def _home_slot(key, size):
    """Top 32 bits of the key's Fibonacci hash, scaled to the table size (as `_slots`)."""
    h = (np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
    return np.int64((h * np.uint64(size)) >> np.uint64(32))


def _build_split_kernel(keys, counts, table_keys, table_values):
    """Linear-probing table of separate key and count arrays (count 0 = empty)."""
    size = table_keys.size
    for i in range(keys.size):
        s = _home_slot(keys[i], size)
        while table_values[s] != 0:
            s += 1
            if s == size:
                s = 0
        table_keys[s] = keys[i]
        table_values[s] = counts[i]


def _probe_split_kernel(table_keys, table_values, home_size, shift, prev, nxt, out):
    """out[i] = count of (prev[i], nxt[i]) in a split table, or 0."""
    size = table_keys.size
    limit = np.int64(1) << shift
    for i in range(prev.size):
        p = prev[i]
        q = nxt[i]
        if p < 0 or p >= limit or q < 0 or q >= limit:
            out[i] = 0
            continue
        key = (np.uint64(p) << np.uint64(shift)) | np.uint64(q)
        s = _home_slot(key, home_size)
        while True:
            v = table_values[s]
            if v == 0:
                out[i] = 0
                break
            if np.uint64(table_keys[s]) == key:
                out[i] = np.int64(v)
                break
            s += 1
            if s == size:
                s = 0


_KERNELS: dict | None = None


def kernels() -> dict | None:
    """The compiled kernels, or None (numpy fallback) without numba or with ARSLICE_NO_NUMBA=1."""
    global _KERNELS
    import os

    if os.environ.get("ARSLICE_NO_NUMBA"):
        return None
    if _KERNELS is None:
        try:
            import numba
        except ImportError:
            log.info("numba is not installed: counting with numpy only (slower)")
            _KERNELS = {}
            return None
        jit = numba.njit(cache=True, nogil=True)
        global _emit_segment, _emit_compact, _touch, _home_slot
        _touch = jit(_touch)
        _emit_segment = jit(_emit_segment)
        _emit_compact = jit(_emit_compact)
        _home_slot = jit(_home_slot)
        _KERNELS = {
            "count_u16": jit(_count_u16_kernel),
            "merge16": jit(_merge16_kernel),
            "build_split": jit(_build_split_kernel),
            "probe_split": jit(_probe_split_kernel),
        }
    return _KERNELS or None


def warm_kernels() -> None:
    """Compile (or load from the cache) every kernel now, in this process.

    Called before the worker pool forks, so workers inherit the machine code instead of each
    loading it again (seconds per worker on a busy machine).
    """
    k = kernels()
    if k is None:
        return
    part, _ = count_u16(np.array([1, 2, 1], dtype=np.uint16), 0, 0)
    merge16([part, part], 0, 65536)
    one = np.ones(1, np.int64)
    for key_dtype, value_dtype in itertools.product((np.uint32, np.uint64), (np.uint32, np.int64)):
        table_keys, table_values = np.zeros(2, key_dtype), np.zeros(2, value_dtype)
        k["build_split"](
            np.array([1], key_dtype), one.astype(value_dtype), table_keys, table_values
        )
        k["probe_split"](table_keys, table_values, 2, 16, one, one, np.zeros(1, np.int64))


# ---- map -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MapTask:
    """Count the pairs of `tokens[start:stop+1]` of one store file (pairs start..stop-1)."""

    tokens_path: str  # the store's tokens.bin
    dtype: str  # numpy dtype name of tokens.bin ("uint16" | "uint32")
    n_tokens: int  # tokens in tokens.bin
    start: int  # first pair (local index of its first token)
    stop: int  # one past the last pair
    stream_offset: int  # stream index of the store's first token in the concatenation
    row: int | None  # unit row:N, or None for the whole stream
    shift: int
    vocab_size: int
    out: str  # the partial file, written atomically (see write_partial)

    @property
    def n_pairs(self) -> int:
        return self.stop - self.start


def count_shard(task: MapTask) -> dict:
    """Map step: one shard -> a partial counts file. Returns {pairs, distinct}."""
    dtype = np.dtype(task.dtype).newbyteorder("<")
    mm = np.memmap(task.tokens_path, dtype=dtype, mode="r", shape=(task.n_tokens,))
    tokens = np.asarray(mm[task.start : task.stop + 1])
    del mm
    bounds = bucket_bounds(task.shift, task.vocab_size)
    if kernels() is not None and task.shift == 16 and tokens.dtype.itemsize == 2:
        phase = (task.stream_offset + task.start) % task.row if task.row else 0
        part, pairs = count_u16(tokens, task.row or 0, phase)
        offsets = np.append(part.prev_offsets[bounds >> np.uint64(16)], part.size)
        write_partial16(task.out, part, offsets)
        return {"pairs": pairs, "distinct": part.size}
    keys = pair_keys(tokens, task.shift, task.stream_offset + task.start, task.row)
    del tokens
    keys, counts = count_keys(keys)
    offsets = np.append(np.searchsorted(keys, bounds.astype(keys.dtype)), keys.size)
    write_partial(task.out, keys, counts, offsets)
    return {"pairs": int(counts.sum()), "distinct": int(keys.size)}


# Partial files, little-endian, one per shard (one file, not several: creating files is what
# costs most for small shards on network disks). Both layouts start with 5 int64 (the magic
# first) and the int64 offsets of the fine buckets.
#   "ARBP" keys and counts as they are: key itemsize, count itemsize, keys, offsets; then the
#          keys (uint32 or uint64), then the counts (uint32, or int64 where one reaches 2**32).
#   "PB16" 16-bit ids in 3 bytes a pair (`Compact16`): pairs, offsets, escaped counts, prevs
#          per bucket; then the int64 offsets of all 65537 prevs, the uint16 nexts, the uint8
#          counts, the int64 positions of the escaped counts and the int64 escaped counts.
_PARTIAL_MAGIC = 0x41524250  # "ARBP"
_PARTIAL16_MAGIC = 0x36314250  # "PB16"
_HEADER = 5
_PREVS16 = 1 << 16


def _write_atomic(out: str | Path, arrays) -> None:
    """Write arrays one after another under a temporary name, renamed when complete."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            for part in arrays:
                f.write(memoryview(np.ascontiguousarray(part)).cast("B"))
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep holding the torn file's space
        raise
    tmp.rename(out)


def write_partial(
    out: str | Path, keys: np.ndarray, counts: np.ndarray, offsets: np.ndarray
) -> None:
    """One partial file of sorted distinct keys, their counts and the bucket offsets.

    Keys of 16-bit ids (uint32) are stored in the compact "PB16" layout.
    """
    if keys.dtype == np.uint32:
        write_partial16(out, Compact16.encode(keys, counts, 0, _PREVS16), offsets)
        return
    # counts of one shard are below 2**32 (shards are smaller than that), so uint32 halves the file
    small = counts.size == 0 or int(counts.max()) < 1 << 32
    counts = counts.astype("<u4" if small else "<i8", copy=False)
    keys = keys.astype(keys.dtype.newbyteorder("<"), copy=False)
    header = np.array(
        [_PARTIAL_MAGIC, keys.dtype.itemsize, counts.dtype.itemsize, keys.size, offsets.size], "<i8"
    )
    _write_atomic(out, (header, offsets.astype("<i8"), keys, counts))


def write_partial16(out: str | Path, part: Compact16, offsets: np.ndarray) -> None:
    """One partial file in the "PB16" layout: a whole shard (`part` covers every prev)."""
    assert part.p_lo == 0 and part.prev_offsets.size == _PREVS16 + 1
    escaped_at = np.flatnonzero(part.c8 == 255)
    per_bucket = int(bucket_bounds(16, _PREVS16)[1] >> np.uint64(16))
    header = [_PARTIAL16_MAGIC, part.size, offsets.size, escaped_at.size, per_bucket]
    _write_atomic(
        out,
        (
            np.array(header, "<i8"),
            offsets.astype("<i8"),
            part.prev_offsets.astype("<i8"),
            part.next.astype("<u2", copy=False),
            part.c8,
            escaped_at.astype("<i8"),
            part.escaped.astype("<i8"),
        ),
    )


def _partial_header(f, path) -> tuple[np.ndarray, np.ndarray]:
    """(header, bucket offsets) of an open partial file, positioned after them."""
    header = np.fromfile(f, dtype="<i8", count=_HEADER)
    if header.size != _HEADER or header[0] not in (_PARTIAL_MAGIC, _PARTIAL16_MAGIC):
        raise BadInput(f"{path}: not a partial counts file; delete {Path(path).parent} and rerun")
    n_offsets = int(header[4] if header[0] == _PARTIAL_MAGIC else header[2])
    return header, np.fromfile(f, dtype="<i8", count=n_offsets)


def is_partial16(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return _partial_header(f, path)[0][0] == _PARTIAL16_MAGIC


def read_partial_slice(path: str | Path, b_lo: int, b_hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and counts of fine buckets b_lo..b_hi-1 of one partial file (either layout)."""
    with open(path, "rb") as f:
        header, offsets = _partial_header(f, path)
        if header[0] == _PARTIAL16_MAGIC:
            return _read_slice16(f, header, offsets, b_lo, b_hi).decode()
        key_dtype = np.dtype(f"<u{int(header[1])}")
        count_dtype = np.dtype("<u4" if header[2] == 4 else "<i8")
        n_keys = int(header[3])
        base = 8 * (_HEADER + offsets.size)
        a, b = int(offsets[b_lo]), int(offsets[b_hi])
        f.seek(base + a * key_dtype.itemsize)
        keys = np.fromfile(f, dtype=key_dtype, count=b - a)
        f.seek(base + n_keys * key_dtype.itemsize + a * count_dtype.itemsize)
        counts = np.fromfile(f, dtype=count_dtype, count=b - a)
    return keys, counts


def read_slice16(path: str | Path, b_lo: int, b_hi: int) -> Compact16:
    """Fine buckets b_lo..b_hi-1 of a "PB16" partial file, as they are stored."""
    with open(path, "rb") as f:
        header, offsets = _partial_header(f, path)
        if header[0] != _PARTIAL16_MAGIC:
            raise BadInput(f"{path}: not a 16-bit partial; delete {Path(path).parent} and rerun")
        return _read_slice16(f, header, offsets, b_lo, b_hi)


def _read_slice16(f, header, offsets, b_lo: int, b_hi: int) -> Compact16:
    n, n_escaped, per_bucket = int(header[1]), int(header[3]), int(header[4])
    a, b = int(offsets[b_lo]), int(offsets[b_hi])
    p_lo, p_hi = b_lo * per_bucket, min(b_hi * per_bucket, _PREVS16)
    at_prevs = 8 * (_HEADER + offsets.size)
    at_next = at_prevs + 8 * (_PREVS16 + 1)
    at_c8 = at_next + 2 * n
    at_escaped_at = at_c8 + n
    at_escaped = at_escaped_at + 8 * n_escaped
    f.seek(at_prevs + 8 * p_lo)
    prev_offsets = np.fromfile(f, dtype="<i8", count=p_hi - p_lo + 1) - a
    f.seek(at_next + 2 * a)
    nexts = np.fromfile(f, dtype="<u2", count=b - a)
    f.seek(at_c8 + a)
    c8 = np.fromfile(f, dtype=np.uint8, count=b - a)
    e_lo = e_hi = 0
    if n_escaped:
        escaped_at = np.memmap(f, dtype="<i8", mode="r", offset=at_escaped_at, shape=(n_escaped,))
        e_lo, e_hi = (int(i) for i in np.searchsorted(escaped_at, [a, b]))
        del escaped_at
    f.seek(at_escaped + 8 * e_lo)
    escaped = np.fromfile(f, dtype="<i8", count=e_hi - e_lo)
    return Compact16(p_lo, prev_offsets, nexts, c8, escaped)


def bucket_sizes(path: str | Path) -> np.ndarray:
    with open(path, "rb") as f:
        return np.diff(_partial_header(f, path)[1])


def merge16(parts: list[Compact16], p_lo: int, p_hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge compact slices of prevs p_lo..p_hi-1 into sorted uint32 keys and int64 counts."""
    parts = [c for c in parts if c.size]
    compiled = kernels()
    if compiled is None or not parts:
        return merge_counted([c.decode() for c in parts]) if parts else _no_pairs16()
    for c in parts:
        assert c.p_lo == p_lo and c.prev_offsets.size == p_hi - p_lo + 1
    sizes = [c.size for c in parts]
    starts = np.cumsum([0] + sizes[:-1])
    prev_offsets = np.stack([c.prev_offsets + at for c, at in zip(parts, starts)])
    escaped_start = np.cumsum([0] + [c.escaped.size for c in parts]).astype(np.int64)
    # allocated by numpy, on huge pages (see count_u16)
    out_keys = np.empty(sum(sizes), np.uint32)
    out_counts = np.empty(sum(sizes), np.int64)
    d = compiled["merge16"](
        np.concatenate([c.next for c in parts]),
        np.concatenate([c.c8 for c in parts]),
        prev_offsets,
        np.concatenate([c.escaped for c in parts]),
        escaped_start,
        p_lo,
        out_keys,
        out_counts,
    )
    return out_keys[:d], out_counts[:d]


def _no_pairs16() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.uint32), np.zeros(0, np.int64)


# ---- reduce ----------------------------------------------------------------------------------


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


# ---- write -----------------------------------------------------------------------------------

# a part's total pairs, kept in its key/value metadata (and left out of bigrams.parquet)
PART_PAIRS_KEY = "arslice.part_pairs"


def write_bigrams_part(path: str | Path, keys: np.ndarray, counts: np.ndarray, shift: int) -> int:
    """Sorted (keys, counts) -> one Parquet part of bigrams.parquet, written atomically.

    Row groups of ROW_GROUP_ROWS rows, explicit schema. Returns the part's total pairs.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = bigrams_schema()
    mask = (1 << shift) - 1
    total = 0
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        # an open file, not a path: pyarrow would read "row:5/..." as a URI scheme
        with (
            open(tmp, "wb") as sink,
            pq.ParquetWriter(
                sink,
                schema,
                # No dictionaries: most (next, count) values are distinct or tiny, and building
                # dictionaries doubled the write time. Deltas on every column instead: `prev` is
                # sorted, `next` ascends within a `prev` and counts are mostly tiny, so delta bit
                # packing alone is ~3.4x smaller than snappy over plain and needs no compression
                # pass: faster to write and to read back.
                compression="none",
                use_dictionary=False,
                column_encoding={
                    "prev": "DELTA_BINARY_PACKED",
                    "next": "DELTA_BINARY_PACKED",
                    "count": "DELTA_BINARY_PACKED",
                },
                write_page_index=False,
            ) as writer,
        ):
            for a in range(0, keys.size, ROW_GROUP_ROWS):
                k = keys[a : a + ROW_GROUP_ROWS]
                c = np.ascontiguousarray(counts[a : a + ROW_GROUP_ROWS], dtype=np.int64)
                prev = (k >> k.dtype.type(shift)).astype(np.int32)
                nxt = (k & k.dtype.type(mask)).astype(np.int32)
                columns = [_arrow_view(x, f.type) for x, f in zip((prev, nxt, c), schema)]
                writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
                total += int(c.sum())
            writer.add_key_value_metadata({PART_PAIRS_KEY: str(total)})
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(out)
    return total


def _arrow_view(values: np.ndarray, arrow_type):
    """A contiguous numpy array as an Arrow array without copying. Not `pa.array`: its first
    call imports pandas (0.2 s, paid again in every fresh worker process)."""
    import pyarrow as pa

    return pa.Array.from_buffers(arrow_type, values.size, [None, pa.py_buffer(values)])


def write_bigrams(path: str | Path, parts) -> tuple[int, int]:
    """Parquet parts (paths, in key order) -> bigrams.parquet. Returns (distinct, total pairs).

    The parts' encoded row groups are copied as they are and one footer lists them all
    (`ar_slicing.parquet_concat`): the driver's share of the write is byte copies.
    """
    from ar_slicing.io import atomic_path
    from ar_slicing.parquet_concat import ParquetConcat, key_value_metadata

    total = 0
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as sink:
            concat = ParquetConcat(sink)
            for part in parts:
                footer = concat.append(part)
                total += int(key_value_metadata(footer)[PART_PAIRS_KEY.encode()])
            distinct = concat.finish(drop_metadata={PART_PAIRS_KEY})
    return distinct, total


# ---- lookup ----------------------------------------------------------------------------------

_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative (Fibonacci) hashing
_LOOKUP_CHUNK = 1 << 22


def _build_regions(row_groups, n_rows: int):
    """The region table (`ar_slicing.tag_kernels`) of `n_rows` rows given as (prev, next, count)
    arrays, in order of prev, and their total count; None without numba or when the rows do not
    fit the table (ids of 16 bits or more, counts of 2**32 or more) or are not in order."""
    from ar_slicing.tag_kernels import compiled as tag_kernels

    starts = np.full((1 << 16) + 1, -1, np.int64)
    slots = np.zeros(max(1, 2 * n_rows), np.uint64)
    state = np.array([-1, 0, 0, 0], np.int64)  # the current prev's run, and the total count
    run_next, run_count = np.empty(1 << 16, np.int64), np.empty(1 << 16, np.int64)
    compiled, row = None, 0
    for p, q, c in row_groups:
        # asked for once the first rows are decoded: the tag stage loads them on another thread
        compiled = compiled or tag_kernels()
        if compiled is None:
            return None
        if not compiled["build_sorted"](p, q, c, row, state, run_next, run_count, starts, slots):
            return None
        row += len(p)
    compiled = compiled or tag_kernels()
    if compiled is None or row != n_rows:
        return None
    compiled["finish_sorted"](state, run_next, run_count, starts, slots, row)
    return (starts, slots), int(state[3])


def _read_regions(file) -> tuple[tuple[np.ndarray, np.ndarray], int, int] | None:
    """The region table of a bigrams.parquet file, its number of rows and total count, or None
    (see `_build_regions`). Row groups are read one at a time, their three columns decoded in
    parallel, so decoded rows never pile up in memory."""
    import os

    if os.environ.get("ARSLICE_NO_NUMBA"):
        return None
    groups = (
        file.read_row_group(g, columns=["prev", "next", "count"])
        for g in range(file.num_row_groups)
    )
    n_rows = file.metadata.num_rows
    built = _build_regions(
        (tuple(t.column(k).to_numpy() for k in range(3)) for t in groups), n_rows
    )
    return None if built is None else (built[0], n_rows, built[1])


def _as_chunks(column) -> list[np.ndarray]:
    """An array, or a list of arrays (chunks), as a list of chunks."""
    return list(column) if isinstance(column, (list, tuple)) else [np.asarray(column)]


class BigramCounts:
    """The counts of a complete counts directory, with vectorised `lookup(prev, next)`.

    With 16-bit ids, counts below 2**32 and the compiled kernels, the table is the per-`prev`
    region table of `ar_slicing.tag_kernels` (`regions`: starts, slots; 16 bytes per distinct
    bigram, built region by region from the sorted rows). Otherwise it is one open-addressing
    hash table (linear probing, load 0.5): a lookup is one multiply-shift and, on average, 1.5
    probes; with 16-bit ids each slot packs key and count into one uint64.
    """

    def __init__(
        self, prev: np.ndarray, nxt: np.ndarray, counts: np.ndarray, meta: dict, path=None
    ):
        """`prev`, `nxt`, `counts`: the rows of bigrams.parquet, as arrays or as lists of aligned
        chunks (its row groups, so a large file is never concatenated)."""
        self.path = Path(path) if path is not None else None
        self.meta = meta
        chunks = list(zip(*(_as_chunks(a) for a in (prev, nxt, counts))))
        lows = [min(int(p.min()), int(q.min())) for p, q, _ in chunks if p.size]
        if lows and min(lows) < 0:
            raise BadInput(f"{self._where()}: negative token ids in {BIGRAMS_NAME}")
        top = max((max(int(p.max()), int(q.max())) for p, q, _ in chunks if p.size), default=0)
        max_count = max((int(c.max()) for _, _, c in chunks if c.size), default=0)
        self.shift = 16 if top < 1 << 16 else 32
        self.n_distinct = sum(p.size for p, _, _ in chunks)
        self._total = sum(int(c.sum()) for _, _, c in chunks)
        self.regions = None  # (starts, slots) of the region table, when it is used
        prev, nxt, counts = (
            np.concatenate([c[k] for c in chunks]) if chunks else np.zeros(0, np.int64)
            for k in range(3)
        )
        if self.shift == 16 and max_count < 1 << 32:
            order = np.argsort(prev, kind="stable")  # regions are placed in order of prev
            built = _build_regions([(prev[order], nxt[order], counts[order])], self.n_distinct)
            if built is not None:
                self.regions = built[0]
                return
        prev, nxt, counts = (a.astype(np.int64, copy=False) for a in (prev, nxt, counts))
        seen = counts > 0  # a stored count of 0 would read as an empty slot mid-probe
        prev, nxt, counts = prev[seen], nxt[seen], counts[seen]
        keys = (prev.astype(np.uint64) << np.uint64(self.shift)) | nxt.astype(np.uint64)
        self._build(keys.astype(key_dtype_for(self.shift)), counts)

    def _where(self) -> str:
        return str(self.path / BIGRAMS_NAME) if self.path else "bigram counts"

    @classmethod
    def open(cls, path: str | Path) -> BigramCounts:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from ar_slicing.io import is_complete, read_json

        path = Path(path)
        if not is_complete(path):
            raise BadInput(
                f"counts {path}: incomplete or missing (no meta.json); run `arslice count --out {path}`"
            )
        meta = read_json(path / "meta.json")
        try:
            with pa.memory_map(str(path / BIGRAMS_NAME)) as source:
                file = pq.ParquetFile(source)
                regions = _read_regions(file)
                if regions is None:
                    table = file.read(columns=["prev", "next", "count"])
        except Exception as e:
            raise BadInput(
                f"counts {path}: cannot read {BIGRAMS_NAME} ({e}); rerun the count stage"
            ) from None
        if regions is not None:
            counts = cls.__new__(cls)
            counts.path, counts.meta, counts.shift = path, meta, 16
            counts.regions, counts.n_distinct, counts._total = regions
            return counts
        batches = table.to_batches()
        cols = [[b.column(k).to_numpy() for b in batches] for k in range(3)]
        return cls(*cols, meta=meta, path=path)

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("fingerprint")

    @property
    def total_pairs(self) -> int:
        return int(self.meta.get("total_pairs", self._total))

    def __len__(self) -> int:
        return self.n_distinct

    def _slots(self, keys: np.ndarray, size: int) -> np.ndarray:
        """Home slot of each key: the top 32 bits of a Fibonacci hash, scaled to the table size."""
        h = (keys.astype(np.uint64) * _FIB) >> np.uint64(32)
        return ((h * np.uint64(size)) >> np.uint64(32)).view(np.int64)

    def _build(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Fill the table. Load factor 0.5 (16 bytes per bigram when packed)."""
        n = keys.size
        size = max(16, 2 * n)
        self._size = size  # home slots are scaled to this; the arrays may be longer
        # 16-bit ids and counts below 2**32: key and count share one uint64 slot, so a lookup
        # touches one cache line; otherwise keys and counts are separate arrays.
        self._packed = self.shift == 16 and (n == 0 or int(counts.max()) < 1 << 32)
        value_dtype = np.uint32 if n == 0 or int(counts.max()) < 1 << 32 else np.int64
        compiled = kernels()
        if compiled is not None:  # (16-bit ids with small counts took the region table)
            self._keys = np.zeros(size, dtype=keys.dtype)
            self._values = np.zeros(size, dtype=value_dtype)
            compiled["build_split"](keys, counts.astype(value_dtype), self._keys, self._values)
            return
        # numpy: place keys in order of home slot; each lands on max(its home, the previous
        # key's slot + 1), i.e. with g_i = slot_i - i a running max. No wrap-around is needed:
        # the table gets a tail past the last used slot (probes may still wrap; they stop
        # at an empty slot first).
        home = self._slots(keys, size)
        order = np.argsort(home, kind="stable")
        ramp = np.arange(n, dtype=np.int64)
        slot = np.maximum.accumulate(home[order] - ramp) + ramp if n else ramp
        length = max((int(slot[-1]) if n else 0) + 2, size + 1)
        table_keys = np.zeros(length, dtype=keys.dtype)
        table_values = np.zeros(length, dtype=value_dtype)  # 0 = empty (stored counts are >= 1)
        table_keys[slot] = keys[order]
        table_values[slot] = counts[order]
        if self._packed:
            self._table = (table_keys.astype(np.uint64) << np.uint64(32)) | table_values
        else:
            self._keys, self._values = table_keys, table_values

    def lookup(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """Training count of each bigram (prev[i], nxt[i]) as int64; 0 for pairs never seen."""
        prev = np.asarray(prev)
        nxt = np.asarray(nxt)
        if prev.shape != nxt.shape:
            raise ValueError(f"lookup: prev {prev.shape} and next {nxt.shape} differ in shape")
        out = np.zeros(prev.shape, dtype=np.int64)
        flat_p, flat_n, flat_out = prev.reshape(-1), nxt.reshape(-1), out.reshape(-1)
        for a in range(0, flat_p.size, _LOOKUP_CHUNK):
            flat_out[a : a + _LOOKUP_CHUNK] = self._lookup_flat(
                flat_p[a : a + _LOOKUP_CHUNK], flat_n[a : a + _LOOKUP_CHUNK]
            )
        return out

    def _lookup_flat(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        compiled = kernels()
        if compiled is not None:
            out = np.empty(prev.size, dtype=np.int64)
            # int64 ids: one compiled signature whatever the caller's dtype
            p = np.ascontiguousarray(prev, dtype=np.int64)
            q = np.ascontiguousarray(nxt, dtype=np.int64)
            if self.regions is not None:
                from ar_slicing.tag_kernels import compiled as tag_kernels

                tag_kernels()["probe_regions"](*self.regions, p, q, out)
            else:
                compiled["probe_split"](self._keys, self._values, self._size, self.shift, p, q, out)
            return out
        limit = 1 << self.shift
        p64 = prev.astype(np.int64, copy=False)
        n64 = nxt.astype(np.int64, copy=False)
        valid = (p64 >= 0) & (p64 < limit) & (n64 >= 0) & (n64 < limit)
        keys = (np.where(valid, p64, 0).astype(np.uint64) << np.uint64(self.shift)) | np.where(
            valid, n64, 0
        ).astype(np.uint64)
        if self._packed:
            length = self._table.size
        else:
            length = self._keys.size
            keys = keys.astype(self._keys.dtype)
        slot = self._slots(keys, self._size)
        out = np.zeros(prev.size, dtype=np.int64)
        todo = np.arange(prev.size)
        while todo.size:
            if self._packed:
                v = self._table[slot]
                values = (v & np.uint64(0xFFFFFFFF)).view(np.int64)
                hit = (v >> np.uint64(32)) == keys
            else:
                values = self._values[slot].astype(np.int64)
                hit = self._keys[slot] == keys
            out[todo[hit]] = values[hit]
            # keep probing where the slot holds another key; an empty slot (0) ends the probe
            more = ~hit & (values != 0)
            todo, keys, slot = todo[more], keys[more], (slot[more] + 1) % length
        out[~valid] = 0
        return out


# ---- the whole count: plan, map, reduce, write -------------------------------------------------

# 32 M tokens (~220 MB per map worker at most): fewer, fuller partials leave the reduce less
# to merge
DEFAULT_SHARD_TOKENS = 1 << 25
WORK_NAME = ".work"  # partials and reduced ranges of an unfinished count (kept for resuming)


def plan_map_tasks(
    stores, work: Path, row: int | None, shard_tokens: int, shift: int, vocab_size: int
):
    """One MapTask per shard of every store; shards overlap by one token so no pair is lost."""
    tasks = []
    offset = 0
    for s, store in enumerate(stores):
        n_pairs = max(store.n_tokens - 1, 0)
        for k, start in enumerate(range(0, n_pairs, shard_tokens)):
            tasks.append(
                MapTask(
                    tokens_path=str((store.path / "tokens.bin").resolve()),
                    dtype=store.dtype.name,
                    n_tokens=store.n_tokens,
                    start=start,
                    stop=min(start + shard_tokens, n_pairs),
                    stream_offset=offset,
                    row=row,
                    shift=shift,
                    vocab_size=vocab_size,
                    out=str(work / "partials" / f"s{s:04d}-{k:06d}.bin"),
                )
            )
        offset += store.n_tokens
    return tasks


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


def count_stores(
    store_paths,
    out: str | Path,
    *,
    unit: str = "stream",
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    config: dict | None = None,
    executor=None,
    progress: bool = True,
) -> dict:
    """Count the bigrams of the concatenation of `store_paths` into `out`. Returns its meta.json.

    Resumable: partials of finished shards (and finished reduce ranges) under `out/.work` are
    reused by a rerun with the same inputs and settings.
    """
    import json
    import time

    from tqdm import tqdm

    from ar_slicing.executor import LocalExecutor
    from ar_slicing.io import build_meta, prepare_out_dir, read_json, write_json_atomic, write_meta
    from ar_slicing.store import TokenStore
    from ar_slicing.tokenizer import require_same_fingerprint

    t0 = time.time()
    if not store_paths:
        raise BadInput("count: no token stores given (--tokens STORE [STORE ...])")
    row = parse_unit(unit)
    if shard_tokens < 2 or shard_tokens >= 1 << 32:
        raise BadInput(f"--shard-tokens {shard_tokens}: must be between 2 and 2**32 - 1")
    stores = [TokenStore.open(p) for p in store_paths]
    for store in stores[1:]:
        require_same_fingerprint(
            stores[0].fingerprint,
            f"token store {stores[0].path}",
            store.fingerprint,
            f"token store {store.path}",
        )
    out = Path(out)
    if not prepare_out_dir(out, overwrite):
        meta = read_json(out / "meta.json")
        log.info("%s is complete (%s pairs); --overwrite to redo", out, meta.get("total_pairs"))
        return meta

    shift = max(key_shift_for(s.dtype) for s in stores)
    vocab_size = max(s.vocab_size for s in stores)
    sources = [
        {
            "path": str(s.path.resolve()),
            "fingerprint": s.fingerprint,
            "n_tokens": s.n_tokens,
            "dtype": s.dtype.name,
        }
        for s in stores
    ]
    plan = {
        # a store re-created in place must not reuse partials of the old one
        "stores_created_at": [s.meta.get("created_at") for s in stores],
        "sources": sources,
        "unit": unit,
        "shard_tokens": shard_tokens,
        "shift": shift,
        "version": 2,  # 2: reduced ranges are Parquet parts
    }
    work = out / WORK_NAME
    if (work / "plan.json").exists() and read_json(work / "plan.json") != json.loads(
        json.dumps(plan)
    ):
        log.info("%s: inputs or settings changed since the unfinished run; starting over", work)
        shutil.rmtree(work)
    (work / "partials").mkdir(parents=True, exist_ok=True)
    (work / "reduced").mkdir(parents=True, exist_ok=True)
    write_json_atomic(work / "plan.json", plan)

    warm_kernels()
    import pyarrow.parquet  # noqa: F401  (here, so forked reduce workers inherit it loaded)

    executor = executor or LocalExecutor(workers)
    tasks = plan_map_tasks(stores, work, row, shard_tokens, shift, vocab_size)
    todo = [t for t in tasks if not Path(t.out).is_file()]
    total_tokens = sum(t.n_pairs for t in tasks)
    resumed = len(tasks) - len(todo)
    if resumed:
        log.info("resuming: %d of %d shards already counted", resumed, len(tasks))
    t_map = time.time()
    with tqdm(
        total=total_tokens,
        initial=total_tokens - sum(t.n_pairs for t in todo),
        unit="tok",
        unit_scale=True,
        desc="count: map",
        disable=not progress,
    ) as bar:
        for task, _ in executor.map_unordered(count_shard, todo):
            bar.update(task.n_pairs)
    t_map = time.time() - t_map

    partials = [t.out for t in tasks]
    edge = boundary_keys(stores, row, shift)
    if edge.size:
        edge_out = work / "partials" / "boundaries.bin"
        if not edge_out.is_file():
            keys, counts = count_keys(edge)
            offsets = np.append(
                np.searchsorted(keys, bucket_bounds(shift, vocab_size).astype(keys.dtype)),
                keys.size,
            )
            write_partial(edge_out, keys, counts, offsets.astype(np.int64))
        partials.append(str(edge_out))

    t_reduce = time.time()
    ranges_path = work / "reduced" / "ranges.json"
    if ranges_path.exists():
        ranges = [tuple(r) for r in read_json(ranges_path)["ranges"]]
    else:
        sizes = sum(bucket_sizes(p) for p in partials) if partials else np.zeros(1, dtype=np.int64)
        # a fixed size, not a fraction of the total, so a reduce task's memory does not grow
        # with the corpus: more data means more ranges, not bigger ones
        target = REDUCE_RANGE_ENTRIES
        ranges = plan_ranges(np.asarray(sizes), target)
        write_json_atomic(ranges_path, {"ranges": ranges})
    reduce_tasks = [
        ReduceTask(
            partials=tuple(partials),
            b_lo=lo,
            b_hi=hi,
            out=str(work / "reduced" / f"r{j:05d}.parquet"),
            shift=shift,
            batch_entries=REDUCE_RANGE_ENTRIES,
        )
        for j, (lo, hi) in enumerate(ranges)
    ]
    pending = [t for t in reduce_tasks if not Path(t.out).exists()]
    finished = {t.out for t in reduce_tasks} - {t.out for t in pending}

    def reduced_in_order(bar):
        """Final ranges in key order, written while later ranges are still being reduced."""
        next_index = 0

        def ready():
            nonlocal next_index
            while next_index < len(reduce_tasks) and reduce_tasks[next_index].out in finished:
                path = reduce_tasks[next_index].out
                next_index += 1
                yield path

        yield from ready()
        for task, _ in executor.map_unordered(reduce_range, pending):
            finished.add(task.out)
            bar.update(1)
            yield from ready()
        yield from ready()

    with tqdm(
        total=len(reduce_tasks),
        initial=len(finished),
        unit="range",
        desc="count: reduce",
        disable=not progress,
    ) as bar:
        distinct, total_pairs = write_bigrams(out / BIGRAMS_NAME, reduced_in_order(bar))
    t_reduce = time.time() - t_reduce
    expected_pairs = sum((s.n_tokens - 1 if s.n_tokens else 0) for s in stores) + edge.size
    if (
        row is None and total_pairs != expected_pairs
    ):  # the stream unit counts every pair exactly once
        raise RuntimeError(
            f"count: {total_pairs} pairs written but the stream has {expected_pairs}"
        )
    wall = time.time() - t0
    meta = build_meta(
        "count",
        config=config
        or {"tokens": [str(p) for p in store_paths], "unit": unit, "shard_tokens": shard_tokens},
        inputs={"stores": sources},
        counts={
            "tokens": sum(s.n_tokens for s in stores),
            "shards": len(tasks),
            "shards_resumed": resumed,
            "reduce_ranges": len(ranges),
        },
        wall_time_s=wall,
        throughput={
            "tokens_per_s": sum(s.n_tokens for s in stores) / max(wall, 1e-9),
            "map_s": t_map,
            "reduce_and_write_s": t_reduce,
        },
        fingerprint=stores[0].fingerprint,
        total_pairs=total_pairs,
        distinct_bigrams=distinct,
        unit=unit,
        sources=sources,
    )
    write_meta(out, meta)
    shutil.rmtree(work, ignore_errors=True)
    return meta
