"""Checks of the tags (the repeat definition recomputed from the stream) and of the losses."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ar_slicing.machinery.layout import (
    DOCS_NAME,
    LOSS_PART_GLOB,
    TAG_PART_GLOB,
    TOKENS_NAME,
    WINDOWS_NAME,
    meta_path,
)
from ar_slicing.machinery.parts import damage
from pipeline.verify.checks import BATCH_ROWS, Checks


def _parts_whole(parts: list[Path], checks: Checks, schema) -> bool:
    """FAIL for every part without a readable footer or without the columns of `schema` (its
    writer's); True when there is none."""
    problems = [problem for part in parts if (problem := damage(part, schema))]
    for problem in problems:
        checks.fail(problem)
    return not problems


def _covering_keys(batches, n_targets: np.ndarray, window: int):
    """Validate that (window_id, pos) batches are strictly increasing and inside their windows.

    Strictly increasing (hence unique) keys, each a valid target, numbering as many as there are
    targets: together they are every target exactly once. Returns (rows, problem or None).
    """
    rows, last = 0, -1
    for wid, pos in batches:
        wid = wid.astype(np.int64)
        pos = pos.astype(np.int64)
        if wid.size == 0:
            continue
        if wid.min() < 0 or wid.max() >= n_targets.size:
            return rows, f"window_id outside 0..{n_targets.size - 1}"
        bad = np.flatnonzero((pos < 1) | (pos > n_targets[wid]))
        if bad.size:
            i = bad[0]
            return rows, f"window {wid[i]} has pos {pos[i]} outside 1..{n_targets[wid[i]]}"
        key = wid * (window + 1) + pos
        if key[0] <= last or np.any(key[1:] <= key[:-1]):
            return rows, "rows not strictly increasing in (window_id, pos): duplicated or unsorted"
        last = int(key[-1])
        rows += wid.size
    return rows, None


def expected_prev_pos(
    tokens: np.ndarray,
    starts: np.ndarray,
    n_targets: np.ndarray,
    w0: int,
    w1: int,
    doc_offsets: np.ndarray | None = None,
) -> list[np.ndarray]:
    """docs/design.md's repeat definition, computed from the stream alone (not from the tagger's
    tables): for each window w0..w1-1, per target position 1..n, the latest earlier position of
    its window with the same bigram (0: none). With `doc_offsets` (reset_at_doc_boundary) only
    earlier targets of the same document count."""
    n = n_targets[w0:w1].astype(np.int64)
    if n.sum() == 0:
        return [np.zeros(0, np.int64) for _ in n]
    win = np.repeat(np.arange(w0, w1, dtype=np.int64), n)
    first = np.repeat(np.cumsum(n) - n, n)
    pos = np.arange(int(n.sum()), dtype=np.int64) - first + 1
    i = starts[win] + pos
    key = (tokens[i - 1].astype(np.int64) << 32) | tokens[i].astype(np.int64)
    group = (
        np.searchsorted(doc_offsets, i, side="right")
        if doc_offsets is not None
        else np.zeros_like(i)
    )
    order = np.lexsort((pos, key, group, win))
    same = (
        (win[order][1:] == win[order][:-1])
        & (group[order][1:] == group[order][:-1])
        & (key[order][1:] == key[order][:-1])
    )
    latest = np.zeros(len(pos), np.int64)
    latest[order[1:][same]] = pos[order[:-1][same]]
    return np.split(latest, np.cumsum(n)[:-1])


def expected_match_len(tokens, starts, n_targets, w0, w1, window, doc_offsets=None):
    """The copy length of every target of windows w0..w1-1, in order, recomputed from the stream
    by the level-by-level formulation (`copy_lengths_numpy`), not by the tag kernel."""
    from ar_slicing.algorithms.tags import copy_lengths_numpy

    first = int(starts[w0])
    stream = np.asarray(tokens[first : int(starts[w1 - 1] + n_targets[w1 - 1]) + 1])
    origin = None
    if doc_offsets is not None:
        i = first + 1 + np.arange(len(stream) - 1, dtype=np.int64)
        origin = doc_offsets[np.searchsorted(doc_offsets, i, side="right") - 1] - first - 1
    return copy_lengths_numpy(stream, window, origin).astype(np.int64)


def verify_tags(
    path: Path,
    val_meta: dict | None,
    val_dir: Path | None,
    counts_dir: Path | None,
    checks: Checks,
    scan_tokens: bool,
) -> tuple[dict, dict | None]:
    """Check the tag directory; returns (its meta, its window table or None)."""
    from ar_slicing.algorithms.tags import tags_schema
    from ar_slicing.machinery.io import read_json

    meta = read_json(meta_path(path))
    windows = _window_table(path, int(meta["window"]), val_meta, checks)
    if windows is None:
        return meta, None
    parts = sorted(path.glob(TAG_PART_GLOB))
    listed = meta.get("parts")
    if listed is not None:
        checks.check(
            [p.name for p in parts] == list(listed),
            f"{path}: the {len(listed)} tag parts meta.json lists",
            f"found {[p.name for p in parts]}",
        )
    if not _parts_whole(parts, checks, tags_schema()):
        return meta, windows  # (the window table is sound: the losses are still checked)
    rows = TagRows(meta, windows, *_sources(meta, val_meta, val_dir, counts_dir, scan_tokens))
    n_targets = rows.n_targets
    try:
        n_rows, problem = _covering_keys(rows.checked(parts), n_targets, rows.window)
    except IndexError as e:
        n_rows, problem = 0, f"a key points outside the validation stream ({e})"
    expected = int(n_targets.sum())
    if problem is None and n_rows != expected:
        problem = f"{n_rows:,} rows for {expected:,} targets"
    checks.check(
        problem is None, f"{path}: tag rows cover every target exactly once ({expected:,})", problem
    )
    if problem is None:
        for name, n in rows.mismatches.items():
            checks.check(n == 0, f"{path}: {name} of every row as defined", f"{n:,} rows differ")
    return meta, windows


def _window_table(path: Path, window: int, val_meta: dict | None, checks: Checks) -> dict | None:
    """The tag folder's window table, or None when it is unreadable or not the windows of the
    run's validation store (each said as a FAIL)."""
    from ar_slicing.algorithms.windows import read_window_table, window_table

    try:
        windows = read_window_table(path / WINDOWS_NAME)
    except Exception as e:
        checks.fail(f"{path / WINDOWS_NAME}: unreadable ({e})")
        return None
    if val_meta is not None:
        n_tokens = int(val_meta["n_tokens"])
        want = window_table(n_tokens, window)
        same = all(np.array_equal(np.asarray(windows[k]), want[k]) for k in want)
        checks.check(
            same,
            f"{path / WINDOWS_NAME}: the windows of a {n_tokens:,}-token stream, L={window}",
            "not the window table of the run's validation store (tags from another run?)",
        )
        if not same:
            return None
    return windows


def _sources(meta: dict, val_meta, val_dir, counts_dir, scan_tokens: bool) -> tuple:
    """What the rows are checked against beyond their own columns: (the validation stream, its
    documents' offsets where windows reset at them, the bigram counts), each None when not
    scanned or not there."""
    import pyarrow.parquet as pq

    tokens = counts = doc_offsets = None
    if scan_tokens and val_dir is not None and val_meta is not None:
        dtype = np.dtype(val_meta["dtype"]).newbyteorder("<")
        tokens = np.memmap(val_dir / TOKENS_NAME, dtype=dtype, mode="r")
        if meta.get("reset_at_doc_boundary"):
            doc_offsets = pq.read_table(val_dir / DOCS_NAME, columns=["offset"])
            doc_offsets = doc_offsets.column("offset").to_numpy().astype(np.int64)
    if scan_tokens and counts_dir is not None:
        from ar_slicing.algorithms.counts import BigramCounts

        counts = BigramCounts.open(counts_dir)
    return tokens, doc_offsets, counts


_COLUMNS = ["window_id", "pos", "token", "prev", "train_count", "is_repeat", "is_ar_hit"]
_COLUMNS += ["prev_pos", "match_len", "span_train_count"]
_SPANS = "match_len and span_train_count (null, bigram count at 1, below pos)"
_LATEST = "is_repeat and prev_pos (the latest earlier occurrence, from the stream)"
_STREAM_LEN = "match_len (recomputed from the stream)"


class TagRows:
    """The tag rows checked batch by batch against their definition: from their own columns
    (`_by_definition`), the validation stream (`_from_stream`) and the bigram counts; the rows
    that differ are counted per rule in `mismatches` (only the rules there is something to
    check them against)."""

    def __init__(self, meta: dict, windows: dict, tokens, doc_offsets, counts):
        self.window = int(meta["window"])
        self.threshold = int(meta["threshold"])
        self.starts = np.asarray(windows["start"], dtype=np.int64)
        self.n_targets = np.asarray(windows["n_targets"], dtype=np.int64)
        self.tokens, self.doc_offsets, self.counts = tokens, doc_offsets, counts
        rules = ["is_ar_hit", "prev_pos", _SPANS]
        if tokens is not None:
            rules = ["token", "prev", *rules, _LATEST, _STREAM_LEN]
        if counts is not None:
            rules.append("train_count")
        order = ["token", "prev", "train_count", "is_ar_hit", "prev_pos", _LATEST, _SPANS]
        self.mismatches = {rule: 0 for rule in [*order, _STREAM_LEN] if rule in rules}

    def checked(self, parts: list[Path]):
        """Each batch's keys (window_id, pos), for the caller to check first; the batch's rows
        are then checked when the caller asks for the next."""
        import pyarrow.parquet as pq
        from tqdm import tqdm

        for part in tqdm(parts, desc="verify tags", unit="part", leave=False):
            for b in pq.ParquetFile(part).iter_batches(batch_size=BATCH_ROWS, columns=_COLUMNS):
                row = {name: b.column(k) for k, name in enumerate(_COLUMNS)}
                wid, pos = row["window_id"].to_numpy(), row["pos"].to_numpy()
                yield wid, pos
                self._check(wid, pos, row)

    def _check(self, wid, pos, row: dict) -> None:
        token = row["token"].to_numpy().astype(np.int64)
        prev = row["prev"].to_numpy().astype(np.int64)
        train_count = row["train_count"].to_numpy()
        rep = row["is_repeat"].to_numpy(zero_copy_only=False)
        has_prev = ~row["prev_pos"].is_null().to_numpy(zero_copy_only=False)
        prev_pos = row["prev_pos"].fill_null(0).to_numpy().astype(np.int64)
        match_len = row["match_len"].to_numpy().astype(np.int64)
        self._by_definition(pos, row, train_count, rep, has_prev, prev_pos, match_len)
        if self.tokens is not None:
            self._from_stream(wid, pos, token, prev, has_prev, prev_pos, match_len)
        if self.counts is not None:
            self.mismatches["train_count"] += int(
                np.sum(self.counts.lookup(prev, token) != train_count)
            )

    def _by_definition(self, pos, row, train_count, rep, has_prev, prev_pos, match_len) -> None:
        hit = row["is_ar_hit"].to_numpy(zero_copy_only=False)
        self.mismatches["is_ar_hit"] += int(np.sum(hit != (rep & (train_count <= self.threshold))))
        # A repeat names an earlier position of the same window holding the same bigram; a
        # non-repeat names none.
        self.mismatches["prev_pos"] += int(np.sum(has_prev != rep))
        self.mismatches["prev_pos"] += int(np.sum(has_prev & ((prev_pos < 1) | (prev_pos >= pos))))
        # copy lengths: >= 1 exactly for repeats and shorter than the context; a span count
        # exactly for repeats, the bigram's count for a copy of one bigram
        has_span = ~row["span_train_count"].is_null().to_numpy(zero_copy_only=False)
        span = row["span_train_count"].fill_null(0).to_numpy()
        bad = ((match_len > 0) != rep) | (match_len >= pos) | (has_span != rep)
        bad |= (match_len == 1) & (span != train_count)
        self.mismatches[_SPANS] += int(np.sum(bad))

    def _from_stream(self, wid, pos, token, prev, has_prev, prev_pos, match_len) -> None:
        tokens, starts, n_targets = self.tokens, self.starts, self.n_targets
        lo, hi = int(wid.min()), int(wid.max()) + 1
        want = expected_match_len(tokens, starts, n_targets, lo, hi, self.window, self.doc_offsets)
        offsets = np.concatenate([[0], np.cumsum(n_targets[lo:hi])])
        in_range = (pos >= 1) & (pos <= n_targets[wid])
        idx = offsets[wid[in_range] - lo] + pos[in_range] - 1
        self.mismatches[_STREAM_LEN] += int(np.sum(want[idx] != match_len[in_range]))
        i = starts[wid] + pos  # stream index of each target; keys were checked
        self.mismatches["token"] += int(np.sum(tokens[i] != token))
        self.mismatches["prev"] += int(np.sum(tokens[i - 1] != prev))
        sel = has_prev & (prev_pos >= 1) & (prev_pos < pos)
        j = (starts[wid] + prev_pos)[sel]
        self.mismatches["prev_pos"] += int(
            np.sum((tokens[j] != token[sel]) | (tokens[j - 1] != prev[sel]))
        )
        # every repeat found, none invented, and prev_pos the latest occurrence
        want = expected_prev_pos(tokens, starts, n_targets, lo, hi, self.doc_offsets)
        in_range = (wid >= lo) & (pos >= 1) & (pos <= n_targets[wid])
        flat = np.concatenate(want) if want else np.zeros(0, np.int64)
        idx = offsets[wid[in_range] - lo] + pos[in_range] - 1
        got = np.where(has_prev, prev_pos, 0)[in_range]
        self.mismatches[_LATEST] += int(np.sum(flat[idx] != got))


def verify_losses(path: Path, windows: dict, window: int, checks: Checks) -> dict:
    import pyarrow.parquet as pq

    from ar_slicing.machinery.io import read_json
    from pipeline.eval.output import losses_schema

    meta = read_json(meta_path(path))
    n_targets = np.asarray(windows["n_targets"], dtype=np.int64)
    evaluated = int(meta.get("windows_evaluated", n_targets.size))
    scored = n_targets[:evaluated]
    subset = meta.get("window_subset")
    if subset is not None:  # a checkpoint scored on a subset: no row outside its windows
        from ar_slicing.analysis.emergence import losses_windows

        scored = np.zeros_like(n_targets)
        ids = losses_windows(meta, n_targets.size)
        scored[ids] = n_targets[ids]
    parts = sorted(path.glob(LOSS_PART_GLOB))
    if not _parts_whole(parts, checks, losses_schema()):
        return meta
    nonfinite = 0
    first_bad = None

    def batches():
        nonlocal nonfinite, first_bad
        for part in parts:
            table = pq.read_table(part, columns=["window_id", "pos", "nll"])
            wid = table.column("window_id").to_numpy()
            pos = table.column("pos").to_numpy()
            nll = table.column("nll").to_numpy()
            bad = np.flatnonzero(~np.isfinite(nll))
            if bad.size and first_bad is None:
                first_bad = f"{part.name}: window {wid[bad[0]]} pos {pos[bad[0]]} nll {nll[bad[0]]}"
            nonfinite += bad.size
            order = np.lexsort((pos, wid))  # row order inside a part is the writer's choice
            yield wid[order], pos[order]

    rows, problem = _covering_keys(batches(), scored, window)
    expected = int(scored.sum())
    if problem is None and rows != expected:
        problem = f"{rows:,} loss rows for {expected:,} tag rows"
    scope = f" of {evaluated} window(s)" if evaluated < n_targets.size else ""
    if subset is not None:
        scope += f" (a subset of {subset}, evenly strided)"
    checks.check(problem is None, f"{path}: one loss row per tag row{scope}", problem)
    checks.check(
        nonfinite == 0,
        f"{path}: every nll finite",
        f"{nonfinite:,} NaN or infinite values, first at {first_bad}",
    )
    if evaluated < n_targets.size and subset is None:
        checks.note(f"{path}: partial, {evaluated} of {n_targets.size} windows evaluated")
    return meta
