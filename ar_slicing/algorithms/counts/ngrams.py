"""Restricted n-gram counts: the training counts of exactly the n-grams a tag run needs.

A repeat's `span_train_count` is the training count of the `(min(match_len, K) + 1)`-gram ending
at it (docs/copy-length.md). Order 2 is the bigram count the tags already hold; the orders 3..K+1
are counted here, for those n-grams only: for every repeat with `match_len = m >= 2`, the n-grams
of orders 3..min(m, K)+1 ending at it. That set is suffix-closed (with an n-gram it holds every
shorter one ending at the same token, down to order 3), so a training position is looked up
order by order and the walk stops at the first n-gram it does not hold; a bit array of the
trigrams' hashes, small enough to stay in cache, turns away nearly every position whose trigram
is not held before the table is probed. Memory is bounded by the evaluated text (a few dozen
bytes per distinct n-gram), never by the training set, which is streamed in groups of
consecutive tokens.

`NgramTable` holds the n-grams: `grams` (one row of K+1 token ids per n-gram, right-aligned,
-1 before the first token), `orders`, and an open-addressing hash table (linear probing, load at
most 1/2) whose slots pack 32 bits of an n-gram's 64-bit hash (the home slot comes from its
other end) with its row. A hash only finds a candidate row; the row's tokens are compared before
anything is counted or returned, so a collision can never count a wrong n-gram.
Without numba (or with ARSLICE_NO_NUMBA=1) the same results come from numpy: each n-gram's
tokens as one fixed-width byte string, sorted and searched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ar_slicing.algorithms.counts import regions
from ar_slicing.algorithms.counts.regions import PREFETCH, prefetch
from ar_slicing.algorithms.jit import lazily_compiled, read_only

_FIB = 0x9E3779B97F4A7C15
_LOW = np.uint64(0xFFFFFFFF)


def gram_hash(h, token):
    """The hash of an n-gram extended one token to the left (start with h = 0 and the last)."""
    return (h ^ np.uint64(np.int64(token) + 1)) * np.uint64(_FIB)


def _slot_tag(h):
    """What a slot keeps of hash h: its low 32 bits, above the row (+ 1; an empty slot is 0).
    The home slot comes from the high bits."""
    return h << np.uint64(32)


def _find(slots, grams, orders, K, bits, h, tokens, t, n):
    """Row of the n-gram of order n ending at tokens[t] (hash h), or -1."""
    mask = (np.int64(1) << bits) - 1
    s = np.int64(h >> np.uint64(64 - bits))
    tag = _slot_tag(h)
    while True:
        v = slots[s]
        if v == 0:
            return -1
        r = np.int64(v & _LOW) - 1
        # a row of order n has -1 just before its n tokens (unless it fills the row)
        if (v & ~_LOW) == tag and (n == K + 1 or grams[r, K - n] < 0):
            same = True
            for q in range(n):
                if grams[r, K - q] != tokens[t - q]:
                    same = False
                    break
            if same:
                return r
        s = (s + 1) & mask


def _top_hash(tokens, t, n):
    """The hash of the n-gram of order n >= 3 ending at tokens[t]."""
    h = gram_hash(np.uint64(0), tokens[t])
    for q in range(1, n):
        h = gram_hash(h, tokens[t - q])
    return h


def insert_kernel(slots, grams, orders, K, bits, tokens, ends, lengths, lowest, n_rows, rows, k):
    """Add the n-grams of orders lowest..lengths[k] ending at tokens[ends[k]] that are not in the
    table yet, and set rows[k] to the row of the one of order lengths[k], from end k on.
    Returns (rows now, ends done): it stops early at an end whose n-grams might not fit (the
    table holds at most half as many rows as slots). The table is suffix-closed, so a top
    n-gram already held needs nothing more. The home slots of every order of the end PREFETCH
    ahead are asked for (most ends bring new n-grams, each probed before it is added)."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    top = np.empty(ends.size, np.uint64)
    for a in range(k, min(k + PREFETCH, ends.size)):
        top[a] = _top_hash(tokens, ends[a], lengths[a])
    while k < ends.size:
        a = k + PREFETCH
        if a < ends.size:
            h = gram_hash(gram_hash(np.uint64(0), tokens[ends[a]]), tokens[ends[a] - 1])
            for n in range(3, lengths[a] + 1):
                h = gram_hash(h, tokens[ends[a] - n + 1])
                prefetch(slots, np.int64(h >> shift))
            top[a] = h
        t = ends[k]
        rows[k] = _find(slots, grams, orders, K, bits, top[k], tokens, t, lengths[k])
        if rows[k] < 0:
            room = n_rows + lengths[k] - max(lowest, 3) + 1  # the rows it may add
            if room > orders.size or 2 * room > slots.shape[0]:
                break
            h = gram_hash(gram_hash(np.uint64(0), tokens[t]), tokens[t - 1])
            for n in range(3, lengths[k] + 1):
                h = gram_hash(h, tokens[t - n + 1])
                if n < lowest:
                    continue
                r = _find(slots, grams, orders, K, bits, h, tokens, t, n)
                if r < 0:
                    s = np.int64(h >> shift)
                    while slots[s] != 0:
                        s = (s + 1) & mask
                    slots[s] = _slot_tag(h) | np.uint64(n_rows + 1)
                    orders[n_rows] = n
                    for q in range(K + 1):
                        grams[n_rows, K - q] = tokens[t - q] if q < n else -1
                    r = n_rows
                    n_rows += 1
                rows[k] = r
        k += 1
    return n_rows, k


