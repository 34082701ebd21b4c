"""`arslice verify`: check the invariants of a run directory and print every one that fails.

Checks, stage by stage (each prints `ok` or `FAIL` with the file and the numbers involved):
  tokens/*     tokens.bin holds exactly n_tokens x itemsize bytes; docs.parquet has n_docs rows
               whose offsets tile the stream; every id is below the vocabulary size; the store's
               tokenizer.json has the fingerprint its meta.json records
  counts       bigrams.parquet: (prev, next) strictly increasing (sorted and unique), every count
               positive, the counts sum to total_pairs and the rows number distinct_bigrams
  tags         windows.parquet is the window table of the validation stream; tag rows are sorted
               by (window_id, pos) and cover every target of the stream exactly once; token and
               prev equal the stream; train_count equals the counts; is_ar_hit follows its rule;
               a repeat's prev_pos is an earlier position of its window with the same bigram;
               recomputed from the stream, every repeat is found and prev_pos is the latest
  models/*     each model was trained on a store of the run's tokenizer
  losses/*     exactly one loss row per tag row (of the windows evaluated), every nll finite
  everywhere   one tokenizer fingerprint across stores, counts, tags, models and losses

Exit status 0 when every check passes, 2 (with the list of failures) otherwise. Incomplete
outputs (no meta.json: a stage still running or interrupted) are reported and not checked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError
from pipeline.config import Command, say

log = logging.getLogger(__name__)

# Rows read at a time: bounds memory on Pile-sized tables.
BATCH_ROWS = 1 << 22


@dataclass(frozen=True)
class VerifyConfig:
    run: str = field(metadata={"help": "run directory (runs/<name>) to check"})
    scan_tokens: bool = field(
        default=True,
        metadata={
            "help": "read every token of the stores (ids below the vocabulary, tags equal to the "
            "stream); --no-scan-tokens checks sizes, tables and losses only"
        },
    )


class Checks:
    """Collects check outcomes; prints each one as it is decided."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0
        self.notes: list[str] = []

    def ok(self, what: str) -> None:
        self.passed += 1
        say(f"  ok    {what}")

    def fail(self, what: str) -> None:
        self.failures.append(what)
        say(f"  FAIL  {what}")

    def note(self, what: str) -> None:
        self.notes.append(what)
        say(f"  note  {what}")

    def check(self, condition: bool, what: str, why: str = "") -> bool:
        if condition:
            self.ok(what)
        else:
            self.fail(f"{what}: {why}" if why else what)
        return bool(condition)


# ---- token stores ------------------------------------------------------------------------------


def verify_store(path: Path, checks: Checks, scan_tokens: bool) -> dict | None:
    """Check one token store; returns its meta (None when it could not be read)."""
    import pyarrow.parquet as pq

    from ar_slicing.io import read_json
    from ar_slicing.store import DOCS_NAME, TOKENIZER_NAME, TOKENS_NAME
    from ar_slicing.tokenizer import fingerprint, load_tokenizer

    meta = read_json(path / "meta.json")
    n_tokens, dtype = int(meta["n_tokens"]), np.dtype(meta["dtype"]).newbyteorder("<")
    bin_path = path / TOKENS_NAME
    size = bin_path.stat().st_size if bin_path.is_file() else None
    if not checks.check(
        size == n_tokens * dtype.itemsize,
        f"{bin_path}: {n_tokens:,} tokens of {dtype.name}",
        f"file has {size} bytes, meta.json says {n_tokens * dtype.itemsize}",
    ):
        return meta
    try:
        docs = pq.read_table(path / DOCS_NAME, columns=["offset", "n_tokens"])
    except Exception as e:  # pyarrow raises several types for unreadable files
        checks.fail(f"{path / DOCS_NAME}: unreadable ({e})")
        return meta
    offsets = docs.column("offset").to_numpy().astype(np.int64)
    lengths = docs.column("n_tokens").to_numpy().astype(np.int64)
    checks.check(
        docs.num_rows == int(meta["n_docs"]),
        f"{path / DOCS_NAME}: {docs.num_rows:,} documents",
        f"meta.json says {meta['n_docs']}",
    )
    if meta.get("eos_appended", True) and docs.num_rows:
        # Each document is followed by one EOS: the next one starts right after it.
        ends = offsets + lengths + 1
        tiled = offsets[0] == 0 and np.array_equal(offsets[1:], ends[:-1]) and ends[-1] == n_tokens
        checks.check(
            bool(tiled),
            f"{path / DOCS_NAME}: documents and their EOS tile the stream",
            "offsets + n_tokens + 1 do not follow each other up to n_tokens",
        )
    info = meta.get("tokenizer", {})
    if scan_tokens and n_tokens:
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
        top = max(int(tokens[i : i + BATCH_ROWS].max()) for i in range(0, n_tokens, BATCH_ROWS))
        checks.check(
            top < int(info.get("vocab_size", 0)),
            f"{bin_path}: largest id {top} below vocabulary {info.get('vocab_size')}",
            "token ids outside the tokenizer's vocabulary",
        )
    tok_path = path / TOKENIZER_NAME
    if tok_path.is_file():
        actual = fingerprint(load_tokenizer(tok_path))
        checks.check(
            actual == info.get("fingerprint"),
            f"{tok_path}: fingerprint matches meta.json",
            f"file has {actual[:12]}…, meta.json {str(info.get('fingerprint'))[:12]}…",
        )
    return meta


