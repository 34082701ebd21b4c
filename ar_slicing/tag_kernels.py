"""Compiled (numba) kernels of the tag stage: the per-`prev` bigram count table and one pass that
tags a batch of windows.

Count table (16-bit ids, counts below 2**32). `bigrams.parquet` is sorted by (prev, next), so
each `prev` gets its own region of `slots`, `starts[prev] .. starts[prev + 1]`, twice as many
slots as it has distinct `next` ids: an open-addressing table (linear probing, wrapping inside the
region, load 0.5) keyed by `next` alone. A slot packs `next << 32 | count`; 0 is empty (stored
counts are >= 1). Building it places each region in turn as the sorted rows stream in (one pass,
cache-friendly, no global scatter), so it costs about as much as reading the counts; a lookup is
one load from `starts` (512 KB, mostly in cache) and on average 1.5 probes in one cache line.

Tagging (`tag_batch`): one pass per window over its targets. A small table keyed by the bigram
(emptied after each window) finds the most recent earlier target of the same bigram in the
window (its `prev_pos`) and that target's count, so only a window's first occurrence of a bigram
goes to the count table. The count-table slot of the target PREFETCH places ahead is prefetched,
so the cache misses of successive lookups overlap instead of following one another.
"""

from __future__ import annotations

import threading

import numpy as np

_FIB32 = 0x9E3779B1  # 2**32 / golden ratio: multiplicative hashing of `next` inside a region
_FIB64 = 0x9E3779B97F4A7C15
# Lookups are prefetched this many targets ahead: enough to keep ~20 cache misses in flight.
PREFETCH = 16


def region_home(q, size):
    """Home slot (0 .. size-1) of `next` id `q` in a region of `size` slots."""
    h = (np.uint64(q) * np.uint64(_FIB32)) & np.uint64(0xFFFFFFFF)
    return np.int64((h * np.uint64(size)) >> np.uint64(32))


def region_lookup(starts, slots, p, q):
    """Count of bigram (p, q) in the region table, 0 if unseen."""
    r0 = starts[p]
    size = starts[p + 1] - r0
    if size == 0:
        return np.int64(0)
    s = region_home(q, size)
    key = np.uint64(q)
    while True:
        v = slots[r0 + s]
        if v == 0:
            return np.int64(0)
        if (v >> np.uint64(32)) == key:
            return np.int64(v & np.uint64(0xFFFFFFFF))
        s += 1
        if s == size:
            s = 0


def prefetch_slot(starts, slots, p, q):
    """Ask for the cache line of (p, q)'s home slot without waiting for it."""
    r0 = starts[p]
    size = starts[p + 1] - r0
    if size > 0:
        prefetch(slots, r0 + region_home(q, size))


def prefetch(array, index):
    """Prefetch array[index] into the cache (replaced by an LLVM intrinsic under numba)."""


def build_sorted_kernel(prev, nxt, counts, row0, state, run_next, run_count, starts, slots):
    """Add rows row0, row0+1, ... of a table sorted by prev to the region table.

    Regions tile `slots` in row order: the rows of `prev` p, from row r on, own slots 2r onwards,
    two per row, so a region is placed once its rows are all seen. `state` carries the run of
    the current prev across calls (prev, its first row, its rows so far, and the total count);
    `run_next` and `run_count` hold that run. Returns 0, having stopped, on rows the table
    cannot hold (ids outside 0..65535, counts of 2**32 or more, prev decreasing).
    """
    cur, first, m = state[0], state[1], state[2]
    for i in range(prev.size):
        p, q, c = np.int64(prev[i]), np.int64(nxt[i]), np.int64(counts[i])
        if p < 0 or p >= 65536 or q < 0 or q >= 65536 or c < 0 or c >= np.int64(1) << 32:
            return 0
        if p != cur:
            if p < cur:
                return 0
            if m > 0:
                _place_run(cur, first, m, run_next, run_count, starts, slots)
            cur, first, m = p, row0 + i, 0
        if m == run_next.size:
            return 0
        run_next[m] = q
        run_count[m] = c
        m += 1
        state[3] += c
    state[0], state[1], state[2] = cur, first, m
    return 1


def finish_sorted_kernel(state, run_next, run_count, starts, slots, n_rows):
    """Place the last run; prevs without rows get empty regions where the next one starts."""
    if state[2] > 0:
        _place_run(state[0], state[1], state[2], run_next, run_count, starts, slots)
    starts[starts.size - 1] = 2 * n_rows
    for p in range(starts.size - 2, -1, -1):
        if starts[p] < 0:
            starts[p] = starts[p + 1]


