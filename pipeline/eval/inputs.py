"""What the eval stage reads and computes: the tag windows, and the sequences a chunk of them becomes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.windows import window_bounds
from ar_slicing.data.tokenizer import require_same_fingerprint
from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import META_NAME, is_complete, read_json
from ar_slicing.machinery.layout import TAG_PART_GLOB, WINDOWS_NAME
from ar_slicing.machinery.parts import part_rows


@dataclass
class TagsInput:
    """The tag directory's window table and the token store it was made from."""

    dir: Path
    meta: dict
    window: int  # L
    starts: np.ndarray  # (W,) int64
    n_targets: np.ndarray  # (W,) int64
    store: object  # ar_slicing.data.store.TokenStore
    n_tag_rows: int

    @property
    def n_windows(self) -> int:
        return len(self.starts)


def open_tags(tags_dir: str | Path, tokens: str | None = None) -> TagsInput:
    """Read and check a tag directory: complete, window table as docs/design.md defines it, tag rows
    one per target, and a token store of the same tokenizer and length."""
    import pyarrow.parquet as pq

    from ar_slicing.data.store import TokenStore
    from ar_slicing.machinery.layout import where_is

    tags_dir = Path(tags_dir)
    if tags_dir.is_file():
        raise BadInput(
            f"--tags {tags_dir}: a file, not a folder; give the tags folder ({tags_dir.parent}?)"
        )
    if not tags_dir.is_dir():
        raise BadInput(f"tags {tags_dir}: no such directory (run `arslice tag` first)")
    if not is_complete(tags_dir):
        hint = where_is(tags_dir, "tags")
        if hint:
            raise BadInput(f"--tags {tags_dir}: not a tag directory; {hint}")
        raise BadInput(
            f"tags {tags_dir}: incomplete (no meta.json); rerun `arslice tag` to finish it"
        )
    meta = read_json(tags_dir / META_NAME)
    for key in ("window", "fingerprint"):
        if key not in meta:
            raise BadInput(f"{tags_dir / META_NAME}: has no `{key}`; rerun `arslice tag`")
    store_path = tokens or meta.get("tokens")
    if not store_path:
        raise BadInput(f"{tags_dir / META_NAME}: names no token store; pass --tokens")
    store = TokenStore.open(store_path)
    require_same_fingerprint(
        meta["fingerprint"], f"tags {tags_dir}", store.fingerprint, f"token store {store.path}"
    )
    window = int(meta["window"])
    path = tags_dir / WINDOWS_NAME
    try:
        table = pq.read_table(path, columns=["window_id", "start", "n_targets"])
    except Exception as e:
        raise BadInput(f"{path}: cannot read the window table ({e}); rerun `arslice tag`") from None
    window_id = table.column("window_id").to_numpy().astype(np.int64)
    starts = table.column("start").to_numpy().astype(np.int64)
    n_targets = table.column("n_targets").to_numpy().astype(np.int64)
    expected_starts, expected_targets = window_bounds(
        np.arange(len(window_id), dtype=np.int64), window, store.n_tokens
    )
    for name, got, want in (
        ("window_id", window_id, np.arange(len(window_id))),
        ("start", starts, expected_starts),
        ("n_targets", n_targets, expected_targets),
    ):
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise BadInput(
                f"{path}: row {i} has {name} {int(got[i])} but a {store.n_tokens}-token stream in "
                f"windows of {window} needs {int(want[i])}; the tags were made from another store "
                f"than {store.path} (pass --tokens) or are damaged (rerun `arslice tag --overwrite`)"
            )
    if int(n_targets.sum()) != max(store.n_tokens - 1, 0):
        raise BadInput(
            f"{path}: {len(window_id)} windows cover {int(n_targets.sum())} targets but the store "
            f"{store.path} has {store.n_tokens - 1}; rerun `arslice tag --overwrite`"
        )
    parts = sorted(tags_dir.glob(TAG_PART_GLOB))
    n_tag_rows = sum(part_rows(parts))
    if n_tag_rows != int(n_targets.sum()):
        raise BadInput(
            f"tags {tags_dir}: {len(parts)} {TAG_PART_GLOB} files hold {n_tag_rows} rows but "
            f"{WINDOWS_NAME} has {int(n_targets.sum())} targets; rerun `arslice tag --overwrite`"
        )
    return TagsInput(tags_dir, meta, window, starts, n_targets, store, n_tag_rows)


# ---- what gets computed -------------------------------------------------------------------------


