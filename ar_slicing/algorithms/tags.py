"""AR tags: for every target of a run of windows, its in-context repeat and its training count.

Definitions (docs/design.md, "Exact definitions"): target `i` (stream index, `pos = i - w*L` in 1..L)
has bigram `(S[i-1], S[i])`. It is a *repeat* when an earlier target `j` of the same window
(`w*L+1 <= j < i`) has the same bigram; `prev_pos` is the position of the most recent such `j`.
With `reset_at_doc_boundary`, only `j` in the same document as `i` count (the document whose span,
its trailing EOS included, holds the stream index). An *AR hit* is a repeat whose training count
is at most `threshold` (count 0, never seen, qualifies).

How it is computed, per batch of windows. With numba (`ar_slicing.algorithms.tag_kernels`): one pass over
each window with a small window-local table of the bigrams seen so far (their most recent target
and its count), so only a window's first occurrence of a bigram is looked up in the training
counts; with a `BigramCounts` of 16-bit ids that lookup probes its region table inside the same
pass (`ar_slicing.algorithms.counts.regions`), otherwise the first occurrences are looked up once per batch
and their counts spread to the repeats.

Without numba, in numpy, without a Python loop over tokens: the batch's targets
are ordered by (bigram, stream index) — two stable radix passes over 16-bit ids (GPT-2 and GPT-NeoX
vocabularies fit), or one sort of packed 64-bit keys for larger vocabularies. In that order a
target's predecessor with the same bigram is its most recent earlier occurrence in the batch; it
is the target's `prev_pos` when it lies in the same window (and document, with the reset). The
first target of each run of equal bigrams gives the batch's distinct bigrams, already sorted, so
the training counts are looked up once per distinct bigram, in order, and spread over the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ar_slicing.algorithms.jit import read_only
from ar_slicing.algorithms.windows import first_target
from ar_slicing.errors import BadInput

if TYPE_CHECKING:
    from ar_slicing.algorithms.counts.lookup import BigramCounts

# (prev, next) -> training count, int64, 0 for pairs never seen (BigramCounts.lookup).
Lookup = Callable[[np.ndarray, np.ndarray], np.ndarray]

TAG_COLUMNS = (
    "window_id",
    "pos",
    "doc_id",
    "token",
    "prev",
    "train_count",
    "prev_pos",
    "is_repeat",
    "is_ar_hit",
    "subset",
    "match_len",
    "span_train_count",
)
# the columns the compiled kernel writes after `window_id`, `doc_id` and the ids (its `Columns`)
_KERNEL_COLUMNS = TAG_COLUMNS[5:]


def tags_schema():
    """The tag table's schema (docs/design.md "Tags"): `prev_pos` and `span_train_count` are null for
    non-repeats and `subset` for documents without one; every other column is never null (REQUIRED in Parquet, which
    also spares the writer a definition level per value)."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("window_id", pa.int32(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),
            pa.field("doc_id", pa.int64(), nullable=False),
            pa.field("token", pa.int32(), nullable=False),
            pa.field("prev", pa.int32(), nullable=False),
            pa.field("train_count", pa.int64(), nullable=False),
            pa.field("prev_pos", pa.int32()),
            pa.field("is_repeat", pa.bool_(), nullable=False),
            pa.field("is_ar_hit", pa.bool_(), nullable=False),
            pa.field("subset", pa.string()),
            pa.field("match_len", pa.int32(), nullable=False),
            pa.field("span_train_count", pa.int64()),
        ]
    )


