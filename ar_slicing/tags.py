"""AR tags: for every target of a run of windows, its in-context repeat and its training count.

Definitions (DESIGN.md, "Exact definitions"): target `i` (stream index, `pos = i - w*L` in 1..L)
has bigram `(S[i-1], S[i])`. It is a *repeat* when an earlier target `j` of the same window
(`w*L+1 <= j < i`) has the same bigram; `prev_pos` is the position of the most recent such `j`.
With `reset_at_doc_boundary`, only `j` in the same document as `i` count (the document whose span,
its trailing EOS included, holds the stream index). An *AR hit* is a repeat whose training count
is at most `threshold` (count 0, never seen, qualifies).

How it is computed, per batch of windows, without a Python loop over tokens: each target gets the
key `bigram << pos_bits | pos`, the `(n_windows, L)` key matrix is sorted row by row (a row is one
window, small enough to sort in cache), and in each sorted row the element before a target with
the same bigram is its most recent earlier occurrence. Training counts are looked up once per
distinct bigram of each window (the first element of each run of equal bigrams) and spread over
the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ar_slicing.errors import BadInput

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
)


def tags_schema():
    """The tag table's schema (DESIGN.md "Tags"); `prev_pos` is null for non-repeats."""
    import pyarrow as pa

    return pa.schema(
        [
            ("window_id", pa.int32()),
            ("pos", pa.int32()),
            ("doc_id", pa.int64()),
            ("token", pa.int32()),
            ("prev", pa.int32()),
            ("train_count", pa.int64()),
            ("prev_pos", pa.int32()),
            ("is_repeat", pa.bool_()),
            ("is_ar_hit", pa.bool_()),
            ("subset", pa.string()),
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
        subsets = docs.column("subset").to_pylist()
        names = tuple(sorted({s for s in subsets if s is not None}))
        index = {name: k for k, name in enumerate(names)}
        code = np.array([index.get(s, -1) if s is not None else -1 for s in subsets], np.int32)
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
    lookup: Lookup,
    threshold: int,
    vocab_size: int,
    reset_at_doc_boundary: bool = False,
) -> dict[str, np.ndarray]:
    """Tag every target of consecutive windows starting at `first_window`.

    `stream` is `S[first_window*L : e]`: the windows' tokens including the last window's final
    target (`e = min((last_window+1)*L + 1, n_tokens)`), so it holds `len(stream) - 1` targets and
    only its last window may be partial. Returns numpy columns named as in `TAG_COLUMNS`, with
    `prev_pos` 0 where there is no earlier occurrence and `subset` as codes into
    `docs.subset_names` (-1 = none).

    Example (DESIGN.md), `L = 8`, stream `5 6 7 8 5 6 9 5 6`: targets at pos 1..8 are
    `6 7 8 5 6 9 5 6`; pos 5 and 8 repeat bigram (5, 6) with prev_pos 1 and 5; with a training
    count of 10 for (5, 6) and threshold 1250 both are AR hits.
    """
    L = int(window)
    n_targets = len(stream) - 1
    if n_targets <= 0:
        return _empty_columns()
    n_rows = -(-n_targets // L)
    size = n_rows * L  # padded to whole rows; padding sorts last and is cut off at the end
    first_index = first_window * L + 1  # stream index of the first target

    if vocab_size > 1 << 31:
        raise BadInput(f"vocabulary of {vocab_size} ids: token ids must fit the int32 tag columns")
    tokens = np.asarray(stream)
    if tokens.dtype.kind not in "iu":
        raise BadInput(f"token stream must hold integers, got {tokens.dtype}")
    top = int(tokens.max())
    if top >= vocab_size or (tokens.dtype.kind == "i" and int(tokens.min()) < 0):
        raise BadInput(
            f"token id {top} at windows from {first_window} is outside the vocabulary of "
            f"{vocab_size}; the store's tokens.bin does not match its meta.json"
        )

    pos_bits = L.bit_length()
    # The sort only needs bigram codes that are equal exactly when the bigrams are; with a
    # vocabulary too large to pack prev*V+next beside the position, use the batch's own ids.
    codes, n_codes = tokens.astype(np.uint64), vocab_size
    if (n_codes * n_codes).bit_length() + pos_bits > 64:
        uniq, inverse = np.unique(tokens, return_inverse=True)
        codes, n_codes = inverse.astype(np.uint64).ravel(), len(uniq)
    pad_code = np.uint64(n_codes * n_codes)  # above every real bigram code

    pos = np.tile(np.arange(1, L + 1, dtype=np.uint64), n_rows)  # (size,)
    keys = np.empty(size, dtype=np.uint64)
    keys[:n_targets] = codes[:-1] * np.uint64(n_codes) + codes[1:]
    keys[n_targets:] = pad_code
    keys <<= np.uint64(pos_bits)
    keys |= pos
    del codes

    sorted_keys = np.sort(keys.reshape(n_rows, L), axis=1)  # (n_rows, L)
    del keys
    pos_mask = np.uint64((1 << pos_bits) - 1)
    sorted_pos = (sorted_keys & pos_mask).astype(np.int64)  # (n_rows, L) positions 1..L
    sorted_bigram = sorted_keys >> np.uint64(pos_bits)
    del sorted_keys
    # flat index (row*L + pos-1) of each sorted element in the padded target arrays
    row_base = (np.arange(n_rows, dtype=np.int64) * L)[:, None]
    sorted_flat = sorted_pos - 1
    sorted_flat += row_base  # (n_rows, L)

    # same[r, k]: sorted element k+1 of row r has the same bigram as element k, its predecessor
    same = sorted_bigram[:, 1:] == sorted_bigram[:, :-1]  # (n_rows, L-1)
    del sorted_bigram

    doc_rows = docs.rows_of_range(first_index, n_targets)
    if reset_at_doc_boundary:
        doc_padded = np.full(size, -1, dtype=np.int64)
        doc_padded[:n_targets] = doc_rows
        earlier_in_doc = same & (doc_padded[sorted_flat[:, :-1]] == doc_padded[sorted_flat[:, 1:]])
        del doc_padded
    else:
        earlier_in_doc = same

    prev_pos = np.zeros(size, dtype=np.int32)
    prev_pos[sorted_flat[:, 1:][earlier_in_doc]] = sorted_pos[:, :-1][earlier_in_doc]
    del sorted_pos, earlier_in_doc

    # Training counts: one lookup per run of equal bigrams in each sorted row, spread over it.
    run_head = np.ones((n_rows, L), dtype=bool)
    run_head[:, 1:] = ~same
    del same
    head_flat = sorted_flat[run_head]
    head_flat = head_flat[head_flat < n_targets]  # padding forms its own runs at row ends
    prev = tokens[:-1]
    token = tokens[1:]
    head_counts = np.asarray(lookup(prev[head_flat], token[head_flat]), dtype=np.int64)
    run_id = np.cumsum(run_head.ravel()) - 1
    del run_head
    n_heads = len(head_counts)
    train_count = np.zeros(size, dtype=np.int64)
    # runs past the last real head are padding; their counts are discarded below
    run_counts = np.concatenate([head_counts, np.zeros(int(run_id[-1]) + 1 - n_heads, np.int64)])
    train_count[sorted_flat.ravel()] = run_counts[run_id]
    del run_id, sorted_flat

    train_count = train_count[:n_targets]
    prev_pos = prev_pos[:n_targets]
    is_repeat = prev_pos > 0
    window_id = np.repeat(np.arange(first_window, first_window + n_rows, dtype=np.int32), L)[
        :n_targets
    ]
    return {
        "window_id": window_id,
        "pos": pos[:n_targets].astype(np.int32),
        "doc_id": docs.doc_ids[doc_rows],
        "token": token.astype(np.int32),
        "prev": prev.astype(np.int32),
        "train_count": train_count,
        "prev_pos": prev_pos,
        "is_repeat": is_repeat,
        "is_ar_hit": is_repeat & (train_count <= threshold),
        "subset": docs.subset_code[doc_rows],
    }


def _empty_columns() -> dict[str, np.ndarray]:
    dtypes = {
        "window_id": np.int32,
        "pos": np.int32,
        "doc_id": np.int64,
        "token": np.int32,
        "prev": np.int32,
        "train_count": np.int64,
        "prev_pos": np.int32,
        "is_repeat": bool,
        "is_ar_hit": bool,
        "subset": np.int32,
    }
    return {name: np.zeros(0, dtype=dtypes[name]) for name in TAG_COLUMNS}


def to_arrow(columns: dict[str, np.ndarray], subset_names: tuple[str, ...]):
    """A pyarrow table of `tags_schema()` columns (subset dictionary-encoded; see write_part)."""
    import pyarrow as pa

    codes = columns["subset"]
    subset = pa.DictionaryArray.from_arrays(
        pa.array(codes, mask=codes < 0) if len(codes) else pa.array([], pa.int32()),
        pa.array(list(subset_names), pa.string()),
    )
    prev_pos = columns["prev_pos"]
    arrays = [pa.array(columns[name]) for name in TAG_COLUMNS[:6]]
    arrays.append(pa.array(prev_pos, mask=prev_pos == 0))
    arrays += [pa.array(columns["is_repeat"]), pa.array(columns["is_ar_hit"]), subset]
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


# Encodings chosen for write speed and size: positions and ids change by small steps (delta),
# token ids are close to random (plain), subsets repeat per document (dictionary).
PARQUET_OPTIONS = {
    "compression": "snappy",
    "use_dictionary": ["subset"],
    "column_encoding": {
        "window_id": "DELTA_BINARY_PACKED",
        "pos": "DELTA_BINARY_PACKED",
        "doc_id": "DELTA_BINARY_PACKED",
        "token": "PLAIN",
        "prev": "PLAIN",
        "train_count": "DELTA_BINARY_PACKED",
        "prev_pos": "DELTA_BINARY_PACKED",
        "is_repeat": "PLAIN",
        "is_ar_hit": "PLAIN",
    },
    # min/max of the keys lets readers skip row groups when they join on a window range
    "write_statistics": ["window_id", "pos", "doc_id"],
    "store_schema": False,
}


def slice_counts(columns: dict[str, np.ndarray], n_subsets: int) -> dict[str, list[int]]:
    """Tokens, repeats and AR hits per subset code (index 0 = no subset, k+1 = subset k)."""
    codes = columns["subset"].astype(np.int64) + 1
    out = {}
    for name, weights in (
        ("tokens", None),
        ("repeats", columns["is_repeat"]),
        ("ar_hits", columns["is_ar_hit"]),
    ):
        out[name] = (
            np.bincount(codes, weights=weights, minlength=n_subsets + 1).astype(np.int64).tolist()
        )
    return out