# ---- counts ------------------------------------------------------------------------------------


def verify_counts(path: Path, checks: Checks) -> dict:
    import pyarrow.parquet as pq

    from ar_slicing.counts import BIGRAMS_NAME
    from ar_slicing.io import read_json

    meta = read_json(path / "meta.json")
    bigrams = path / BIGRAMS_NAME
    try:
        pf = pq.ParquetFile(bigrams)
    except Exception as e:
        checks.fail(f"{bigrams}: unreadable ({e})")
        return meta
    total = rows = 0
    last = -1
    ordered = positive = True
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=["prev", "next", "count"]):
        prev = batch.column(0).to_numpy().astype(np.int64)
        nxt = batch.column(1).to_numpy().astype(np.int64)
        count = batch.column(2).to_numpy()
        key = (prev << 32) | nxt  # ids are below 2**32: one int64 orders (prev, next)
        if key.size:
            ordered &= bool(key[0] > last) and bool(np.all(key[1:] > key[:-1]))
            last = int(key[-1])
        positive &= bool(np.all(count > 0))
        total += int(count.sum())
        rows += key.size
    checks.check(ordered, f"{bigrams}: (prev, next) sorted and unique", "keys not increasing")
    checks.check(positive, f"{bigrams}: every count positive", "zero or negative counts")
    checks.check(
        total == int(meta["total_pairs"]),
        f"{bigrams}: counts sum to total_pairs {int(meta['total_pairs']):,}",
        f"they sum to {total:,}",
    )
    checks.check(
        rows == int(meta["distinct_bigrams"]),
        f"{bigrams}: {rows:,} rows = distinct_bigrams",
        f"meta.json says {meta['distinct_bigrams']}",
    )
    return meta