@dataclass(frozen=True)
class DocTable:
    """What tagging needs from docs.parquet: where documents start, their ids and subsets.

    `subset_code[d]` indexes `subset_names` (-1 for a document without a subset).
    """

    offsets: np.ndarray  # int64, stream index of each document's first token, nondecreasing
    doc_ids: np.ndarray  # int64
    subset_code: np.ndarray  # int32
    subset_names: tuple[str, ...]

    @classmethod
    def from_store(cls, store) -> DocTable:
        docs = store.docs
        offsets = store.doc_offsets
        if store.n_tokens > 0 and (len(offsets) == 0 or offsets[0] != 0):
            raise BadInput(
                f"token store {store.path}: docs.parquet must start a document at stream index 0 "
                f"(first offset is {offsets[0] if len(offsets) else 'missing'}); re-create the store"
            )
        if len(offsets) > 1 and np.any(np.diff(offsets) < 0):
            bad = int(np.argmax(np.diff(offsets) < 0)) + 1
            raise BadInput(
                f"token store {store.path}: docs.parquet offsets decrease at row {bad} "
                f"({offsets[bad - 1]} then {offsets[bad]}); re-create the store"
            )
        encoded = docs.column("subset").combine_chunks().dictionary_encode()
        values = encoded.dictionary.to_pylist()
        names = tuple(sorted(values))
        # dictionary index -> rank of the name, so codes do not depend on document order
        rank = np.array([names.index(v) for v in values] + [-1], dtype=np.int32)
        indices = encoded.indices.fill_null(len(values)).to_numpy()
        code = rank[indices] if len(indices) else np.zeros(0, dtype=np.int32)
        return cls(offsets=offsets, doc_ids=store.doc_ids, subset_code=code, subset_names=names)

    def rows_of_range(self, first: int, count: int) -> np.ndarray:
        """Row in this table of the document holding each stream index `first .. first+count-1`."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        lo = int(np.searchsorted(self.offsets, first, side="right")) - 1
        hi = int(np.searchsorted(self.offsets, first + count - 1, side="right")) - 1
        # Documents lo..hi cover the range; each starts where the next one's offset is.
        starts = np.clip(self.offsets[lo + 1 : hi + 1] - first, 0, count)
        lengths = np.diff(np.concatenate([[0], starts, [count]]))
        return np.repeat(np.arange(lo, hi + 1, dtype=np.int64), lengths)


def tag_windows(
    stream: np.ndarray,
    first_window: int,
    window: int,
    *,
    docs: DocTable,
    lookup: Lookup | BigramCounts,
    threshold: int,
    vocab_size: int,
    reset_at_doc_boundary: bool = False,
    span_order: int = 1,
    span_counts: np.ndarray | None = None,
    out: dict[str, np.ndarray] | None = None,
    copy_lengths: bool = True,
) -> dict[str, np.ndarray]:
    """Tag every target of consecutive windows starting at `first_window`.

    `stream` is `S[first_window*L : e]`: the windows' tokens including the last window's final
    target (`ar_slicing.algorithms.windows.stream_range`), so it holds `len(stream) - 1` targets and only
    its last window may be partial. `lookup` is a `BigramCounts` or any function
    `(prev, next) -> counts`. Returns numpy columns named as in `TAG_COLUMNS`, with `prev_pos` 0
    where there is no earlier occurrence and `subset` as codes into `docs.subset_names`
    (-1 = none). `out` (from `column_buffers`) is where the compiled path writes them: a caller
    tagging batch after batch reuses memory instead of having fresh pages mapped for each one.
    `match_len` is each target's copy length and `span_train_count` the training count of its
    `(min(match_len, span_order) + 1)`-gram (0 for a non-repeat, whose column is null): order 2
    is the bigram's `train_count`; the counts of orders 3 and up, one per long copy of the batch
    in target order (those `long_spans` lists), are `span_counts`, which must hold exactly them
    when `span_order >= 2`. `copy_lengths=False` leaves `match_len` and the span counts out of
    the compiled pass (the benchmark's baseline; the columns are then zeros).

    Example (docs/design.md), `L = 8`, stream `5 6 7 8 5 6 9 5 6`: targets at pos 1..8 are
    `6 7 8 5 6 9 5 6`; pos 5 and 8 repeat bigram (5, 6) with prev_pos 1 and 5; with a training
    count of 10 for (5, 6) and threshold 1250 both are AR hits. Stream `1 2 3 4 1 2 3 9 2`:
    match_len 1 at pos 5, 2 at pos 6 (`1 2 3` occurred at stream indices 0..2), 0 elsewhere.
    """
    from ar_slicing.algorithms.counts.lookup import BigramCounts
    from ar_slicing.algorithms.tag_kernels import Rules, Tables, compiled

    L = int(window)
    n = len(stream) - 1  # targets; target k (0-based) is stream index first_target + k
    if n <= 0:
        return _empty_columns()
    tokens = _checked_tokens(stream, vocab_size, first_window)
    kernels = compiled()
    table = lookup.region_table if isinstance(lookup, BigramCounts) else None
    lookup_fn = lookup.lookup if isinstance(lookup, BigramCounts) else lookup
    span_counts = np.zeros(0, np.int64) if span_counts is None else span_counts
    if kernels is None:
        columns = _tag_windows_numpy(
            tokens, first_window, L, docs, lookup_fn, threshold, vocab_size, reset_at_doc_boundary
        )
        columns["span_train_count"] = span_train_counts(columns, span_order, span_counts)
        return columns
    use_table = table is not None and tokens.dtype == np.uint16
    starts, slots = (
        (table.starts, table.slots)
        if use_table
        else (np.zeros(2, np.int64), np.zeros(1, np.uint64))
    )
    if out is None or len(out["pos"]) < n:
        out = column_buffers(n)
    if out["pos_window"][0] != L:  # batches start at windows: one ramp serves them all
        ramp = np.arange(1, min(L, len(out["pos"])) + 1, dtype=np.int32)  # (never longer than out)
        out["pos"][:] = np.resize(ramp, len(out["pos"]))
        out["pos_window"][0] = L
    columns = {name: out[name][:n] for name in TAG_COLUMNS if name not in ("token", "prev")}
    if not copy_lengths:
        columns["match_len"][:] = 0
        columns["span_train_count"][:] = 0
    # the batch's ids as int32 once: `prev` and `token` are the same memory, one apart
    columns["prev"], columns["token"] = out["ids"][:n], out["ids"][1 : n + 1]
    head_of = out["head_of"][:n] if not use_table else out["head_of"][:1]
    rules = Rules(
        max(int(vocab_size), 1),
        bool(reset_at_doc_boundary),
        int(threshold),
        bool(copy_lengths),
        int(span_order),
        False,
    )
    tables = Tables(use_table, read_only(starts), read_only(slots), read_only(span_counts))
    used = _tag_batch(kernels, tokens, first_window, L, docs, rules, tables, out, n, head_of)
    if not use_table:
        # counts of each window's first occurrences, spread to the later ones
        heads = head_of == np.arange(n)
        count = columns["train_count"]
        count[heads] = lookup_fn(columns["prev"][heads], columns["token"][heads])
        count[:] = count[head_of]
        columns["is_ar_hit"] = columns["is_repeat"] & (count <= threshold)
        if copy_lengths:
            bigram_spans = (columns["match_len"] > 0) & (
                (columns["match_len"] < 2) | (span_order < 2)
            )
            np.copyto(columns["span_train_count"], count, where=bigram_spans)
    if copy_lengths and span_order >= 2 and used != len(span_counts):
        raise RuntimeError(f"{len(span_counts)} span counts for {used} long copies")
    return columns


def _tag_batch(kernels, tokens, first_window, L, docs, rules, tables, out, n, head_of, spans=()):
    """The compiled tag kernel over a batch of n targets, writing into the buffers `out`
    (`spans`: where the long copies are listed)."""
    from ar_slicing.algorithms.tag_kernels import Batch, BatchDocs, Columns, Scratch

    first_row = int(np.searchsorted(docs.offsets, first_target(first_window, L), side="right")) - 1
    docs = (docs.offsets, docs.doc_ids, docs.subset_code)
    columns = [out[name][:n] for name in ("window_id", "doc_id", *_KERNEL_COLUMNS)]
    columns.insert(2, out["ids"][: n + 1])
    return kernels["tag_batch"](
        Batch(read_only(tokens), n, L, first_window),
        BatchDocs(*map(read_only, docs), first_row),
        rules,
        tables,
        Columns(*columns),
        Scratch(head_of, out["chain"], *(spans or (np.zeros(0, np.int64), np.zeros(0, np.int32)))),
    )


def long_spans(
    stream: np.ndarray,
    first_window: int,
    window: int,
    *,
    docs: DocTable,
    vocab_size: int,
    span_order: int,
    reset_at_doc_boundary: bool = False,
    out: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The long copies of a batch (`stream` as for `tag_windows`): the targets whose
    `min(match_len, span_order)` is 2 or more, in order, as `(ends, orders)`: the index in
    `stream` where each one's span n-gram ends (k + 1 for target k) and that n-gram's order,
    `min(match_len, span_order) + 1`. `tag_windows` needs their training counts in this order.
    """
    from ar_slicing.algorithms.tag_kernels import Rules, Tables, compiled

    L = int(window)
    n = len(stream) - 1
    if n <= 0 or span_order < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    tokens = _checked_tokens(stream, vocab_size, first_window)
    kernels = compiled()
    if kernels is None:
        origin = None
        if reset_at_doc_boundary:
            doc_rows = docs.rows_of_range(first_target(first_window, L), n)
            origin = docs.offsets[doc_rows] - first_target(first_window, L)
        match_len = copy_lengths_numpy(tokens, L, origin)
        ends = np.flatnonzero(match_len >= 2) + 1
        return ends, np.minimum(match_len[ends - 1], span_order).astype(np.int32) + 1
    if out is None or len(out["chain"]) < min(n, L):
        out = column_buffers(min(n, L))
    ends, orders = np.empty(n, np.int64), np.empty(n, np.int32)  # pages only where written
    rules = Rules(
        max(int(vocab_size), 1), bool(reset_at_doc_boundary), 0, True, int(span_order), True
    )
    none = (np.zeros(2, np.int64), np.zeros(1, np.uint64), np.zeros(0, np.int64))
    tables = Tables(False, *map(read_only, none))
    # no column is written: buffers shorter than the batch will do
    spans = (ends, orders)
    n_long = _tag_batch(
        kernels, tokens, first_window, L, docs, rules, tables, out, n, out["head_of"][:1], spans
    )
    return ends[:n_long], orders[:n_long]


def span_train_counts(columns, span_order: int, span_counts: np.ndarray) -> np.ndarray:
    """Training count of each target's `(min(match_len, K) + 1)`-gram (0 for non-repeats):
    order 2 is the bigram's `train_count`, orders 3..K+1 are `span_counts`, one per target with
    `min(match_len, K) >= 2`, in order (the numpy path of `tag_windows`)."""
    match_len = columns["match_len"]
    out = np.multiply(columns["train_count"], match_len > 0)
    if span_order < 2:
        return out
    long = np.flatnonzero(match_len >= 2)
    if len(long) != len(span_counts):
        raise RuntimeError(f"{len(span_counts)} span counts for {len(long)} long copies")
    out[long] = span_counts
    return out


def row_bytes() -> int:
    """Bytes a worker holds per target of a batch: the column buffers (`column_buffers`), their
    Arrow copy for the Parquet write, and the kernel's scratch and listed long copies."""
    columns = sum(np.dtype(t).itemsize for t in _DTYPES.values())
    return 2 * columns + np.dtype(np.int32).itemsize + np.dtype(np.int64).itemsize + 12


def column_buffers(n: int) -> dict[str, np.ndarray]:
    """Space for `tag_windows` to write the columns of up to `n` targets into."""
    return {
        **{
            name: np.empty(n, _DTYPES[name])
            for name in TAG_COLUMNS
            if name not in ("token", "prev")
        },
        "ids": np.empty(n + 1, np.int32),  # `prev` and `token`, one apart
        "chain": np.empty(max(n, 1), np.int32),  # earlier target of each one's bigram
        "head_of": np.empty(max(n, 1), np.int64),
        "pos_window": np.zeros(1, np.int64),  # the window length `pos` holds positions for
    }


def _tag_windows_numpy(
    tokens: np.ndarray,
    first_window: int,
    L: int,
    docs: DocTable,
    lookup: Lookup,
    threshold: int,
    vocab_size: int,
    reset_at_doc_boundary: bool,
) -> dict[str, np.ndarray]:
    """`tag_windows` by sorting the batch's bigrams (see the module docstring)."""
    n = len(tokens) - 1
    prev, token = tokens[:-1], tokens[1:]

    order = _bigram_order(prev, token, vocab_size)  # (n,) targets by (bigram, index)
    sorted_prev, sorted_token = prev[order], token[order]
    # same[k]: sorted target k+1 has the bigram of sorted target k, its previous occurrence
    same = (sorted_prev[1:] == sorted_prev[:-1]) & (sorted_token[1:] == sorted_token[:-1])
    earlier, later = order[:-1], order[1:]
    in_context = same & (earlier // L == later // L)
    doc_rows = docs.rows_of_range(first_target(first_window, L), n)
    if reset_at_doc_boundary:
        in_context &= doc_rows[earlier] == doc_rows[later]
    prev_pos = np.zeros(n, dtype=np.int32)
    prev_pos[later[in_context]] = earlier[in_context] % L + 1
    del earlier, later, in_context

    # Training counts: the run heads are the batch's distinct bigrams in sorted order.
    run_head = np.empty(n, dtype=bool)
    run_head[0] = True
    np.logical_not(same, out=run_head[1:])
    del same
    head_counts = np.asarray(lookup(sorted_prev[run_head], sorted_token[run_head]), dtype=np.int64)
    train_count = np.empty(n, dtype=np.int64)
    train_count[order] = head_counts[np.cumsum(run_head) - 1]
    del order, sorted_prev, sorted_token, run_head

    is_repeat = prev_pos > 0
    origin = (
        docs.offsets[doc_rows] - first_target(first_window, L) if reset_at_doc_boundary else None
    )
    match_len = copy_lengths_numpy(tokens, L, origin)
    if np.any((match_len > 0) != is_repeat):
        raise RuntimeError("copy lengths and repeats disagree")
    n_rows = -(-n // L)
    return {
        "window_id": np.repeat(np.arange(first_window, first_window + n_rows, dtype=np.int32), L)[
            :n
        ],
        "pos": np.tile(np.arange(1, L + 1, dtype=np.int32), n_rows)[:n],
        "doc_id": docs.doc_ids[doc_rows],
        "token": token.astype(np.int32),
        "prev": prev.astype(np.int32),
        "train_count": train_count,
        "prev_pos": prev_pos,
        "is_repeat": is_repeat,
        "is_ar_hit": is_repeat & (train_count <= threshold),
        "subset": docs.subset_code[doc_rows],
        "match_len": match_len,
    }


def copy_lengths_numpy(tokens, L: int, doc_origin=None) -> np.ndarray:
    """match_len of every target of a batch, level by level, without a loop over tokens.

    `tokens` holds whole windows from a window start (`tag_windows`' stream); target k's copy of
    m covers tokens[k+1-m .. k+1]; none starts before its window's first token
    (tokens index (k // L) * L), nor, with `doc_origin` (the reset: per target, the index of the
    token before its document's first), before that. Level m gives every target whose copy of m
    may exist a class id: equal ids = the same m+1 tokens in the same window (and document). A
    class of two or more targets has a copy of m at each but its first; only such targets can
    start a class of level m+1, whose id is (class at level m of target k, tokens[k+2]) for
    target k+1. Level 1 is the bigram in its window, so the first level holds the repeats.
    """
    n = len(tokens) - 1
    k = np.arange(n, dtype=np.int64)
    origin = (k // L) * L
    if doc_origin is not None:
        origin = np.maximum(origin, doc_origin)
    reach = k + 1 - origin  # the longest copy that could end at each target
    match_len = np.zeros(n, np.int32)
    ids = tokens.astype(np.int64)
    vocab = int(ids.max()) + 1 if n else 1
    group = k // L if doc_origin is None else np.unique(origin, return_inverse=True)[1]
    group = np.asarray(group, np.int64) + (k // L) * (n + 1)
    cls = _ranks(_ranks(group) * vocab + ids[:-1]) * vocab + ids[1:]
    at, m = k, 1
    while at.size:
        cls = _ranks(cls)
        sizes = np.bincount(cls)
        _, first = np.unique(cls, return_index=True)
        later = np.ones(at.size, bool)
        later[first] = False
        match_len[at[later]] = m
        keep = sizes[cls] >= 2
        at, cls = at[keep], cls[keep]
        nxt = at + 1
        ok = (nxt < n) & (nxt // L == at // L)
        ok[ok] = reach[nxt[ok]] >= m + 1
        at, cls = nxt[ok], cls[ok] * vocab + ids[nxt[ok] + 1]
        m += 1
    return match_len


def _ranks(keys: np.ndarray) -> np.ndarray:
    """Dense ids 0.. of `keys` (equal keys, equal ids)."""
    return np.unique(keys, return_inverse=True)[1].astype(np.int64).ravel()


def _checked_tokens(stream: np.ndarray, vocab_size: int, first_window: int) -> np.ndarray:
    if vocab_size > 1 << 31:
        raise BadInput(f"vocabulary of {vocab_size} ids: token ids must fit the int32 tag columns")
    tokens = np.asarray(stream)
    if tokens.dtype.kind not in "iu":
        raise BadInput(f"token stream must hold integers, got {tokens.dtype}")
    low, top = int(tokens.min()), int(tokens.max())
    if top >= vocab_size or low < 0:
        bad = top if top >= vocab_size else low
        raise BadInput(
            f"token id {bad} in the windows from {first_window} is outside the vocabulary of "
            f"{vocab_size}; the store's tokens.bin does not match its meta.json"
        )
    # the store's own dtypes: radix sorting needs 16-bit ids, and the compiled kernels are
    # compiled for these two only
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    return tokens if tokens.dtype == dtype else tokens.astype(dtype)


def _bigram_order(prev: np.ndarray, token: np.ndarray, vocab_size: int) -> np.ndarray:
    """Indices that sort the targets by (prev, token, index): a stable argsort of the bigrams."""
    n = len(prev)
    if prev.dtype == np.uint16:
        # numpy's stable argsort of 16-bit integers is a radix sort: two linear passes (least
        # significant key first) are about twice as fast as one sort of packed 64-bit keys.
        by_token = np.argsort(token, kind="stable")
        return by_token[np.argsort(prev[by_token], kind="stable")]
    index_bits = max(1, (n - 1).bit_length())
    if (vocab_size * vocab_size).bit_length() + index_bits <= 64:
        codes, n_codes = prev.astype(np.uint64), vocab_size
        next_codes = token.astype(np.uint64)
    else:  # ids too large to pack beside the index: rank them among the batch's own ids
        uniq, inverse = np.unique(np.concatenate([prev[:1], token]), return_inverse=True)
        inverse = inverse.astype(np.uint64).ravel()
        codes, next_codes, n_codes = inverse[:-1], inverse[1:], len(uniq)
    keys = codes * np.uint64(n_codes) + next_codes
    keys <<= np.uint64(index_bits)
    keys |= np.arange(n, dtype=np.uint64)
    keys.sort()
    return (keys & np.uint64((1 << index_bits) - 1)).astype(np.int64)


_DTYPES = {
    "window_id": np.int32,
    "pos": np.int32,
    "doc_id": np.int64,
    "token": np.int32,
    "prev": np.int32,
    "train_count": np.int64,
    "prev_pos": np.int32,
    "is_repeat": np.bool_,
    "is_ar_hit": np.bool_,
    "subset": np.int32,
    "match_len": np.int32,
    "span_train_count": np.int64,
}


def _empty_columns() -> dict[str, np.ndarray]:
    return {name: np.zeros(0, dtype=_DTYPES[name]) for name in TAG_COLUMNS}


def to_arrow(columns: dict[str, np.ndarray], subset_names: tuple[str, ...]):
    """A pyarrow table of `tags_schema()` columns (subset dictionary-encoded; see write_part).

    The numpy columns are wrapped, not copied; `is_repeat`'s bitmap doubles as the validity of
    `prev_pos` and `span_train_count` (a target has them exactly when it repeats).
    """
    import pyarrow as pa

    n = len(columns["pos"])

    def buffer(name):
        return pa.py_buffer(np.ascontiguousarray(columns[name], dtype=_DTYPES[name]))

    def bits(mask):
        return pa.py_buffer(np.packbits(mask, bitorder="little"))

    def array(name, validity=None):
        return pa.Array.from_buffers(arrow_type[name], n, [validity, buffer(name)])

    arrow_type = {f.name: f.type for f in tags_schema()}
    repeat_bits = bits(columns["is_repeat"])
    codes = columns["subset"]
    valid = codes >= 0
    indices = pa.Array.from_buffers(
        pa.int32(), n, [None if valid.all() else bits(valid), buffer("subset")]
    )
    arrays = [array(name) for name in TAG_COLUMNS[:6]]
    arrays.append(array("prev_pos", repeat_bits))
    arrays.append(pa.Array.from_buffers(pa.bool_(), n, [None, repeat_bits]))
    arrays.append(pa.Array.from_buffers(pa.bool_(), n, [None, bits(columns["is_ar_hit"])]))
    arrays.append(
        pa.DictionaryArray.from_arrays(
            indices, pa.array(list(subset_names), pa.string()), safe=False
        )
    )
    arrays.append(array("match_len"))
    arrays.append(array("span_train_count", repeat_bits))
    return pa.Table.from_arrays(arrays, schema=arrow_write_schema())


def arrow_write_schema():
    """`tags_schema()` with `subset` dictionary-encoded in memory.

    The Parquet file stores `subset` as a plain string column (dictionary pages); the arrow
    schema is not stored, so every reader sees `string` exactly as the contract says.
    """
    import pyarrow as pa

    schema = tags_schema()
    return schema.set(
        schema.get_field_index("subset"), pa.field("subset", pa.dictionary(pa.int32(), pa.string()))
    )


# Encodings and codecs chosen for write speed, then size (measured on 1 M-row batches of the
# tag benchmark): the key columns are runs or ramps that lz4 shrinks to almost nothing faster
# than delta encoding does; token ids and counts are close to random, and split into byte streams
# they compress well and fast with snappy; `prev_pos` is null 3 times in 4 and stored plain (its
# definition levels cost the writer more than any encoding saves); subsets repeat per document
# (dictionary). The writer takes values 64 K at a time instead of 1 K (less work per value).
PARQUET_OPTIONS = {
    "compression": {
        "window_id": "lz4",
        "pos": "lz4",
        "doc_id": "lz4",
        "token": "snappy",
        "prev": "snappy",
        "train_count": "snappy",
        "prev_pos": "none",
        "is_repeat": "none",
        "is_ar_hit": "none",
        "subset": "none",
        "match_len": "lz4",
        "span_train_count": "snappy",
    },
    "use_dictionary": ["subset"],
    "column_encoding": {
        "window_id": "PLAIN",
        "pos": "PLAIN",
        "doc_id": "PLAIN",
        "token": "BYTE_STREAM_SPLIT",
        "prev": "BYTE_STREAM_SPLIT",
        "train_count": "BYTE_STREAM_SPLIT",
        "prev_pos": "PLAIN",
        "is_repeat": "PLAIN",
        "is_ar_hit": "PLAIN",
        "match_len": "PLAIN",
        "span_train_count": "BYTE_STREAM_SPLIT",
    },
    # min/max of the keys lets readers skip row groups when they join on a window range
    "write_statistics": ["window_id", "doc_id"],
    "write_batch_size": 1 << 16,
    "store_schema": False,
}


def slice_counts(columns: dict[str, np.ndarray], n_subsets: int) -> dict[str, list[int]]:
    """Tokens, repeats and AR hits per subset code (index 0 = no subset, k+1 = subset k)."""
    from ar_slicing.algorithms.tag_kernels import compiled

    kernels = compiled()
    if kernels is not None:
        out = np.zeros((n_subsets + 1, 3), np.int64)
        kernels["slice_counts"](
            np.ascontiguousarray(columns["subset"], np.int32),
            np.ascontiguousarray(columns["is_repeat"], np.bool_),
            np.ascontiguousarray(columns["is_ar_hit"], np.bool_),
            out,
        )
        return {name: out[:, k].tolist() for k, name in enumerate(("tokens", "repeats", "ar_hits"))}
    codes = columns["subset"] + 1
    return {
        name: np.bincount(codes if mask is None else codes[mask], minlength=n_subsets + 1).tolist()
        for name, mask in (
            ("tokens", None),
            ("repeats", columns["is_repeat"]),
            ("ar_hits", columns["is_ar_hit"]),
        )
    }


def warm() -> None:
    """Compile (or load from numba's cache) the signatures the tag stage uses, in this process:
    the public functions run once on a tiny batch, so the types are exactly those of a run."""
    from ar_slicing.algorithms.counts import BigramCounts, ngrams, regions
    from ar_slicing.algorithms.tag_kernels import compiled

    if compiled() is None:
        return

    regions.warm()
    ngrams.warm()
    one = np.zeros(1, np.int64)
    docs = DocTable(offsets=one, doc_ids=one, subset_code=np.full(1, -1, np.int32), subset_names=())
    stream = np.zeros(2, np.uint16)
    table = BigramCounts(one + 1, one + 1, one + 1, meta={})
    for lookup in (table, lambda prev, nxt: np.zeros(len(prev), np.int64)):
        args = dict(docs=docs, lookup=lookup, threshold=0, vocab_size=2)
        columns = tag_windows(stream, 0, 1, **args)
    long_spans(stream, 0, 1, docs=docs, vocab_size=2, span_order=4)
    slice_counts(columns, 0)
