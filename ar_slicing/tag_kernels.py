"""Compiled (numba) kernel of the tag stage: one pass that tags a batch of windows.

Tagging (`tag_batch`): one pass per window over its targets. A small table keyed by the bigram
(emptied after each window) finds the most recent earlier target of the same bigram in the
window (its `prev_pos`) and that target's count, so only a window's first occurrence of a bigram
goes to the training counts' region table (`ar_slicing.counts.regions`). The table slot of the
target PREFETCH places ahead is prefetched, so the cache misses of successive lookups overlap
instead of following one another.

Copy lengths (`match_len`, docs/copy-length.md) come out of the same pass, exactly. The table
also links every target to the previous one of its bigram (`chain`), so a target's candidates
are the earlier occurrences of its bigram, most recent first. match_len(i) <= match_len(i-1) + 1
(a copy of m+1 tokens ending at i holds one of m ending at i-1), so inside a copy the previous
target's match extended by one token is already the longest, one comparison; only where that
fails does the chain get walked, extending each candidate backwards token by token (capped at
match_len(i-1) + 1, stopping at the first candidate that reaches it or once the candidates lie too
close to the window start to beat the best so far).
"""

from __future__ import annotations

import numpy as np

from ar_slicing.counts import regions
from ar_slicing.counts.regions import PREFETCH, prefetch, prefetch_slot, region_lookup
from ar_slicing.jit import lazily_compiled

_FIB64 = 0x9E3779B97F4A7C15


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
    copy_lengths,
    chain,
    match_len,
):
    """Tag targets 0..n-1 of a batch (target k is the bigram tokens[k], tokens[k+1]).

    Target k has stream index first_window*L + 1 + k; d0 is the row of its document in
    `doc_offsets`. Every column but `pos` is written (positions are the same for every batch);
    `ids` gets the batch's tokens as int32, ids[:n] being the `prev` column and ids[1:] `token`. With `use_table` the counts come from the region table (`starts`, `slots`)
    and `train_count`, `is_ar_hit` are final; without it `head_of[k]` is the index of the
    window's first target with k's bigram (k itself for a first occurrence), for the caller to
    look those up and spread them. With `copy_lengths`, `match_len` gets each target's copy
    length (`chain`: window-local scratch, one entry per target of a window); without it
    `match_len` is left as it was (the benchmark's baseline).
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
    # `tokens` index of the first token a copy may start at in d's document, with the reset:
    # the token before the document's first (an earlier occurrence must be a target of the
    # document, the bigram's first token may be the previous document's EOS)
    doc_origin = doc_offsets[d] - first_window * L - 1
    if use_table:
        for k in range(min(PREFETCH, n)):
            prefetch_slot(starts, slots, tokens[k], tokens[k + 1])
    for k0 in range(0, n, L):
        k1 = min(k0 + L, n)
        w = first_window + k0 // L
        n_touched = 0
        run_m = 0  # match_len of the previous target of the window, and where its copy ends
        run_e = 0
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
                doc_origin = doc_offsets[d] - first_window * L - 1
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
            earlier = -1
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
            if copy_lengths:
                chain[j] = earlier
                if pp == 0:
                    run_m = 0
                elif run_m == 0:
                    run_m, run_e = 1, earlier  # after a non-repeat, a bigram is the longest
                elif tokens[k0 + run_e + 2] == tokens[k + 1]:
                    run_m += 1  # the previous target's copy goes on: the longest possible
                    run_e += 1
                else:
                    origin = max(k0, doc_origin) if reset else k0
                    run_m, run_e = _longest_copy(tokens, k0, k, earlier, run_m + 1, origin, chain)
                match_len[k] = run_m
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


def _longest_copy(tokens, k0, k, e, cap, origin, chain):
    """(m, e) for target k (its bigram's most recent earlier target: window-local e): the
    longest copy m <= cap of the tokens ending at k + 1 among the earlier targets of its bigram,
    walked through `chain`, and the target where it ends. A copy of m ending at target c covers
    tokens k0 + c + 1 - m .. k0 + c + 1, none before `origin`."""
    best, best_e = 1, e
    while e >= 0 and best < cap:
        reach = k0 + e + 1 - origin  # the longest copy ending at e that starts at `origin`
        if reach <= best:
            break  # every earlier candidate reaches less far back
        top = min(cap, reach)
        m = 1
        while m < top and tokens[k0 + e - m] == tokens[k - m]:
            m += 1
        if m > best:
            best, best_e = m, e
        e = chain[e]
    return best, best_e


def slice_counts_kernel(subset, is_repeat, is_ar_hit, out):
    """out[code + 1] += (1, is_repeat, is_ar_hit) for every row (code -1 = no subset)."""
    for k in range(subset.size):
        c = subset[k] + 1
        out[c, 0] += 1
        out[c, 1] += is_repeat[k]
        out[c, 2] += is_ar_hit[k]


def _jit_all(jit) -> dict:
    """The compiled kernels, or None without numba (or with ARSLICE_NO_NUMBA=1)."""
    global region_lookup, prefetch_slot, prefetch
    if regions.compiled() is None:
        return {}
    # the region table's compiled helpers, which the tag kernel calls
    region_lookup, prefetch_slot, prefetch = (
        regions.region_lookup,
        regions.prefetch_slot,
        regions.prefetch,
    )
    global _longest_copy
    _longest_copy = jit(_longest_copy)
    return {
        "tag_batch": jit(tag_batch_kernel),
        "slice_counts": jit(slice_counts_kernel),
    }


compiled = lazily_compiled(_jit_all)


def warm() -> None:
    """Compile (or load from numba's cache) the signatures the tag stage uses, in this process."""
    k = compiled()
    if k is None:
        return
    regions.warm()

    def read_only(array):
        array.flags.writeable = False
        return array

    starts = read_only(np.array([0, 2], np.int64))
    slots = read_only(np.zeros(2, np.uint64))
    one32 = np.zeros(1, np.int32)
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
            True,
            np.zeros(1, np.int32),
            np.zeros(1, np.int32),
        )
    k["slice_counts"](
        one32, np.zeros(1, np.bool_), np.zeros(1, np.bool_), np.zeros((2, 3), np.int64)
    )