# ---- tags and losses ---------------------------------------------------------------------------


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
    """DESIGN.md's repeat definition, computed from the stream alone (not from the tagger's
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


def verify_tags(
    path: Path,
    val_meta: dict | None,
    val_dir: Path | None,
    counts_dir: Path | None,
    checks: Checks,
    scan_tokens: bool,
) -> tuple[dict, dict | None]:
    """Check the tag directory; returns (its meta, its window table or None)."""
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from ar_slicing.io import read_json
    from ar_slicing.windows import WINDOWS_NAME, read_window_table, window_table

    meta = read_json(path / "meta.json")
    window = int(meta["window"])
    try:
        windows = read_window_table(path / WINDOWS_NAME)
    except Exception as e:
        checks.fail(f"{path / WINDOWS_NAME}: unreadable ({e})")
        return meta, None
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
            return meta, None
    starts = np.asarray(windows["start"], dtype=np.int64)
    n_targets = np.asarray(windows["n_targets"], dtype=np.int64)
    parts = sorted(path.glob("tags-*.parquet"))
    listed = meta.get("parts")
    if listed is not None:
        checks.check(
            [p.name for p in parts] == list(listed),
            f"{path}: the {len(listed)} tag parts meta.json lists",
            f"found {[p.name for p in parts]}",
        )

    tokens = counts = None
    if scan_tokens and val_dir is not None and val_meta is not None:
        dtype = np.dtype(val_meta["dtype"]).newbyteorder("<")
        tokens = np.memmap(val_dir / "tokens.bin", dtype=dtype, mode="r")
    if scan_tokens and counts_dir is not None:
        from ar_slicing.counts import BigramCounts

        counts = BigramCounts.open(counts_dir)
    threshold = int(meta["threshold"])
    mismatches: dict[str, int] = {
        "token": 0,
        "prev": 0,
        "train_count": 0,
        "is_ar_hit": 0,
        "prev_pos": 0,
        "is_repeat and prev_pos (the latest earlier occurrence, from the stream)": 0,
    }
    doc_offsets = None
    if tokens is not None and meta.get("reset_at_doc_boundary"):
        doc_offsets = pq.read_table(val_dir / "docs.parquet", columns=["offset"])
        doc_offsets = doc_offsets.column("offset").to_numpy().astype(np.int64)
    columns = ["window_id", "pos", "token", "prev", "train_count", "is_repeat", "is_ar_hit"]
    columns.append("prev_pos")

    def batches():
        for part in tqdm(parts, desc="verify tags", unit="part", leave=False):
            for b in pq.ParquetFile(part).iter_batches(batch_size=BATCH_ROWS, columns=columns):
                wid = b.column(0).to_numpy()
                pos = b.column(1).to_numpy()
                yield wid, pos
                token = b.column(2).to_numpy().astype(np.int64)
                prev = b.column(3).to_numpy().astype(np.int64)
                train_count = b.column(4).to_numpy()
                rep = b.column(5).to_numpy(zero_copy_only=False)
                hit = b.column(6).to_numpy(zero_copy_only=False)
                mismatches["is_ar_hit"] += int(np.sum(hit != (rep & (train_count <= threshold))))
                # A repeat names an earlier position of the same window holding the same bigram;
                # a non-repeat names none.
                has_prev = ~b.column(7).is_null().to_numpy(zero_copy_only=False)
                prev_pos = b.column(7).fill_null(0).to_numpy().astype(np.int64)
                mismatches["prev_pos"] += int(np.sum(has_prev != rep))
                mismatches["prev_pos"] += int(
                    np.sum(has_prev & ((prev_pos < 1) | (prev_pos >= pos)))
                )
                if tokens is not None:
                    i = starts[wid] + pos  # stream index of each target; keys were checked
                    mismatches["token"] += int(np.sum(tokens[i] != token))
                    mismatches["prev"] += int(np.sum(tokens[i - 1] != prev))
                    sel = has_prev & (prev_pos >= 1) & (prev_pos < pos)
                    j = (starts[wid] + prev_pos)[sel]
                    mismatches["prev_pos"] += int(
                        np.sum((tokens[j] != token[sel]) | (tokens[j - 1] != prev[sel]))
                    )
                    # every repeat found, none invented, and prev_pos the latest occurrence
                    lo, hi = int(wid.min()), int(wid.max()) + 1
                    want = expected_prev_pos(tokens, starts, n_targets, lo, hi, doc_offsets)
                    in_range = (wid >= lo) & (pos >= 1) & (pos <= n_targets[wid])
                    flat = np.concatenate(want) if want else np.zeros(0, np.int64)
                    offsets = np.concatenate([[0], np.cumsum(n_targets[lo:hi])])
                    idx = offsets[wid[in_range] - lo] + pos[in_range] - 1
                    got = np.where(has_prev, prev_pos, 0)[in_range]
                    key = "is_repeat and prev_pos (the latest earlier occurrence, from the stream)"
                    mismatches[key] += int(np.sum(flat[idx] != got))
                if counts is not None:
                    mismatches["train_count"] += int(
                        np.sum(counts.lookup(prev, token) != train_count)
                    )

    try:
        rows, problem = _covering_keys(batches(), n_targets, window)
    except IndexError as e:
        rows, problem = 0, f"a key points outside the validation stream ({e})"
    expected = int(n_targets.sum())
    if problem is None and rows != expected:
        problem = f"{rows:,} rows for {expected:,} targets"
    checks.check(
        problem is None, f"{path}: tag rows cover every target exactly once ({expected:,})", problem
    )
    if problem is None:
        for name, n in mismatches.items():
            if name in ("token", "prev") and tokens is None:
                continue
            if name == "train_count" and counts is None:
                continue
            checks.check(n == 0, f"{path}: {name} of every row as defined", f"{n:,} rows differ")
    return meta, windows


def verify_losses(path: Path, windows: dict, window: int, checks: Checks) -> dict:
    import pyarrow.parquet as pq

    from ar_slicing.io import read_json

    meta = read_json(path / "meta.json")
    n_targets = np.asarray(windows["n_targets"], dtype=np.int64)
    evaluated = int(meta.get("windows_evaluated", n_targets.size))
    scored = n_targets[:evaluated]
    parts = sorted(path.glob("losses-*.parquet"))
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
    checks.check(problem is None, f"{path}: one loss row per tag row{scope}", problem)
    checks.check(
        nonfinite == 0,
        f"{path}: every nll finite",
        f"{nonfinite:,} NaN or infinite values, first at {first_bad}",
    )
    if evaluated < n_targets.size:
        checks.note(f"{path}: partial, {evaluated} of {n_targets.size} windows evaluated")
    return meta


# ---- the run -----------------------------------------------------------------------------------


def _complete_dirs(root: Path, checks: Checks, what: str) -> list[Path]:
    from ar_slicing.io import is_complete

    found = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not d.is_dir():
            continue
        if is_complete(d):
            found.append(d)
        else:
            checks.note(f"{d}: incomplete {what} (no meta.json), not checked")
    return found


def verify_run(cfg: VerifyConfig) -> dict:
    from ar_slicing.io import is_complete, read_json

    run = Path(cfg.run)
    if not run.is_dir():
        raise ArSliceError(f"run directory {run}: no such directory")
    checks = Checks()
    fingerprints: dict[str, str | None] = {}

    say(f"verify {run}")
    if (run / "tokenizer.json").is_file():  # the run's own tokenizer, when the run trained one
        from ar_slicing.tokenizer import fingerprint, load_tokenizer

        fingerprints[f"tokenizer {run / 'tokenizer.json'}"] = fingerprint(
            load_tokenizer(run / "tokenizer.json")
        )
    say("token stores")
    store_metas: dict[str, dict] = {}
    for d in _complete_dirs(run / "tokens", checks, "token store"):
        meta = verify_store(d, checks, cfg.scan_tokens)
        store_metas[d.name] = meta
        fingerprints[f"token store {d}"] = meta.get("tokenizer", {}).get("fingerprint")
    val_dir = run / "tokens" / "val"
    val_meta = store_metas.get("val")

    counts_dir = run / "counts"
    counts_ok = is_complete(counts_dir)
    if counts_ok:
        say("counts")
        meta = verify_counts(counts_dir, checks)
        fingerprints[f"counts {counts_dir}"] = meta.get("fingerprint")
    elif counts_dir.exists():
        checks.note(f"{counts_dir}: incomplete (no meta.json), not checked")

    tags_dir = run / "tags"
    windows = None
    tags_meta = None
    if is_complete(tags_dir):
        say("tags")
        tags_meta, windows = verify_tags(
            tags_dir,
            val_meta,
            val_dir if val_meta is not None else None,
            counts_dir if counts_ok else None,
            checks,
            cfg.scan_tokens,
        )
        fingerprints[f"tags {tags_dir}"] = tags_meta.get("fingerprint")
        if val_meta is None:
            checks.note(f"{val_dir}: no complete validation store; tags checked on their own")
    elif tags_dir.exists():
        checks.note(f"{tags_dir}: incomplete (no meta.json), not checked")

    model_dirs = _complete_dirs(run / "models", checks, "model")
    if model_dirs:
        say("models")
    for d in model_dirs:
        meta = read_json(d / "meta.json")
        fingerprints[f"model {d}"] = meta.get("fingerprint")
        checks.check(
            (d / "model.safetensors").is_file() and (d / "config.json").is_file(),
            f"{d}: config.json and model.safetensors present",
        )

    loss_dirs = _complete_dirs(run / "losses", checks, "losses")
    if loss_dirs:
        say("losses")
    for d in loss_dirs:
        meta = read_json(d / "meta.json")
        fingerprints[f"losses {d}"] = meta.get("fingerprint")
        model_fp = meta.get("model_tokenizer_fingerprint")
        if model_fp and model_fp != meta.get("fingerprint"):
            what = f"{d}: the model's own tokenizer {model_fp[:12]}… is not the tags' one"
            if meta.get("skip_tokenizer_check"):
                checks.note(what + " (evaluated with --skip-tokenizer-check)")
            else:
                checks.fail(what)
        if windows is None or tags_meta is None:
            checks.fail(f"{d}: losses but no valid tags to check them against")
            continue
        if int(meta.get("window", tags_meta["window"])) != int(tags_meta["window"]):
            checks.fail(f"{d}: window {meta.get('window')} but the tags use {tags_meta['window']}")
            continue
        verify_losses(d, windows, int(tags_meta["window"]), checks)

    say("tokenizer")
    distinct = {fp for fp in fingerprints.values()}
    if len(distinct) <= 1:
        checks.check(
            None not in distinct,
            f"one tokenizer fingerprint across {len(fingerprints)} artefact(s)",
            "no fingerprint recorded",
        )
    else:
        listing = "; ".join(f"{what}: {str(fp)[:12]}…" for what, fp in fingerprints.items())
        checks.fail(f"tokenizer fingerprints differ: {listing}")

    say(
        f"verify: {checks.passed} check(s) passed, {len(checks.failures)} failed"
        + (f", {len(checks.notes)} note(s)" if checks.notes else "")
    )
    if checks.failures:
        raise ArSliceError(
            f"{run}: {len(checks.failures)} check(s) failed:\n  " + "\n  ".join(checks.failures)
        )
    return {"passed": checks.passed, "failed": 0, "notes": checks.notes}


COMMAND = Command(
    VerifyConfig,
    verify_run,
    summary="check a run's invariants",
    examples="""\
  arslice verify --run runs/demo
  arslice verify --run runs/pile --no-scan-tokens   # sizes, tables and losses; no token scan""",
)
