"""The map step: one shard -> a partial counts file (sorted distinct pairs, counts, bucket offsets).

Partials are sorted, so a `prev` range is a contiguous slice of each one, found through the
bucket offsets stored beside it; the reduce step (`reduce`) reads such slices. Partials of 16-bit
ids take 3 bytes a distinct pair (`Compact16`: per-prev offsets, a uint16 next, a one-byte count
with escapes). A map task holds one shard (about 7 bytes a token at most).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts.kernels import kernels
from ar_slicing.algorithms.counts.keys import bucket_bounds, count_keys, merge_counted, pair_keys
from ar_slicing.errors import BadInput


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
    """Write arrays one after another through the project's one atomic write (a full disk
    leaves no torn file holding its space)."""
    from ar_slicing.machinery.io import atomic_path

    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        for part in arrays:
            f.write(memoryview(np.ascontiguousarray(part)).cast("B"))


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
    """Partial entries in each fine bucket of a partial file (from its header alone)."""
    with open(path, "rb") as f:
        return np.diff(_partial_header(f, path)[1])