@dataclass
class Sequence:
    """One model input: it reads `inputs`; outputs `score_from..` are scored against `targets`
    and land in rows `row0..` of the chunk's loss array."""

    inputs: np.ndarray  # (T,) int64
    targets: np.ndarray  # (T,) int64, targets[t] = the token output t predicts
    score_from: int
    row0: int


def chunk_bounds(n_windows: int, chunk_windows: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk_windows, n_windows)) for a in range(0, n_windows, chunk_windows)]


def window_runs(window_ids: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The increasing `window_ids` as runs of consecutive windows `(w0, w1)` (windows
    w0..w1-1), what a chunk's sequences are made from: `[0, 1, 2, 5, 7, 8]` ->
    `((0, 3), (5, 6), (7, 9))`."""
    ids = np.asarray(window_ids, dtype=np.int64)
    if ids.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [ids.size]])
    return tuple((int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, ends))


def fixed_sequences(tags: TagsInput, w0: int, w1: int) -> list[Sequence]:
    """The tag windows themselves: window w reads S[start : start+n] and predicts S[start+1 : start+n+1]."""
    out = []
    row = 0
    for w in range(w0, w1):
        start, n = int(tags.starts[w]), int(tags.n_targets[w])
        span = tags.store.slice(start, start + n + 1).astype(np.int64)
        out.append(Sequence(span[:-1], span[1:], 0, row))
        row += n
    return out


def rolling_sequences(
    tags: TagsInput, w0: int, w1: int, prefix: int | None = None, lead: tuple[int, ...] = ()
) -> list[Sequence]:
    """Per-document rolling windows (ar_slicing.algorithms.rolling) whose predictions fall in windows w0..w1-1,
    each document read after the token `prefix` (default: the store's EOS) and the tokens `lead`
    (the harness's `[BOS] + doc` token list for a tokenizer that adds BOS, `--harness-bos`; their
    predictions predict no stream token and are not scored).

    Rows of a chunk are its targets in stream order, so stream index `i` lands in row
    `i - (first target of the chunk)`. A rolling window that reaches past the chunk is cut
    after the chunk's last target (a causal model's earlier outputs do not depend on later
    inputs) and the part before the chunk is left unscored; the neighbouring chunk scores it.
    """
    from ar_slicing.algorithms.rolling import rolling_windows

    store = tags.store
    lo = int(tags.starts[w0]) + 1  # first target stream index of the chunk
    hi = int(tags.starts[w1 - 1] + tags.n_targets[w1 - 1])  # last target stream index
    offsets = store.doc_offsets
    ends = np.append(offsets[1:], store.n_tokens)  # a document's segment: its tokens and its EOS
    first_doc = int(np.searchsorted(ends, lo, side="right"))  # the segment holding `lo`
    last_doc = int(np.searchsorted(offsets, hi, side="right")) - 1
    eos = store.eos_id
    prefix = eos if prefix is None else prefix
    head = np.array([prefix, *lead], dtype=np.int64)
    shift = len(lead)
    out = []
    for d in range(first_doc, last_doc + 1):
        o, e = int(offsets[d]), int(ends[d])
        # The EOS after a document (appended by `tokenize`, or already in an imported stream)
        # gets the trailing-EOS rule; a segment without one is all document.
        trailing_eos = e > o and int(store.tokens[e - 1]) == eos
        n_doc = e - o - 1 if trailing_eos else e - o
        extended = _extended_slicer(store, head, o)
        for a, b, k in rolling_windows(n_doc + shift, tags.window, trailing_eos):
            # E[j] is stream index o + j - 1 - shift (E[0] is the prefix, E[1..shift] the lead);
            # outputs t predict E[a + 1 + t].
            first_scored = max(o + b - k - shift, o)  # the lead's targets are not in the stream
            last_scored = o + b - 1 - shift
            s_lo, s_hi = max(first_scored, lo), min(last_scored, hi)
            if s_lo > s_hi:
                continue
            stop = b - (last_scored - s_hi)  # drop inputs only needed for targets after the chunk
            inputs, targets = extended(a, stop), extended(a + 1, stop + 1)
            out.append(Sequence(inputs, targets, s_lo - (o + a - shift), s_lo - lo))
    return out


def _extended_slicer(store, head: np.ndarray, o: int):
    """`E[i:j]` of E = head + the stream from index `o`, reading only the part of the stream
    needed (head[h] is E[h]; E[h] for h >= len(head) is stream index o + h - len(head))."""
    n = len(head)

    def extended(i: int, j: int) -> np.ndarray:
        tail = store.slice(o + max(i, n) - n, o + j - n).astype(np.int64) if j > n else head[:0]
        return np.concatenate([head[i:j], tail])

    return extended
