"""Compiled (numba) kernels of the count stage: the map count, the partial merge, the hash table.

The same algorithms run in plain numpy when numba is missing or ARSLICE_NO_NUMBA=1; the
kernels only avoid numpy's full sort and its extra passes. They are compiled on first use
and cached on disk beside this file. The functions here take and fill plain arrays; the
callers that allocate them are in `partials` (map, merge) and `lookup` (hash table).
"""

from __future__ import annotations

import itertools

import numpy as np

from ar_slicing.algorithms.jit import lazily_compiled


def _count_u16_kernel(tokens, row, phase, nexts, out_next, out_c8, prev_offsets, escaped):
    """Counts of the pairs (tokens[j], tokens[j+1]) of a uint16 shard, as a compact partial.

    A counting sort by `prev` (histogram, then scatter of `next` into per-prev segments), then
    each segment counted in a 65536-entry scratch table that stays in cache, and emitted in
    `next` order by walking a two-level bitmap of the entries it touched (no sorting at all).
    With `row` > 0, pair j is skipped when (phase + j + 1) % row == 0 (phase = stream index of
    tokens[0] % row).

    Output (see `partials.write_partial16`): distinct pair i is (prev, out_next[i]) with prev
    the p for which prev_offsets[p] <= i < prev_offsets[p + 1]; its count is out_c8[i], or,
    where that is 255, the next of `escaped`. Returns (distinct pairs, escaped counts, pairs
    counted). `nexts` (scatter space), out_next and out_c8 hold at least len(tokens) - 1 entries.
    """
    hist = _bucket_by_prev(tokens, row, phase, nexts)
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


def _bucket_by_prev(tokens, row, phase, nexts):
    """Counting sort of the pairs (tokens[j], tokens[j+1]) by `prev`: the `next` ids of prev p
    land in nexts[hist[p]:hist[p + 1]], in stream order; returns `hist` (65537 entries, its last
    the number of pairs). With `row` > 0, pair j is skipped when (phase + j + 1) % row == 0."""
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
    return hist


def _count_restricted_u16_kernel(tokens, row, phase, nexts, key_offsets, key_next, acc):
    """Add the counts of the pairs of a uint16 shard to acc[j], for the allowed pairs j only.

    The allowed pairs are sorted keys given per prev: pair j = (p, key_next[j]) for
    key_offsets[p] <= j < key_offsets[p + 1]. Pairs are bucketed by prev as in the map kernel;
    then each prev's bucket is counted in the scratch table and read out at its allowed `next`
    ids, or, where the bucket is much smaller than the prev's allowed ids, each of its pairs is
    found among them by binary search. Returns the number of pairs of the shard (all of them,
    allowed or not). `nexts` (scatter space) holds at least len(tokens) - 1 entries.
    """
    hist = _bucket_by_prev(tokens, row, phase, nexts)
    scratch = np.zeros(65536, np.uint32)
    for p in range(65536):
        a = hist[p]
        b = hist[p + 1]
        k0 = key_offsets[p]
        k1 = key_offsets[p + 1]
        if a == b or k0 == k1:
            continue
        if 8 * (b - a) < k1 - k0:
            allowed = key_next[k0:k1]
            for i in range(a, b):
                x = nexts[i]
                j = np.searchsorted(allowed, x)
                if j < allowed.size and allowed[j] == x:
                    acc[k0 + j] += 1
            continue
        for i in range(a, b):
            scratch[nexts[i]] += 1
        for j in range(k0, k1):
            acc[j] += scratch[key_next[j]]
        for i in range(a, b):
            scratch[nexts[i]] = 0
    return hist[65536]


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


# ---- the touched-entries bitmap of a `prev` segment ------------------------------------------

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