def rehash_kernel(slots, grams, orders, K, bits, n_rows):
    """Put rows 0..n_rows-1 in the (empty) slots of a table that grew, the slot of the row
    PREFETCH ahead asked for early."""
    mask = (np.int64(1) << bits) - 1
    shift = np.uint64(64 - bits)
    ahead = np.empty(PREFETCH, np.uint64)  # the hash of row r, at r % PREFETCH
    for r in range(-PREFETCH, n_rows):
        h = ahead[r % PREFETCH]
        a = r + PREFETCH
        if a < n_rows:
            g = gram_hash(np.uint64(0), grams[a, K])
            for q in range(1, orders[a]):
                g = gram_hash(g, grams[a, K - q])
            prefetch(slots, np.int64(g >> shift))
            ahead[a % PREFETCH] = g
        if r < 0:
            continue
        s = np.int64(h >> shift)
        while slots[s] != 0:
            s = (s + 1) & mask
        slots[s] = _slot_tag(h) | np.uint64(r + 1)


def find_kernel(slots, grams, orders, K, bits, tokens, ends, lengths, rows):
    """rows[k] = the row of the n-gram of order lengths[k] ending at tokens[ends[k]], -1 if the
    table lacks it; home slots are asked for PREFETCH queries ahead."""
    shift = np.uint64(64 - bits)
    top = np.empty(ends.size, np.uint64)
    for k in range(ends.size):
        top[k] = _top_hash(tokens, ends[k], lengths[k])
    for k in range(ends.size):
        if k + PREFETCH < ends.size:
            prefetch(slots, np.int64(top[k + PREFETCH] >> shift))
        rows[k] = _find(slots, grams, orders, K, bits, top[k], tokens, ends[k], lengths[k])


def trigram_filter_kernel(grams, orders, n_rows, K, trigrams, filter_bits):
    """Set the bit of every trigram of the table in `trigrams`, 2**filter_bits bits: a trigram
    of hash h has bit h >> (64 - filter_bits)."""
    shift = np.uint64(64 - filter_bits)
    for r in range(n_rows):
        if orders[r] == 3:
            h = gram_hash(gram_hash(np.uint64(0), grams[r, K]), grams[r, K - 1])
            f = gram_hash(h, grams[r, K - 2]) >> shift
            trigrams[np.int64(f >> np.uint64(6))] |= np.uint64(1) << (f & np.uint64(63))


