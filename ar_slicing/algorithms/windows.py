"""Non-overlapping evaluation windows over a token stream (docs/design.md, "Stream and windows").

Window `w` of length `L` covers stream indices `w*L .. w*L+L` (L+1 tokens): the model reads
`S[w*L : w*L+L]` and predicts `S[w*L+1 : w*L+L+1]`. Every stream token but the first is a target
exactly once; the last window may be shorter and is kept as it is (never padded into the scores).
"""

from __future__ import annotations

import numpy as np

from ar_slicing.errors import ArSliceError


def window_schema():
    import pyarrow as pa

    return pa.schema([("window_id", pa.int32()), ("start", pa.int64()), ("n_targets", pa.int32())])


def n_windows(n_tokens: int, window: int) -> int:
    """How many windows of length `window` a stream of `n_tokens` tokens has (0 below 2 tokens)."""
    check_window(window)
    if n_tokens < 0:
        raise ArSliceError(f"n_tokens must be >= 0, got {n_tokens}")
    return -(-(n_tokens - 1) // window) if n_tokens >= 2 else 0


def first_target(w, L):
    """Stream index of window `w`'s first target (`w*L + 1`; its context starts one token
    earlier). Plain arithmetic: it takes numpy arrays, and compiled kernels call it too."""
    return w * L + 1


def stream_range(first_window: int, end_window: int, L: int, n_tokens: int) -> tuple[int, int]:
    """(start, stop): the stream slice `S[start:stop]` that windows `first_window ..
    end_window - 1` read and predict, from the first one's first context token (`w*L`) to the
    last one's final target (the last window of the stream may be partial, so `stop` is at most
    `n_tokens`). With `L = 4` and a 10-token stream (the window table's example below), windows
    0..2 read and predict `S[0:10]`, window 1 alone `S[4:9]`."""
    return first_target(first_window, L) - 1, min(first_target(end_window, L), n_tokens)


def window_bounds(window_id: np.ndarray, L: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """`start` (`w*L`) and `n_targets` (`min(L, n_tokens - 1 - w*L)`) of the windows `window_id`
    (int64) of a stream of `n_tokens` tokens: the rows of its window table."""
    first = first_target(window_id, L)
    return first - 1, np.minimum(L, n_tokens - first)


def window_table(n_tokens: int, window: int) -> dict[str, np.ndarray]:
    """The window table of a stream: `window_id`, `start` (stream index of the window's first
    context token, `w*L`) and `n_targets` (`min(L, n_tokens - 1 - w*L)`).

    Worked example, `L = 4` and a 10-token stream `S[0..9]` (9 targets, S[1]..S[9])::

        window_id  start  n_targets   reads       predicts
        0          0      4           S[0:4]      S[1:5]
        1          4      4           S[4:8]      S[5:9]
        2          8      1           S[8:9]      S[9:10]    <- last, partial window

    Window 2 keeps its single target (pos 1, stream index 9). A stream of 0 or 1 tokens has no
    targets and so no windows; a stream shorter than one window has one partial window; with
    `L = 1` every target is its own window (its context is the one token before it).
    """
    count = n_windows(n_tokens, window)
    window_id = np.arange(count, dtype=np.int64)
    start, n_targets = window_bounds(window_id, window, n_tokens)
    if count > np.iinfo(np.int32).max:
        raise ArSliceError(f"{count} windows do not fit window_id int32; use a longer --window")
    return {
        "window_id": window_id.astype(np.int32),
        "start": start.astype(np.int64),
        "n_targets": n_targets.astype(np.int32),
    }


def check_window(window: int) -> None:
    if not isinstance(window, (int, np.integer)) or window < 1:
        raise ArSliceError(f"window length must be a positive integer, got {window!r}")
    if window > np.iinfo(np.int32).max:
        raise ArSliceError(f"window length {window} does not fit pos int32")


def write_window_table(path, n_tokens: int, window: int) -> int:
    """Write `windows.parquet` atomically; returns the number of windows."""
    import pyarrow as pa

    from ar_slicing.machinery.io import write_parquet_atomic

    table = pa.table(window_table(n_tokens, window), schema=window_schema())
    write_parquet_atomic(path, table)
    return table.num_rows


def read_window_table(path) -> dict[str, np.ndarray]:
    """`windows.parquet` back as numpy columns."""
    import pyarrow.parquet as pq

    from ar_slicing.errors import BadInput

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise BadInput(f"{path}: cannot read the window table ({e}); rerun `arslice tag`") from None
    return {name: table.column(name).to_numpy() for name in ("window_id", "start", "n_targets")}


# ---- the windows an evaluation scores -----------------------------------------------------------


def window_subset(n_windows: int, n: int | None) -> np.ndarray:
    """The windows of a subset of `n` of the `n_windows` windows, evenly strided over all of them:
    window `floor(k * W / n)` for `k = 0 .. n-1` (every window when `n` is None or at least W).

    Strided rather than the first `n`: a store holds its documents in source order (the demo's
    files sorted by path, a corpus's shards one after another), so the first windows are one part
    of the text, while windows taken at a fixed stride through the whole stream sample every part
    of it in proportion; the subset's mix of sources, repeats and AR hits is the whole set's.

    Worked example, `W = 10`, `n = 4`: windows 0, 2, 5, 7 (`floor(k * 10 / 4)` for k = 0..3).
    """
    if n is None or n >= n_windows:
        return np.arange(n_windows, dtype=np.int64)
    if n < 1:
        raise ArSliceError(f"a window subset needs at least one window, got {n}")
    return np.arange(n, dtype=np.int64) * n_windows // n


def scored_window_ids(
    windows_total: int, window_subset_size: int | None, windows_evaluated: int | None = None
) -> np.ndarray:
    """The ids of the windows a losses folder scored, from what its meta.json records: the
    subset (`window_subset`, every window without one), cut to its first `windows_evaluated`
    (a partial evaluation, `--max-windows`)."""
    ids = window_subset(windows_total, window_subset_size)
    return ids if windows_evaluated is None else ids[: int(windows_evaluated)]
