"""Compiled (numba) kernels of the tag stage: a batch of windows tagged in one pass, the same pass
listing the long copies whose span n-grams the tags need counted, and the per-subset counts.

Tagging (`tag_batch`): one pass per window over its targets. A small table keyed by the bigram
(emptied after each window) finds the most recent earlier target of the same bigram in the
window (its `prev_pos`) and that target's count, so only a window's first occurrence of a bigram
goes to the training counts' region table (`ar_slicing.algorithms.counts.regions`). The table slot of the
target PREFETCH places ahead is prefetched, so the cache misses of successive lookups overlap
instead of following one another.

Copy lengths (`match_len`, docs/copy-length.md) come out of the same pass, exactly. The table
also links every target to the previous one of its bigram (`chain`), so a target's candidates
are the earlier occurrences of its bigram, most recent first. match_len(i) <= match_len(i-1) + 1
(a copy of m+1 tokens ending at i holds one of m ending at i-1), so inside a copy the previous
target's match extended by one token is already the longest, one comparison; only where that
fails does the chain get walked, extending each candidate backwards token by token (capped at
match_len(i-1) + 1, stopping at the first candidate that reaches it or once the candidates lie too
close to the window start to beat the best so far). Each bigram's slot also keeps a 32-bit mask
of the tokens that came just before its occurrences (by their low 5 bits), beside its most
recent target: when the target's own preceding token is not in it, no candidate extends to two
bigrams and there is no walk at all.

Span counts are not looked up while tagging. With `long_spans_only` the same pass, its copy
lengths capped at the span order K, writes no columns and looks up no counts: it lists the
targets whose copy is two bigrams or longer (`ar_slicing.algorithms.tags.long_spans`), whose span n-grams
the stage then counts in training. The tagging pass is handed those counts in the same order
(`Tables.span_counts`) and writes them as it meets the same targets again: one sequential read
instead of a hash lookup per long copy.

The kernels take their arguments grouped in named tuples (numba passes them as they are): the
batch (`Batch`), its documents (`BatchDocs`), the tagging rules (`Rules`), the count tables
(`Tables`), the output columns (`Columns`) and scratch space (`Scratch`).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ar_slicing.algorithms.counts import regions
from ar_slicing.algorithms.counts.regions import PREFETCH, prefetch, prefetch_slot, region_lookup
from ar_slicing.algorithms.jit import lazily_compiled
from ar_slicing.algorithms.windows import first_target

_FIB64 = 0x9E3779B97F4A7C15
_LOW32 = np.uint64(0xFFFFFFFF)
_ZERO = np.uint64(0)

# Target k of a batch (0-based) is the bigram tokens[k], tokens[k+1], stream index
# first_target(first_window, L) + k; `n` targets in windows of `L`.
Batch = namedtuple("Batch", "tokens n L first_window")
# `first_row`: the row in `offsets` of the document holding the batch's first target.
BatchDocs = namedtuple("BatchDocs", "offsets doc_ids subset_code first_row")
# `long_spans_only`: list the long copies instead of tagging (see `tag_batch_kernel`).
Rules = namedtuple("Rules", "vocab reset threshold copy_lengths span_order long_spans_only")
# `use_table`: counts from the region table (`starts`, `slots`); `span_counts`: the counts of
# the batch's long copies in target order.
Tables = namedtuple("Tables", "use_table starts slots span_counts")
Columns = namedtuple(
    "Columns",
    "window_id doc_id ids train_count prev_pos is_repeat is_ar_hit subset match_len "
    "span_train_count",
)
# `chain`: one entry per target of a window; `ends` and `orders`: the listed long copies.
Scratch = namedtuple("Scratch", "head_of chain ends orders")


def tag_batch_kernel(batch, docs, rules, tables, columns, scratch):
    """Tag targets 0..n-1 of a batch; returns how many of `tables.span_counts` it used.

    Every column but `pos` is written (positions are the same for every batch); `ids` gets the
    batch's tokens as int32, ids[:n] being the `prev` column and ids[1:] `token`. With
    `use_table` the counts come from the region table and `train_count`, `is_ar_hit` are final;
    without it `head_of[k]` is the index of the window's first target with k's bigram (k itself
    for a first occurrence), for the caller to look those up and spread them, and the span count
    of a one-bigram copy is left for the caller too. With `copy_lengths`, `match_len` gets each
    target's copy length and `span_train_count` its span count; without it both are left as they
    were (the benchmark's baseline).

    With `long_spans_only` (and `copy_lengths`) it writes no column and looks up no count: with
    the copy lengths capped at the span order, it lists the targets whose copy is two bigrams or
    longer, in order, and returns how many: for the t-th, ends[t] = k + 1 (where its span n-gram
    ends in `tokens`) and orders[t] = min(match_len, span_order) + 1 (the n-gram's order).
    (One kernel for both: the copy-length steps are written once, inline in the loop, which
    measured faster than a helper both would call per target.)
    """
    tokens, n, L, first_window = batch
    offsets, doc_ids, subset_code, d = docs
    vocab, reset, threshold, copy_lengths, span_order, listing = rules
    use_table, starts, slots, span_counts = tables
    window_id, doc_id, ids, train_count, prev_pos, is_repeat, is_ar_hit, subset = columns[:8]
    match_len, span_train_count = columns[8:]
    head_of, chain, ends, orders = scratch
    cap = span_order if listing else L  # the longest copy worth finding
    # window-local table of the bigrams seen so far: load at most 1/4, so most probes end on the
    # home slot; `touched` lists the used slots, cleared again after each window
    span = min(L, n)
    bits = 2
    while (1 << bits) < 4 * span:
        bits += 1
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    lkey = np.zeros(1 << bits, np.uint64)  # bigram key + 1; 0 = empty
    # its most recent target (an index in the window) in the low 32 bits, and above them the
    # mask of the tokens that came before its targets (by their low 5 bits): the mask costs no
    # load or store of its own
    lidx = np.zeros(1 << bits, np.uint64)
    touched = np.empty(span, np.int64)
    drow = np.empty(span, np.int64)
    first = first_target(first_window, L)
    d, next_doc = _document(offsets, d, first)
    # `tokens` index of the token before the document's first (a copy may start there with the
    # reset: an earlier occurrence must be a target of the document, the bigram's first token
    # may be the previous document's EOS)
    doc_origin = offsets[d] - first
    used = 0
    if use_table:
        for k in range(min(PREFETCH, n)):
            prefetch_slot(starts, slots, tokens[k], tokens[k + 1])
    for k0 in range(0, n, L):
        k1 = min(k0 + L, n)
        w = first_window + k0 // L
        n_touched = 0
        run_m = 0  # copy length of the previous target of the window, and where its copy ends
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
            if first + k >= next_doc:
                d, next_doc = _document(offsets, d, first + k)
                doc_origin = offsets[d] - first
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
            found = v == key
            entry = lidx[h] if found else np.uint64(0)
            earlier = np.int64(entry & _LOW32) if found else -1
            pp = 0
            # the most recent earlier target: in the same document unless one started since
            if found and (not reset or drow[earlier] == d):
                pp = earlier + 1
            if copy_lengths:
                bit = np.uint64(1) << np.uint64(32 + (tokens[k - 1] & 31)) if j > 0 else _ZERO
                seen = (entry & bit) != 0
                entry |= bit
                chain[j] = earlier
                if pp == 0:
                    run_m = 0
                elif run_m == 0:
                    run_m, run_e = 1, earlier  # after a non-repeat, a bigram is the longest
                elif tokens[k0 + run_e + 2] == tokens[k + 1]:
                    run_m = min(run_m + 1, cap)  # the previous target's copy goes on: the longest
                    run_e += 1
                elif not seen:
                    run_m, run_e = 1, earlier  # no earlier occurrence follows k's token before
                else:
                    origin = max(k0, doc_origin) if reset else k0
                    top = min(run_m + 1, cap)
                    run_m, run_e = _longest_copy(tokens, k0, k, earlier, top, origin, chain)
            if not found:
                lkey[h] = key
                touched[n_touched] = h
                n_touched += 1
            lidx[h] = (entry & ~_LOW32) | np.uint64(j)
            if listing:
                if run_m >= 2:
                    ends[used] = k + 1
                    orders[used] = run_m + 1
                    used += 1
                continue
            if found:
                c = train_count[k0 + earlier]
                if not use_table:
                    head_of[k] = head_of[k0 + earlier]
            elif use_table:
                c = region_lookup(starts, slots, p, q)
            else:
                c = 0
                head_of[k] = k
            if copy_lengths:
                match_len[k] = run_m
                if run_m >= 2 and span_order >= 2:
                    span_train_count[k] = span_counts[used] if used < span_counts.size else -1
                    used += 1
                else:
                    span_train_count[k] = c if run_m > 0 else 0
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
    if n > 0 and not listing:
        ids[n] = tokens[n]
    return used


def _document(offsets, d, i):
    """(row, where the next document starts) of the document holding stream index i, looked
    for from row d on."""
    n_docs = offsets.size
    while True:
        start_of_next = offsets[d + 1] if d + 1 < n_docs else np.int64(1) << 62
        if i < start_of_next:
            return d, start_of_next
        d += 1


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
    global region_lookup, prefetch_slot, prefetch, first_target
    if regions.compiled() is None:
        return {}
    # the region table's compiled helpers, which the tag kernel calls
    region_lookup, prefetch_slot, prefetch = (
        regions.region_lookup,
        regions.prefetch_slot,
        regions.prefetch,
    )
    first_target = jit(first_target)
    global _document, _longest_copy
    _document, _longest_copy = jit(_document), jit(_longest_copy)
    return {
        "tag_batch": jit(tag_batch_kernel),
        "slice_counts": jit(slice_counts_kernel),
    }


compiled = lazily_compiled(_jit_all)