# Positions ahead of the one being counted, per pipeline stage of `count_kernel`.
STAGE = 8


def count_kernel(
    slots, grams, orders, K, bits, tokens, first, offset, row, counts, trigrams, filter_bits
):
    """counts[r] += 1 for every n-gram of the table ending at tokens[first:] (tokens[0] is stream
    index `offset`); with `row`, an n-gram counts only inside one row of `row` tokens.

    Most positions end no n-gram of the table, and a bit array of the hashes of its trigrams
    (`trigrams`, small enough to stay in cache) tells nearly all of them apart with one test.
    The positions ahead are readied in three stages, so the cache misses of successive
    positions overlap instead of following one another: the trigram hash of the one 3 STAGE
    ahead and its word of `trigrams`; the home slot of the one 2 STAGE ahead if its bit is set;
    the row and count its slot names for the one STAGE ahead, and the home slot of its 4-gram.
    """
    shift = np.uint64(64 - bits)
    fshift = np.uint64(64 - filter_bits)
    flat_grams = grams.reshape(-1)
    ring = np.zeros(4 * STAGE, np.uint64)  # the trigram hash of position t, at t % (4 STAGE)
    maybe = np.zeros(4 * STAGE, np.bool_)  # whether its bit is set
    last = 4 * STAGE - 1
    end = tokens.size
    start = max(first, 2)
    # tokens since the start of the current row, minus one (the longest n-gram that fits is
    # one more): a counter instead of a division per position
    in_row = (offset + start) % row if row > 0 else np.int64(1) << 62
    for t in range(start - 3 * STAGE, end):
        a = t + 3 * STAGE
        if start <= a < end:
            h = _top_hash(tokens, a, 3)
            ring[a & last] = h
            prefetch(trigrams, np.int64((h >> fshift) >> np.uint64(6)))
        b = t + 2 * STAGE
        if start <= b < end:
            h = ring[b & last]
            f = h >> fshift
            on = (trigrams[np.int64(f >> np.uint64(6))] >> (f & np.uint64(63))) & np.uint64(1)
            maybe[b & last] = on != 0
            if on != 0:
                prefetch(slots, np.int64(h >> shift))
        c = t + STAGE
        if start <= c < end and maybe[c & last]:
            h = ring[c & last]
            v = slots[np.int64(h >> shift)]
            if (v & ~_LOW) == _slot_tag(h):
                r = np.int64(v & _LOW) - 1
                prefetch(flat_grams, r * (K + 1))
                prefetch(counts, r)
                if K >= 3 and c >= 3:
                    prefetch(slots, np.int64(gram_hash(h, tokens[c - 3]) >> shift))
        if t < start:
            continue
        if maybe[t & last]:
            h = ring[t & last]
            for n in range(3, K + 2):
                if t - n + 1 < 0 or in_row < n - 1:
                    break
                if n > 3:
                    h = gram_hash(h, tokens[t - n + 1])
                r = _find(slots, grams, orders, K, bits, h, tokens, t, n)
                if r < 0:
                    break  # nor any longer one: the set is suffix-closed
                counts[r] += 1
        in_row += 1
        if in_row == row:
            in_row = 0


def _jit_all(jit) -> dict:
    global gram_hash, _find, prefetch, _top_hash, _slot_tag
    if regions.compiled() is None:
        return {}
    prefetch = regions.prefetch  # the region table's compiled prefetch
    gram_hash, _find, _top_hash, _slot_tag = map(jit, (gram_hash, _find, _top_hash, _slot_tag))
    return {
        "insert": jit(insert_kernel),
        "rehash": jit(rehash_kernel),
        "find": jit(find_kernel),
        "trigram_filter": jit(trigram_filter_kernel),
        "count": jit(count_kernel),
    }