def _place_run(p, first, m, run_next, run_count, starts, slots):
    """Region of prev p: its m rows from row `first`, in 2m slots from slot 2*first."""
    r0 = 2 * first
    size = 2 * m
    starts[p] = r0
    for t in range(m):
        s = region_home(run_next[t], size)
        while slots[r0 + s] != 0:
            s += 1
            if s == size:
                s = 0
        slots[r0 + s] = (np.uint64(run_next[t]) << np.uint64(32)) | np.uint64(run_count[t])


def probe_regions_kernel(starts, slots, prev, nxt, out):
    """out[i] = count of (prev[i], nxt[i]), 0 if unseen or outside the 16-bit id range.

    The home slot of the query PREFETCH queries ahead is requested before this one is resolved,
    so cache misses overlap instead of following one another.
    """
    n = prev.size
    for i in range(n):
        j = i + PREFETCH
        if j < n and 0 <= prev[j] < 65536 and 0 <= nxt[j] < 65536:
            prefetch_slot(starts, slots, prev[j], nxt[j])
        p = prev[i]
        q = nxt[i]
        if p < 0 or p >= 65536 or q < 0 or q >= 65536:
            out[i] = 0
        else:
            out[i] = region_lookup(starts, slots, p, q)


def tag_batch_kernel(
    tokens,
    doc_offsets,
    doc_ids,
    subset_code,
    n,
    L,
    first_window,
    vocab,
    d0,
    reset,
    threshold,
    use_table,
    starts,
    slots,
    window_id,
    doc_id,
    ids,
    train_count,
    prev_pos,
    is_repeat,
    is_ar_hit,
    subset,
    head_of,
):
    """Tag targets 0..n-1 of a batch (target k is the bigram tokens[k], tokens[k+1]).

    Target k has stream index first_window*L + 1 + k; d0 is the row of its document in
    `doc_offsets`. Every column but `pos` is written (positions are the same for every batch);
    `ids` gets the batch's tokens as int32, ids[:n] being the `prev` column and ids[1:] `token`. With `use_table` the counts come from the region table (`starts`, `slots`)
    and `train_count`, `is_ar_hit` are final; without it `head_of[k]` is the index of the
    window's first target with k's bigram (k itself for a first occurrence), for the caller to
    look those up and spread them.
    """
    # window-local table of the bigrams seen so far: load at most 1/4, so most probes end on the
    # home slot; `touched` lists the used slots, cleared again after each window
    span = min(L, n)
    bits = 2
    while (1 << bits) < 4 * span:
        bits += 1
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    lkey = np.zeros(1 << bits, np.uint64)  # bigram key + 1; 0 = empty
    lidx = np.zeros(1 << bits, np.int32)  # its most recent target, as an index in the window
    touched = np.empty(span, np.int64)
    drow = np.empty(span, np.int64)
    n_docs = doc_offsets.size
    index0 = first_window * L + 1
    d = d0
    next_doc = doc_offsets[d + 1] if d + 1 < n_docs else np.int64(1) << 62
    if use_table:
        for k in range(min(PREFETCH, n)):
            prefetch_slot(starts, slots, tokens[k], tokens[k + 1])
    for k0 in range(0, n, L):
        k1 = min(k0 + L, n)
        w = first_window + k0 // L
        n_touched = 0
        for k in range(k0, k1):
            if use_table and k + 2 * PREFETCH < n:
                # two stages: the region bounds of the target 2 PREFETCH ahead, then the slot of
                # the one PREFETCH ahead (whose bounds are in cache by now)
                prefetch(starts, np.int64(tokens[k + 2 * PREFETCH]))
                prefetch_slot(starts, slots, tokens[k + PREFETCH], tokens[k + PREFETCH + 1])
            elif use_table and k + PREFETCH < n:
                prefetch_slot(starts, slots, tokens[k + PREFETCH], tokens[k + PREFETCH + 1])
            j = k - k0
            i = index0 + k
            while i >= next_doc:
                d += 1
                next_doc = doc_offsets[d + 1] if d + 1 < n_docs else np.int64(1) << 62
            drow[j] = d
            p = tokens[k]
            q = tokens[k + 1]
            key = np.uint64(p) * np.uint64(vocab) + np.uint64(q) + np.uint64(1)
            h = np.int64((key * np.uint64(_FIB64)) >> shift)
            while True:
                v = lkey[h]
                if v == key or v == 0:
                    break
                h = (h + 1) & mask
            pp = 0
            if v == key:
                earlier = lidx[h]
                # the most recent earlier target: in the same document unless one started since
                if not reset or drow[earlier] == d:
                    pp = earlier + 1
                c = train_count[k0 + earlier]
                if not use_table:
                    head_of[k] = head_of[k0 + earlier]
            else:
                lkey[h] = key
                touched[n_touched] = h
                n_touched += 1
                if use_table:
                    c = region_lookup(starts, slots, p, q)
                else:
                    c = 0
                    head_of[k] = k
            lidx[h] = j
            window_id[k] = w
            doc_id[k] = doc_ids[d]
            subset[k] = subset_code[d]
            ids[k] = p
            train_count[k] = c
            prev_pos[k] = pp
            repeat = pp > 0
            is_repeat[k] = repeat
            is_ar_hit[k] = repeat & (c <= threshold)
        for t in range(n_touched):
            lkey[touched[t]] = 0
    if n > 0:
        ids[n] = tokens[n]


