"""Restricted n-gram counts: the training counts of exactly the n-grams a tag run needs.

A repeat's `span_train_count` is the training count of the `(min(match_len, K) + 1)`-gram ending
at it (docs/copy-length.md). Order 2 is the bigram count the tags already hold; the orders 3..K+1
are counted here, for those n-grams only: for every repeat with `match_len = m >= 2`, the n-grams
of orders 3..min(m, K)+1 ending at it. That set is suffix-closed (with an n-gram it holds every
shorter one ending at the same token, down to order 3), so a training position is looked up
order by order and the walk stops at the first n-gram it does not hold: most positions cost one
probe. Memory is bounded by the evaluated text (a few dozen bytes per distinct n-gram), never by
the training set, which is streamed in groups of consecutive tokens.

`NgramTable` holds the n-grams: `grams` (one row of K+1 token ids per n-gram, right-aligned,
-1 before the first token), `orders`, and an open-addressing hash table (linear probing, load at
most 1/2) of (64-bit hash, n-gram row). A hash only finds a candidate row; the row's tokens are
compared before anything is counted or returned, so a collision can never count a wrong n-gram.
Without numba (or with ARSLICE_NO_NUMBA=1) the same results come from numpy: each n-gram's
tokens as one fixed-width byte string, sorted and searched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ar_slicing.counts import regions
from ar_slicing.counts.regions import PREFETCH, prefetch
from ar_slicing.jit import lazily_compiled

_FIB = 0x9E3779B97F4A7C15


def gram_hash(h, token):
    """The hash of an n-gram extended one token to the left (start with h = 0 and the last)."""
    return (h ^ np.uint64(np.int64(token) + 1)) * np.uint64(_FIB)


def _find(slots, grams, orders, K, bits, h, tokens, t, n):
    """Row of the n-gram of order n ending at tokens[t] (hash h), or -1."""
    mask = (np.int64(1) << bits) - 1
    s = np.int64(h >> np.uint64(64 - bits))
    while True:
        r = slots[s, 1]
        if r < 0:
            return -1
        # a row of order n has -1 just before its n tokens (unless it fills the row)
        if np.uint64(slots[s, 0]) == h and (n == K + 1 or grams[r, K - n] < 0):
            same = True
            for q in range(n):
                if grams[r, K - q] != tokens[t - q]:
                    same = False
                    break
            if same:
                return r
        s = (s + 1) & mask


def insert_kernel(slots, grams, orders, K, bits, tokens, ends, lengths, lowest, n_rows):
    """Add the n-grams of orders lowest..lengths[k] ending at tokens[ends[k]] that are not in the
    table yet. Returns the new number of rows."""
    mask = (np.int64(1) << bits) - 1
    for k in range(ends.size):
        t = ends[k]
        h = gram_hash(gram_hash(np.uint64(0), tokens[t]), tokens[t - 1])
        for n in range(3, lengths[k] + 1):
            h = gram_hash(h, tokens[t - n + 1])
            if n < lowest or _find(slots, grams, orders, K, bits, h, tokens, t, n) >= 0:
                continue
            s = np.int64(h >> np.uint64(64 - bits))
            while slots[s, 1] >= 0:
                s = (s + 1) & mask
            slots[s, 0] = np.int64(h)
            slots[s, 1] = n_rows
            orders[n_rows] = n
            for q in range(n):
                grams[n_rows, K - q] = tokens[t - q]
            n_rows += 1
    return n_rows


def count_kernel(slots, grams, orders, K, bits, tokens, first, offset, row, counts):
    """counts[r] += 1 for every n-gram of the table ending at tokens[first:] (tokens[0] is stream
    index `offset`); with `row`, an n-gram counts only inside one row of `row` tokens."""
    for t in range(first, tokens.size):
        if t < 2:
            continue
        i = offset + t
        h = gram_hash(gram_hash(np.uint64(0), tokens[t]), tokens[t - 1])
        for n in range(3, K + 2):
            if t - n + 1 < 0 or (row > 0 and (i - n + 1) // row != i // row):
                break
            h = gram_hash(h, tokens[t - n + 1])
            r = _find(slots, grams, orders, K, bits, h, tokens, t, n)
            if r < 0:
                break  # nor any longer one: the set is suffix-closed
            counts[r] += 1


def span_counts_kernel(
    slots,
    grams,
    orders,
    K,
    bits,
    counts,
    tokens,
    match_len,
    train_count,
    span_order,
    out,
    at,
    hashes,
):
    """out[k] = span count of target k (its n-gram ends at tokens[k + 1]): 0 for a non-repeat,
    train_count[k] for a copy of one bigram (or span order 1), else the table's count of the
    (min(match_len, K) + 1)-gram (-1 if it lacks it). The targets needing the table are listed
    and hashed first, so that the home slot of the one 2 PREFETCH ahead and then the row and count
    its slot names (PREFETCH ahead) are asked for early: the cache misses overlap."""
    n_q = 0
    for k in range(match_len.size):
        m = min(match_len[k], span_order)
        if m == 0:
            out[k] = 0
        elif m == 1:
            out[k] = train_count[k]
        else:
            t = k + 1
            h = gram_hash(np.uint64(0), tokens[t])
            for q in range(1, m + 1):
                h = gram_hash(h, tokens[t - q])
            at[n_q] = k
            hashes[n_q] = h
            n_q += 1
    shift = np.uint64(64 - bits)
    flat_slots = slots.reshape(-1)
    flat_grams = grams.reshape(-1)
    for j in range(n_q):
        if j + 2 * PREFETCH < n_q:
            prefetch(flat_slots, 2 * np.int64(hashes[j + 2 * PREFETCH] >> shift))
        if j + PREFETCH < n_q:
            r = slots[np.int64(hashes[j + PREFETCH] >> shift), 1]
            if r >= 0:
                prefetch(flat_grams, r * (K + 1))
                prefetch(counts, r)
        k = at[j]
        n = min(match_len[k], span_order) + 1
        r = _find(slots, grams, orders, K, bits, hashes[j], tokens, k + 1, n)
        out[k] = counts[r] if r >= 0 else -1


def _jit_all(jit) -> dict:
    global gram_hash, _find, prefetch
    if regions.compiled() is None:
        return {}
    prefetch = regions.prefetch  # the region table's compiled prefetch
    gram_hash = jit(gram_hash)
    _find = jit(_find)
    return {
        "insert": jit(insert_kernel),
        "count": jit(count_kernel),
        "span_counts": jit(span_counts_kernel),
    }


compiled = lazily_compiled(_jit_all)


def span_lengths(match_len: np.ndarray, span_order: int) -> np.ndarray:
    """Order of the span n-gram of each target: min(match_len, K) + 1 (1 for a non-repeat)."""
    return np.minimum(match_len, span_order).astype(np.int32) + 1


@dataclass
class NgramTable:
    """Exactly the n-grams of orders 3..K+1 added to it, with their training counts (`counts`,
    filled by `count_stream`). Build one with `NgramTable.empty(K, capacity)`, then `add`."""

    span_order: int
    grams: np.ndarray  # (capacity, K + 1) int32, right-aligned, -1 before the first token
    orders: np.ndarray  # (capacity,) int8
    slots: np.ndarray  # (2**bits, 2) int64: hash, row (-1 = empty)
    bits: int
    n_rows: int = 0
    counts: np.ndarray | None = None  # (n_rows,) int64
    scratch: tuple | None = None  # `span_counts`' query space

    @classmethod
    def empty(cls, span_order: int, capacity: int) -> NgramTable:
        bits = 4
        while (1 << bits) < 2 * max(capacity, 1):
            bits += 1
        slots = np.zeros((1 << bits, 2), np.int64)
        slots[:, 1] = -1
        return cls(
            span_order=span_order,
            grams=np.full((max(capacity, 1), span_order + 1), -1, np.int32),
            orders=np.zeros(max(capacity, 1), np.int8),
            slots=slots,
            bits=bits,
        )

    def add(self, tokens: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> None:
        """Add the n-grams of orders 3..lengths[k] ending at tokens[ends[k]] (lengths <= K+1)."""
        keep = lengths >= 3
        ends, lengths = ends[keep].astype(np.int64), lengths[keep].astype(np.int64)
        kernels = compiled()
        if kernels is None:
            K = self.span_order
            rows = [_rows_ending_at(tokens, ends[lengths >= n], n, K) for n in range(3, K + 2)]
            self.add_rows(np.concatenate([np.zeros((0, K + 1), np.int32), *rows]))
            return
        self._reserve(self.n_rows + int((lengths - 2).sum()))
        self._insert(kernels, tokens, ends, lengths, 3)

    def add_rows(self, rows: np.ndarray) -> None:
        """Add n-grams given as rows like `grams` (those already held are skipped)."""
        K = self.span_order
        rows = np.asarray(rows, np.int32).reshape(-1, K + 1)
        orders = (rows >= 0).sum(axis=1)
        self._reserve(self.n_rows + len(rows))
        kernels = compiled()
        if kernels is None:
            keys = _row_keys(np.concatenate([self.grams[: self.n_rows], rows]))
            _, first = np.unique(keys, return_index=True)
            fresh = np.sort(first[first >= self.n_rows]) - self.n_rows
            a, b = self.n_rows, self.n_rows + fresh.size
            self.grams[a:b], self.orders[a:b] = rows[fresh], orders[fresh]
            self.n_rows = b
            return
        for n in range(3, K + 2):
            # the rows of order n as one token sequence, each row's n tokens in turn
            seq = np.ascontiguousarray(rows[orders == n][:, K + 1 - n :]).ravel()
            ends = np.arange(n - 1, seq.size, n, dtype=np.int64)
            self._insert(kernels, seq, ends, np.full(ends.size, n, np.int64), n)

    def _insert(self, kernels, tokens, ends, lengths, lowest: int) -> None:
        """The compiled insert of the n-grams of orders lowest..lengths[k] ending at each end."""
        self.n_rows = int(
            kernels["insert"](
                *self._table,
                np.ascontiguousarray(tokens),
                ends,
                lengths,
                lowest,
                self.n_rows,
            )
        )

    @property
    def _table(self) -> tuple:
        """The arguments every kernel takes first: the table itself."""
        return self.slots, self.grams, self.orders, self.span_order, self.bits

    def _reserve(self, need: int) -> None:
        """Room for `need` rows at a table load of at most 1/2."""
        if need <= len(self.orders) and 2 * need <= len(self.slots):
            return
        bigger = NgramTable.empty(self.span_order, max(need, 2 * len(self.orders)))
        bigger.add_rows(self.grams[: self.n_rows])
        self.grams, self.orders, self.slots, self.bits = (
            bigger.grams,
            bigger.orders,
            bigger.slots,
            bigger.bits,
        )

    # ---- counting and looking up ------------------------------------------------------------

    def count_stream(self, tokens: np.ndarray, first: int, offset: int, row: int | None):
        """Counts (int64, one per row) of the table's n-grams ending at tokens[first:], where
        tokens[0] is stream index `offset` of the training stream (`row`: the counting unit)."""
        counts = np.zeros(self.n_rows, np.int64)
        kernels = compiled()
        if kernels is not None:
            kernels["count"](
                *self._table,
                np.ascontiguousarray(tokens),
                int(first),
                int(offset),
                int(row or 0),
                counts,
            )
            return counts
        keys = _row_keys(self.grams[: self.n_rows])
        order_of_key = np.argsort(keys)
        sorted_keys = keys[order_of_key]
        for n in range(3, self.span_order + 2):
            ends = np.arange(max(first, n - 1), len(tokens), dtype=np.int64)
            if row:
                i = offset + ends
                ends = ends[(i - n + 1) // row == i // row]
            if not ends.size or not sorted_keys.size:
                continue
            probe = _row_keys(_rows_ending_at(tokens, ends, n, self.span_order))
            at = np.minimum(np.searchsorted(sorted_keys, probe), sorted_keys.size - 1)
            hit = sorted_keys[at] == probe
            counts += np.bincount(order_of_key[at[hit]], minlength=self.n_rows)
        return counts

    def span_counts(self, tokens, match_len, train_count, out=None) -> np.ndarray:
        """Span count of every target of a batch (target k's n-gram ends at tokens[k + 1]): 0 for
        a non-repeat, `train_count` for a copy of one bigram, else the table's count of the
        (min(match_len, K) + 1)-gram; -1 for one the table does not hold."""
        n = len(match_len)
        out = np.empty(n, np.int64) if out is None else out
        counts = self.counts if self.counts is not None else np.zeros(self.n_rows, np.int64)
        kernels = compiled()
        if kernels is not None:
            kernels["span_counts"](
                *self._table,
                counts,
                np.ascontiguousarray(tokens),
                np.ascontiguousarray(match_len, np.int32),
                np.ascontiguousarray(train_count, np.int64),
                self.span_order,
                out,
                *self._scratch(n),
            )
            return out
        lengths = span_lengths(match_len, self.span_order)
        np.multiply(train_count, match_len > 0, out=out)
        longer = np.flatnonzero(lengths >= 3)
        out[longer] = self.lookup(tokens, longer + 1, lengths[longer])
        return out

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Query space for `span_counts`, kept between batches (fresh pages cost more than the
        lookups of a batch)."""
        if self.scratch is None or len(self.scratch[0]) < n:
            self.scratch = (np.empty(n, np.int64), np.empty(n, np.uint64))
        return self.scratch

    def lookup(self, tokens: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Training count of the n-gram of order lengths[k] (3..K+1) ending at tokens[ends[k]];
        -1 for one the table does not hold (numpy; the compiled path is `span_counts`)."""
        out = np.full(ends.size, -1, np.int64)
        if not ends.size or not self.n_rows:
            return out
        counts = self.counts if self.counts is not None else np.zeros(self.n_rows, np.int64)
        keys = _row_keys(self.grams[: self.n_rows])
        order_of_key = np.argsort(keys)
        sorted_keys = keys[order_of_key]
        for n in np.unique(lengths):
            sel = np.flatnonzero(lengths == n)
            probe = _row_keys(_rows_ending_at(tokens, ends[sel], int(n), self.span_order))
            at = np.minimum(np.searchsorted(sorted_keys, probe), sorted_keys.size - 1)
            hit = sorted_keys[at] == probe
            out[sel[hit]] = counts[order_of_key[at[hit]]]
        return out

    def order_summary(self) -> dict[str, dict[str, int]]:
        """Per order: distinct n-grams held and how many of them training has (count >= 1)."""
        orders = self.orders[: self.n_rows]
        seen = self.counts > 0 if self.counts is not None else np.zeros(self.n_rows, bool)
        return {
            str(n): {"ngrams": int((orders == n).sum()), "seen": int((seen & (orders == n)).sum())}
            for n in range(3, self.span_order + 2)
        }


def _rows_ending_at(tokens: np.ndarray, ends: np.ndarray, n: int, K: int) -> np.ndarray:
    """(len(ends), K+1) int32: the n tokens ending at each end, right-aligned, -1 before."""
    rows = np.full((ends.size, K + 1), -1, np.int32)
    for q in range(n):
        rows[:, K - q] = tokens[ends - q]
    return rows


def _row_keys(rows: np.ndarray) -> np.ndarray:
    """Each row's ids as one fixed-width byte string (equal strings = equal n-grams)."""
    rows = np.ascontiguousarray(rows, dtype="<i4")
    return rows.view(np.dtype((np.void, 4 * rows.shape[1]))).ravel()


# ---- the training side: the table's n-grams counted over the training stores ---------------------


@dataclass(frozen=True)
class SpanCountTask:
    """Count the n-grams ending at stream indices start..stop-1 of the training stream (the
    stores in `stores`, concatenated in order, as the bigram counts join them)."""

    stores: tuple[str, ...]
    start: int
    stop: int
    row: int | None
    span_order: int
    shard_tokens: int = 1 << 24

    @property
    def n_pairs(self) -> int:
        return self.stop - self.start


def span_count_tasks(stores, row, span_order: int, groups: int) -> list[SpanCountTask]:
    """About `groups` tasks of consecutive n-gram ends over the concatenated training stream."""
    total = sum(s.n_tokens for s in stores)
    size = max(1 << 20, -(-total // max(groups, 1)))
    paths = tuple(str(s.path.resolve()) for s in stores)
    return [
        SpanCountTask(paths, a, min(a + size, total), row, span_order)
        for a in range(0, total, size)
    ]


def read_stream(stores, start: int, stop: int) -> np.ndarray:
    """Tokens start..stop-1 of the stores' concatenated stream."""
    parts, offset = [np.zeros(0, np.uint16)], 0
    for store in stores:
        lo, hi = max(start, offset), min(stop, offset + store.n_tokens)
        if lo < hi:
            parts.append(store.slice(lo - offset, hi - offset))
        offset += store.n_tokens
    return np.concatenate(parts)


def count_span_task(task: SpanCountTask, table: NgramTable) -> np.ndarray:
    """The table's counts over one task's n-gram ends, shard by shard (each shard read with the
    K tokens before it, so an n-gram across a shard or store boundary is counted once)."""
    from ar_slicing.store import TokenStore

    stores = [TokenStore.open(p) for p in task.stores]
    counts = np.zeros(table.n_rows, np.int64)
    K = task.span_order
    for a in range(task.start, task.stop, task.shard_tokens):
        b = min(a + task.shard_tokens, task.stop)
        lo = max(a - K, 0)
        counts += table.count_stream(read_stream(stores, lo, b), a - lo, lo, task.row)
    return counts