compiled = lazily_compiled(_jit_all)


def warm() -> None:
    """Compile (or load from numba's cache) the kernels a tag run calls, in this process: the
    public methods on a tiny table, with the types a run gives them (`rows_of`, which a run
    does not call, is left to be compiled where it is used)."""
    if compiled() is None:
        return
    tokens = read_only(np.arange(8, dtype=np.uint16))
    table = NgramTable.empty(4, 4)
    ends, lengths = np.array([4, 5]), np.array([5, 3])
    table.add(tokens, ends, lengths)
    table.add_rows(table.grams[: table.n_rows])
    table._reserve(2 * len(table.orders))
    table.count_stream(tokens, 0, 0, None)
    table.count_stream(tokens, 0, 0, None, into=np.zeros(table.n_rows, np.uint32))  # (a task's)


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
    slots: np.ndarray  # (2**bits,) uint64: 32 bits of the hash, row + 1 (0 = empty)
    bits: int
    n_rows: int = 0
    counts: np.ndarray | None = None  # (n_rows,) int64
    # a bit per trigram hash, for counting (`count_kernel`); made for the first n_rows rows
    trigrams: tuple[np.ndarray, int, int] | None = None  # bits, log2 of their number, n_rows

    @classmethod
    def empty(cls, span_order: int, capacity: int) -> NgramTable:
        bits = 4
        while (1 << bits) < 2 * max(capacity, 1):
            bits += 1
        return cls(
            span_order=span_order,
            # rows are written whole as they are added: memory is touched only as it fills
            grams=np.empty((max(capacity, 1), span_order + 1), np.int32),
            orders=np.empty(max(capacity, 1), np.int8),
            slots=np.zeros(1 << bits, np.uint64),
            bits=bits,
        )

    def add(self, tokens: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Add the n-grams of orders 3..lengths[k] ending at tokens[ends[k]] (lengths <= K+1);
        returns the row of the one of order lengths[k] (-1 where that is below 3)."""
        ends, lengths = np.asarray(ends, np.int64), np.asarray(lengths, np.int64)
        rows = np.full(ends.size, -1, np.int64)
        keep = np.flatnonzero(lengths >= 3)
        ends, lengths = ends[keep], lengths[keep]
        kernels = compiled()
        if kernels is None:
            K = self.span_order
            grams = [_rows_ending_at(tokens, ends[lengths >= n], n, K) for n in range(3, K + 2)]
            self.add_rows(np.concatenate([np.zeros((0, K + 1), np.int32), *grams]))
            rows[keep] = self.rows_of(tokens, ends, lengths)
        else:
            rows[keep] = self._insert(kernels, tokens, ends, lengths, 3)
        return rows

    def add_rows(self, rows: np.ndarray) -> np.ndarray:
        """Add n-grams given as rows like `grams` (those already held are skipped); returns
        where each one is in this table. With each n-gram, its suffixes down to order 3 must be
        among the rows or in the table (as they are among the rows of another table)."""
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
            return self.rows_of(rows.ravel(), np.arange(K, rows.size, K + 1), orders)
        where = np.empty(len(rows), np.int64)
        # the ids as a token store holds them (the kernels are compiled for those dtypes)
        dtype = np.uint16 if rows.max(initial=0) < 1 << 16 else np.uint32
        for n in range(3, K + 2):
            # the rows of order n as one token sequence, each row's n tokens in turn
            at = np.flatnonzero(orders == n)
            seq = rows[at, K + 1 - n :].astype(dtype).ravel()
            ends = np.arange(n - 1, seq.size, n, dtype=np.int64)
            where[at] = self._insert(kernels, seq, ends, np.full(ends.size, n, np.int64), n)
        return where

    def _insert(self, kernels, tokens, ends, lengths, lowest: int) -> np.ndarray:
        """The compiled insert of the n-grams of orders lowest..lengths[k] ending at each end,
        the table doubled whenever it fills up; the row of each top one."""
        rows = np.empty(len(ends), np.int64)
        tokens = read_only(np.ascontiguousarray(tokens))
        done = 0
        while True:
            self.n_rows, done = kernels["insert"](
                *self._table, tokens, ends, lengths, lowest, self.n_rows, rows, done
            )
            if done == len(ends):
                return rows
            self._reserve(2 * self.n_rows + self.span_order + 1)

    def shrink(self) -> None:
        """Give back the rows of room the table grew beyond its n-grams (once the last is added:
        the table doubles as it fills, so up to half its rows can be room)."""
        keep = max(self.n_rows, 1)
        self.grams, self.orders = self.grams[:keep].copy(), self.orders[:keep].copy()

    @property
    def _table(self) -> tuple:
        """The arguments every kernel takes first: the table itself."""
        return self.slots, self.grams, self.orders, self.span_order, self.bits

    def _reserve(self, need: int) -> None:
        """Room for `need` rows at a table load of at most 1/2: a bigger table gets the rows
        as they are, and its slots are filled again from them."""
        if need <= len(self.orders) and 2 * need <= len(self.slots):
            return
        bigger = NgramTable.empty(self.span_order, max(need, 2 * len(self.orders)))
        bigger.grams[: self.n_rows] = self.grams[: self.n_rows]
        bigger.orders[: self.n_rows] = self.orders[: self.n_rows]
        kernels = compiled()
        if kernels is not None:  # (the numpy path looks rows up by their tokens, not by slot)
            kernels["rehash"](*bigger._table, self.n_rows)
        self.grams, self.orders, self.slots, self.bits = (
            bigger.grams,
            bigger.orders,
            bigger.slots,
            bigger.bits,
        )

    # ---- counting and looking up ------------------------------------------------------------

    def count_stream(
        self, tokens: np.ndarray, first: int, offset: int, row: int | None, into=None
    ) -> np.ndarray:
        """Counts (int64, one per row; `into` may be uint32) of the table's n-grams ending at
        tokens[first:], where
        tokens[0] is stream index `offset` of the training stream (`row`: the counting unit),
        added to `into` when given (one array for every shard of a task: no array of n_rows
        to allocate, zero and add per shard) and returned."""
        counts = np.zeros(self.n_rows, np.int64) if into is None else into
        kernels = compiled()
        if kernels is not None:
            trigrams, filter_bits = self.trigram_filter()
            kernels["count"](
                *self._table,
                read_only(np.ascontiguousarray(tokens)),
                int(first),
                int(offset),
                int(row or 0),
                counts,
                trigrams,
                filter_bits,
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
            hits = np.bincount(order_of_key[at[hit]], minlength=self.n_rows)
            counts += hits.astype(counts.dtype, copy=False)
        return counts

    def trigram_filter(self) -> tuple[np.ndarray, int] | None:
        """The bits of the table's trigram hashes (about 16 per trigram, so that about 1 in 16
        positions without one of them passes) and log2 of their number, made once for the
        rows the table has (the tag stage makes it before its counting workers start); None
        for the numpy path, which has no use for it."""
        if compiled() is None:
            return None
        if self.trigrams is None or self.trigrams[2] != self.n_rows:
            n_trigrams = int((self.orders[: self.n_rows] == 3).sum())
            filter_bits = max(12, (16 * n_trigrams).bit_length())
            bits = np.zeros(1 << (filter_bits - 6), np.uint64)
            compiled()["trigram_filter"](
                self.grams, self.orders, self.n_rows, self.span_order, bits, filter_bits
            )
            self.trigrams = (read_only(bits), filter_bits, self.n_rows)
        return self.trigrams[:2]

    def rows_of(self, tokens: np.ndarray, ends: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The row of the n-gram of order lengths[k] (3..K+1) ending at tokens[ends[k]]; -1 for
        one the table does not hold."""
        ends, lengths = np.asarray(ends, np.int64), np.asarray(lengths, np.int64)
        rows = np.full(ends.size, -1, np.int64)
        if not ends.size or not self.n_rows:
            return rows
        kernels = compiled()
        if kernels is not None:
            tokens = read_only(np.ascontiguousarray(tokens))
            kernels["find"](*self._table, tokens, ends, lengths, rows)
            return rows
        keys = _row_keys(self.grams[: self.n_rows])
        order_of_key = np.argsort(keys)
        sorted_keys = keys[order_of_key]
        for n in np.unique(lengths):
            sel = np.flatnonzero(lengths == n)
            probe = _row_keys(_rows_ending_at(tokens, ends[sel], int(n), self.span_order))
            at = np.minimum(np.searchsorted(sorted_keys, probe), sorted_keys.size - 1)
            hit = sorted_keys[at] == probe
            rows[sel[hit]] = order_of_key[at[hit]]
        return rows

    def span_counts(self, tokens, match_len, train_count) -> np.ndarray:
        """Span count of every target of a batch (target k's n-gram ends at tokens[k + 1]): 0 for
        a non-repeat, `train_count` for a copy of one bigram, else the table's count of the
        (min(match_len, K) + 1)-gram; -1 for one the table does not hold."""
        lengths = span_lengths(match_len, self.span_order)
        out = np.multiply(train_count, match_len > 0).astype(np.int64)
        longer = np.flatnonzero(lengths >= 3)
        rows = self.rows_of(tokens, longer + 1, lengths[longer])
        counts = self.counts if self.counts is not None else np.zeros(self.n_rows, np.int64)
        found = rows >= 0
        out[longer] = -1
        out[longer[found]] = counts[rows[found]]
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