def slice_counts_kernel(subset, is_repeat, is_ar_hit, out):
    """out[code + 1] += (1, is_repeat, is_ar_hit) for every row (code -1 = no subset)."""
    for k in range(subset.size):
        c = subset[k] + 1
        out[c, 0] += 1
        out[c, 1] += is_repeat[k]
        out[c, 2] += is_ar_hit[k]


_COMPILED: dict | None = None
_COMPILING = threading.Lock()  # the stage loads them on one thread while another may ask


def compiled() -> dict | None:
    """The compiled kernels, or None without numba (or with ARSLICE_NO_NUMBA=1)."""
    global _COMPILED
    import os

    if os.environ.get("ARSLICE_NO_NUMBA"):
        return None
    with _COMPILING:
        if _COMPILED is None:
            _COMPILED = _jit_all()
    return _COMPILED or None


def _jit_all() -> dict:
    """The kernels wrapped for numba ({} without numba); compiled on first call, cached on disk."""
    global region_home, region_lookup, prefetch_slot, prefetch, _place_run
    try:
        import numba
    except ImportError:
        return {}
    jit = numba.njit(cache=True, nogil=True)
    prefetch = _prefetch_intrinsic()
    region_home = jit(region_home)
    region_lookup = jit(region_lookup)
    prefetch_slot = jit(prefetch_slot)
    _place_run = jit(_place_run)
    return {
        "build_sorted": jit(build_sorted_kernel),
        "finish_sorted": jit(finish_sorted_kernel),
        "probe_regions": jit(probe_regions_kernel),
        "tag_batch": jit(tag_batch_kernel),
        "slice_counts": jit(slice_counts_kernel),
    }


def _prefetch_intrinsic():
    """`prefetch(array, index)`: LLVM's prefetch of the element's address (read, keep in all
    cache levels); it never faults, whatever the index."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, array, index):
        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            ary = context.make_array(array_type)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(
                context, builder, array_type, ary, [args[1]], wraparound=False
            )
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                # mangled as this llvmlite's LLVM expects (p0i8 with typed pointers)
                "llvm.prefetch." + i8p.intrinsic_name,
            )
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, types.intp), codegen

    return prefetch


def warm() -> None:
    """Compile (or load from numba's cache) the signatures the tag stage uses, in this process."""
    k = compiled()
    if k is None:
        return

    def read_only(array):
        array.flags.writeable = False
        return array

    starts = read_only(np.array([0, 2], np.int64))
    slots = read_only(np.zeros(2, np.uint64))
    one32 = np.zeros(1, np.int32)
    one64 = np.zeros(1, np.int64)
    # the rows come straight from Parquet, read-only
    rows = [read_only(np.zeros(1, dtype)) for dtype in (np.int32, np.int32, np.int64)]
    state, run = np.array([-1, 0, 0, 0], np.int64), np.zeros(1, np.int64)
    starts_w, slots_w = np.full(2, -1, np.int64), np.zeros(2, np.uint64)
    k["build_sorted"](*rows, 0, state, run, run.copy(), starts_w, slots_w)
    k["finish_sorted"](state, run, run.copy(), starts_w, slots_w, 1)
    k["probe_regions"](
        np.array([0, 2], np.int64), np.zeros(2, np.uint64), one64, one64, one64.copy()
    )
    for use_table in (True, False):
        columns = [np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(2, np.int32)]
        columns += [np.zeros(1, dtype) for dtype in (np.int64, np.int32)]
        columns += [np.zeros(1, np.bool_), np.zeros(1, np.bool_), np.zeros(1, np.int32)]
        k["tag_batch"](
            read_only(np.zeros(2, np.uint16)),
            read_only(np.zeros(1, np.int64)),
            read_only(np.zeros(1, np.int64)),
            read_only(np.zeros(1, np.int32)),
            1,
            1,
            0,
            65536,
            0,
            False,
            0,
            use_table,
            starts,
            slots,
            *columns,
            np.zeros(1, np.int64),
        )
    k["slice_counts"](
        one32, np.zeros(1, np.bool_), np.zeros(1, np.bool_), np.zeros((2, 3), np.int64)
    )
