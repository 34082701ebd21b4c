"""The region table of bigram counts (16-bit ids, counts below 2**32): built from the sorted rows
of bigrams.parquet, probed by compiled code (`BigramCounts.lookup`, the tag kernel).

`bigrams.parquet` is sorted by (prev, next), so each `prev` gets its own region of `slots`,
`starts[prev] .. starts[prev + 1]`, twice as many slots as it has distinct `next` ids: an
open-addressing table (linear probing, wrapping inside the region, load 0.5) keyed by `next`
alone. A slot packs `next << 32 | count`; 0 is empty (stored counts are >= 1). Building it places
each region in turn as the sorted rows stream in (one pass, cache-friendly, no global scatter),
so it costs about as much as reading the counts; a lookup is one load from `starts` (512 KB,
mostly in cache) and on average 1.5 probes in one cache line.

`region_lookup`, `prefetch_slot` and `prefetch` are compiled helpers other kernels call
(`ar_slicing.algorithms.tag_kernels`): after `compiled()` they are numba functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ar_slicing.algorithms.jit import lazily_compiled

_FIB32 = 0x9E3779B1  # 2**32 / golden ratio: multiplicative hashing of `next` inside a region
# Lookups are prefetched this many queries ahead: enough to keep ~20 cache misses in flight.
PREFETCH = 16


@dataclass(frozen=True)
class RegionTable:
    """`starts` (int64, 65537 entries) and `slots` (uint64, two per distinct bigram)."""

    starts: np.ndarray
    slots: np.ndarray

    def probe(self, prev: np.ndarray, nxt: np.ndarray, out: np.ndarray) -> None:
        """out[i] = count of (prev[i], nxt[i]) (int64 ids and counts), 0 if unseen."""
        compiled()["probe_regions"](self.starts, self.slots, prev, nxt, out)


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


# ---- building the table from bigrams.parquet ---------------------------------------------------


def build_region_table(row_groups, n_rows: int) -> tuple[RegionTable, int] | None:
    """The region table of `n_rows` rows given as (prev, next, count) arrays, in order of prev,
    and their total count; None without numba or when the rows do not fit the table (ids of 16
    bits or more, counts of 2**32 or more) or are not in order."""
    starts = np.full((1 << 16) + 1, -1, np.int64)
    slots = np.zeros(max(1, 2 * n_rows), np.uint64)
    state = np.array([-1, 0, 0, 0], np.int64)  # the current prev's run, and the total count
    run_next, run_count = np.empty(1 << 16, np.int64), np.empty(1 << 16, np.int64)
    kernels, row = None, 0
    for p, q, c in row_groups:
        # asked for once the first rows are decoded: the tag stage loads them on another thread
        kernels = kernels or compiled()
        if kernels is None:
            return None
        if not kernels["build_sorted"](p, q, c, row, state, run_next, run_count, starts, slots):
            return None
        row += len(p)
    kernels = kernels or compiled()
    if kernels is None or row != n_rows:
        return None
    kernels["finish_sorted"](state, run_next, run_count, starts, slots, row)
    return RegionTable(starts, slots), int(state[3])


def read_region_table(file) -> tuple[RegionTable, int, int] | None:
    """The region table of an open bigrams.parquet (`pq.ParquetFile`), its number of rows and
    total count, or None (see `build_region_table`). Row groups are read one at a time, their
    three columns decoded in parallel, so decoded rows never pile up in memory."""
    import os

    if os.environ.get("ARSLICE_NO_NUMBA"):
        return None
    groups = (
        file.read_row_group(g, columns=["prev", "next", "count"])
        for g in range(file.num_row_groups)
    )
    n_rows = file.metadata.num_rows
    built = build_region_table(
        (tuple(t.column(k).to_numpy() for k in range(3)) for t in groups), n_rows
    )
    return None if built is None else (built[0], n_rows, built[1])


# ---- compiling -----------------------------------------------------------------------------------


def _jit_all(jit) -> dict:
    """The table's kernels, or None without numba (or with ARSLICE_NO_NUMBA=1)."""
    global region_home, region_lookup, prefetch_slot, prefetch, _place_run
    prefetch = _prefetch_intrinsic()
    region_home = jit(region_home)
    region_lookup = jit(region_lookup)
    prefetch_slot = jit(prefetch_slot)
    _place_run = jit(_place_run)
    return {
        "build_sorted": jit(build_sorted_kernel),
        "finish_sorted": jit(finish_sorted_kernel),
        "probe_regions": jit(probe_regions_kernel),
    }


compiled = lazily_compiled(_jit_all)


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
    """Compile (or load from numba's cache) the signatures the count and tag stages use."""
    k = compiled()
    if k is None:
        return

    def read_only(array):
        array.flags.writeable = False
        return array

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