def _walk_bitmap(bits, summary, out, d):
    """Write the marked `next` values in increasing order to out[d:], clearing the bitmap.

    Returns the index past the last one written."""
    for sw in range(16):
        s = summary[sw]
        while s != 0:
            low = s & (~s + np.uint64(1))
            w = sw * 64 + _CTZ[(low * _DEBRUIJN) >> np.uint64(58)]
            b = bits[w]
            while b != 0:
                lb = b & (~b + np.uint64(1))
                out[d] = w * 64 + _CTZ[(lb * _DEBRUIJN) >> np.uint64(58)]
                d += 1
                b ^= lb
            bits[w] = 0
            s ^= low
        summary[sw] = 0
    return d


def _emit_compact(scratch, bits, summary, out_next, out_c8, escaped, d, e):
    """A segment's touched entries in `next` order as `next` and a one-byte count (255: escaped),
    clearing them."""
    end = _walk_bitmap(bits, summary, out_next, d)
    for i in range(d, end):
        x = out_next[i]
        c = scratch[x]
        if c >= 255:
            out_c8[i] = 255
            escaped[e] = c
            e += 1
        else:
            out_c8[i] = c
        scratch[x] = 0
    return end, e


def _emit_segment(p, scratch, bits, summary, out_keys, out_counts, d):
    """Write prev `p`'s touched entries in `next` order as keys and counts, clearing them."""
    end = _walk_bitmap(bits, summary, out_keys, d)
    base = np.uint32(p) << np.uint32(16)
    for i in range(d, end):
        x = out_keys[i]
        out_counts[i] = scratch[x]
        scratch[x] = 0
        out_keys[i] = base | x
    return end


# ---- the open-addressing hash table (ids of 16 bits and more) --------------------------------


def _home_slot(key, size):
    """Top 32 bits of the key's Fibonacci hash, scaled to the table size (as `lookup._slots`)."""
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


def _jit_all(jit) -> dict:
    """The compiled kernels, or None (numpy fallback) without numba or with ARSLICE_NO_NUMBA=1."""
    global _emit_segment, _emit_compact, _walk_bitmap, _touch, _home_slot, _bucket_by_prev
    _bucket_by_prev = jit(_bucket_by_prev)
    _touch = jit(_touch)
    _walk_bitmap = jit(_walk_bitmap)
    _emit_segment = jit(_emit_segment)
    _emit_compact = jit(_emit_compact)
    _home_slot = jit(_home_slot)
    return {
        "count_u16": jit(_count_u16_kernel),
        "count_restricted_u16": jit(_count_restricted_u16_kernel),
        "merge16": jit(_merge16_kernel),
        "build_split": jit(_build_split_kernel),
        "probe_split": jit(_probe_split_kernel),
    }


kernels = lazily_compiled(_jit_all)


def warm_kernels() -> None:
    """Compile (or load from the cache) every kernel now, in this process, for the argument
    types `partials` and `lookup` pass.

    Called before the worker pool forks, so workers inherit the machine code instead of each
    loading it again (seconds per worker on a busy machine).
    """
    k = kernels()
    if k is None:
        return
    offsets = np.empty(65537, np.int64)
    out_next, out_c8 = np.empty(2, np.uint16), np.empty(2, np.uint8)
    tokens = np.array([1, 2, 1], dtype=np.uint16)
    d, _, _ = k["count_u16"](
        tokens, 0, 0, np.empty(2, np.uint16), out_next, out_c8, offsets, np.empty(1, np.int64)
    )
    k["merge16"](
        np.concatenate([out_next[:d]] * 2),
        np.concatenate([out_c8[:d]] * 2),
        np.stack([offsets, offsets + d]),
        np.zeros(0, np.int64),
        np.zeros(3, np.int64),
        0,
        np.empty(2 * d, np.uint32),
        np.empty(2 * d, np.int64),
    )
    one = np.ones(1, np.int64)
    for key_dtype, value_dtype in itertools.product((np.uint32, np.uint64), (np.uint32, np.int64)):
        table_keys, table_values = np.zeros(2, key_dtype), np.zeros(2, value_dtype)
        k["build_split"](
            np.array([1], key_dtype), one.astype(value_dtype), table_keys, table_values
        )
        k["probe_split"](table_keys, table_values, 2, 16, one, one, np.zeros(1, np.int64))