# The most n-gram ends one counting task covers: its counts are uint32 (4 bytes per n-gram and
# worker, and as many to send them back), exact below 2**32.
TASK_POSITIONS = (1 << 32) - 1


def span_count_tasks(stores, row, span_order: int, groups: int) -> list[SpanCountTask]:
    """About `groups` tasks of consecutive n-gram ends over the concatenated training stream."""
    total = sum(s.n_tokens for s in stores)
    # (under 2**32 positions each, so that a task's counts fit the uint32 it returns them in)
    size = min(max(1 << 20, -(-total // max(groups, 1))), TASK_POSITIONS)
    paths = tuple(str(s.path.resolve()) for s in stores)
    return [
        SpanCountTask(paths, a, min(a + size, total), row, span_order)
        for a in range(0, total, size)
    ]


def read_stream(stores, start: int, stop: int) -> np.ndarray:
    """Tokens start..stop-1 of the stores' concatenated stream, read from their files (a pass
    over the whole training set keeps only the shard in hand in memory)."""
    parts, offset = [np.zeros(0, np.uint16)], 0
    for store in stores:
        lo, hi = max(start, offset), min(stop, offset + store.n_tokens)
        if lo < hi:
            parts.append(store.read(lo - offset, hi - offset))
        offset += store.n_tokens
    return np.concatenate(parts)


def count_span_task(task: SpanCountTask, table: NgramTable) -> np.ndarray:
    """The table's counts (uint32) over one task's n-gram ends, shard by shard (each shard read with the
    K tokens before it, so an n-gram across a shard or store boundary is counted once)."""
    from ar_slicing.data.store import TokenStore

    stores = [TokenStore.open(p) for p in task.stores]
    if task.stop - task.start > TASK_POSITIONS:
        raise ValueError(f"a span count task covers at most {TASK_POSITIONS} positions")
    counts = np.zeros(table.n_rows, np.uint32)
    K = task.span_order
    for a in range(task.start, task.stop, task.shard_tokens):
        b = min(a + task.shard_tokens, task.stop)
        lo = max(a - K, 0)
        table.count_stream(read_stream(stores, lo, b), a - lo, lo, task.row, into=counts)
    return counts
