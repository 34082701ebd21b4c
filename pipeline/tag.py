"""`arslice tag`: evaluation windows, in-context repeats and AR hits of a validation token store.

Reads a validation token store and the training bigram counts; writes into `--out`:
  windows.parquet        window_id int32, start int64, n_targets int32 (what eval reads)
  tags-00000.parquet ... one row per scored target, sorted by (window_id, pos); each part holds
                         whole windows, is written atomically and is the unit of resumption
  meta.json              parameters, input fingerprints, counts overall and per subset (last)

Copy spans (docs/copy-length.md): with `--span-order K` >= 2 the windows are read twice. The
first pass only finds the long copies (`ar_slicing.algorithms.tags.long_spans`: match_len capped at K, no
columns) and gathers the n-grams of orders 3..K+1 that end at them (for a repeat with match_len
m >= 2, those of orders 3..min(m, K)+1), keeping for each long copy the row of its span n-gram;
the training stores the bigram counts were made from are then read once to count exactly those
(`ar_slicing.algorithms.counts.ngrams`), and the tagging pass writes the parts, handed each batch's span
counts in the order it meets the long copies. Both full and restricted bigram counts name their
training stores in their meta.json; counts imported from elsewhere do not, and need
`--span-order 1` (span count = the bigram's count).
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import META_NAME, TAG_PART
from ar_slicing.machinery.plan.stage_parts import Part, StageParts
from pipeline.config import Command, say
from pipeline.stage import Finished
from pipeline.wiring import COUNTS, STORES, TAGS, Wiring

log = logging.getLogger(__name__)

BATCH_TOKENS = 1 << 20  # targets tagged at once (one Parquet row group): bounds worker memory
MAX_SPAN_ORDER = 32  # n-grams of up to 33 tokens (the table keeps orders in int8)


@dataclass(frozen=True)
class TagConfig:
    tokens: str = field(metadata={"help": "validation token store directory"})
    counts: str = field(metadata={"help": "training bigram counts directory (arslice count)"})
    out: str = field(metadata={"help": "output directory for windows.parquet, tags-*.parquet"})
    window: int = field(default=2048, metadata={"help": "window length L (targets per window)"})
    threshold: int = field(
        default=1250, metadata={"help": "AR hit: a repeat whose training count is at most this"}
    )
    reset_at_doc_boundary: bool = field(
        default=False,
        metadata={"help": "count only earlier occurrences in the same document as repeats"},
    )
    span_order: int = field(
        default=4,
        metadata={
            "help": "K: span_train_count is the training count of the (min(match_len, K) + 1)-gram "
            "ending at a repeat (1 = the bigram's count)"
        },
    )
    workers: int = field(default=0, metadata={"help": "worker processes (0 = all cores)"})
    part_tokens: int = field(
        default=1 << 22,
        metadata={"help": "targets per output part, rounded to whole windows (resume granularity)"},
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output directory"})


@dataclass(frozen=True)
class PartTask:
    """One output part: windows [first_window, first_window + n_windows)."""

    index: int
    first_window: int
    n_windows: int
    tokens: str
    counts: str
    out: str
    window: int
    threshold: int
    reset_at_doc_boundary: bool
    span_order: int = 1

    @property
    def path(self) -> Path:
        return Path(self.out) / TAG_PART.format(self.index)


def part_tasks(
    cfg: TagConfig, n_windows: int, tokens: str, counts: str, out: str
) -> list[PartTask]:
    per_part = max(1, cfg.part_tokens // cfg.window)
    return [
        PartTask(
            index=k,
            first_window=first,
            n_windows=min(per_part, n_windows - first),
            tokens=tokens,
            counts=counts,
            out=out,
            **tag_rules(cfg),
        )
        for k, first in enumerate(range(0, n_windows, per_part))
    ]


# Opened once per worker process (the store is a memmap; the counts may be large).
_OPEN: dict[str, object] = {}


def _opened(kind: str, path: str):
    key = f"{kind}:{path}"
    if key not in _OPEN:
        if kind == "store":
            from ar_slicing.data.store import TokenStore

            _OPEN[key] = TokenStore.open(path)
        elif kind == "docs":
            from ar_slicing.algorithms.tags import DocTable

            _OPEN[key] = DocTable.from_store(_opened("store", path))
        else:
            from ar_slicing.algorithms.counts import BigramCounts

            _OPEN[key] = BigramCounts.open(path)
    return _OPEN[key]


_BUFFERS: dict[str, np.ndarray] = {}
# What the tag workers need of the span n-gram counts, set before they are forked: the table
# (while counting), the counts, and per part and batch the rows of its long copies' n-grams.
_SPANS: dict[str, object] = {}


def _batches(task: PartTask):
    """(first window, stream) of each batch of a part's windows: both passes take a part in the
    same batches, so a batch's long copies are the same in each."""
    from ar_slicing.algorithms.windows import stream_range

    store = _opened("store", task.tokens)
    L = task.window
    batch_windows = max(1, BATCH_TOKENS // L)
    end_window = task.first_window + task.n_windows
    for w in range(task.first_window, end_window, batch_windows):
        w_end = min(w + batch_windows, end_window)
        yield w, store.slice(*stream_range(w, w_end, L, store.n_tokens))


def batch_targets(window: int, n_tokens: int) -> int:
    """The most targets a batch of windows of `window` tokens holds in a store of `n_tokens`
    (`BATCH_TOKENS`, or one window): a window longer than the store holds the store, never
    more, so no memory grows with the window itself."""
    return max(1, min(max(1, BATCH_TOKENS // window) * window, n_tokens - 1))


def _buffers(task: PartTask) -> dict[str, np.ndarray]:
    """Column memory reused by every batch of every part this worker tags."""
    from ar_slicing.algorithms.tags import column_buffers

    n_tokens = _opened("store", task.tokens).n_tokens
    size = batch_targets(task.window, n_tokens)
    if len(_BUFFERS.get("pos", ())) < size:
        _BUFFERS.update(column_buffers(size))
    return _BUFFERS


def span_grams_of_part(task: PartTask) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct n-grams a part's long copies need counted (rows like `NgramTable.grams`)
    and, per batch, the row among them of each long copy's span n-gram, in order."""
    from ar_slicing.algorithms.counts.ngrams import NgramTable
    from ar_slicing.algorithms.tags import long_spans

    store = _opened("store", task.tokens)
    docs = _opened("docs", task.tokens)
    # room for an n-gram per four targets from the start (growing the table costs more)
    targets = min(task.n_windows * task.window, store.n_tokens)
    table = NgramTable.empty(task.span_order, max(1 << 16, targets // 4))
    rows = []
    for w, stream in _batches(task):
        ends, orders = long_spans(
            stream,
            w,
            task.window,
            docs=docs,
            vocab_size=store.vocab_size,
            span_order=task.span_order,
            reset_at_doc_boundary=task.reset_at_doc_boundary,
            out=_buffers(task),
        )
        rows.append(table.add(stream, ends, orders).astype(np.int32))
    return table.grams[: table.n_rows].copy(), rows


def count_spans(task) -> np.ndarray:
    from ar_slicing.algorithms.counts.ngrams import count_span_task

    return count_span_task(task, _SPANS["table"])


def tag_part(task: PartTask) -> dict:
    """Tag one part's windows in batches and write its Parquet file atomically.

    Returns per-subset counts (see `ar_slicing.algorithms.tags.slice_counts`) and the number of targets.
    """
    import pyarrow.parquet as pq

    from ar_slicing.algorithms.tags import (
        PARQUET_OPTIONS,
        arrow_write_schema,
        slice_counts,
        tag_windows,
        to_arrow,
    )
    from ar_slicing.machinery.io import atomic_path

    store = _opened("store", task.tokens)
    docs = _opened("docs", task.tokens)
    counts = _opened("counts", task.counts)
    span_rows = _SPANS.get("rows", {}).get(task.index)
    n_subsets = len(docs.subset_names)
    totals = {
        "tokens": [0] * (n_subsets + 1),
        "repeats": [0] * (n_subsets + 1),
        "ar_hits": [0] * (n_subsets + 1),
    }
    n_rows = 0
    with atomic_path(task.path) as tmp:
        with pq.ParquetWriter(tmp, arrow_write_schema(), **PARQUET_OPTIONS) as writer:
            for batch, (w, stream) in enumerate(_batches(task)):
                columns = tag_windows(
                    stream,
                    w,
                    task.window,
                    docs=docs,
                    lookup=counts,
                    threshold=task.threshold,
                    vocab_size=store.vocab_size,
                    reset_at_doc_boundary=task.reset_at_doc_boundary,
                    span_order=task.span_order if span_rows is not None else 1,
                    span_counts=None if span_rows is None else _SPANS["counts"][span_rows[batch]],
                    out=_buffers(task),
                )
                writer.write_table(to_arrow(columns, docs.subset_names))
                for name, values in slice_counts(columns, n_subsets).items():
                    totals[name] = [a + b for a, b in zip(totals[name], values)]
                n_rows += len(columns["pos"])
    return {"rows": n_rows, **totals}


@contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_tag(cfg: TagConfig) -> dict:
    # Python's cyclic garbage collector is paused for the stage (and its forked workers, which
    # inherit that): the stage makes no reference cycles to speak of, while each full
    # collection would walk every object of numba and pyarrow, many times over the imports.
    with _gc_paused():
        return _run_tag(cfg)


def validate_tag(cfg: TagConfig) -> None:
    from ar_slicing.algorithms.windows import check_window

    check_window(cfg.window)
    if cfg.threshold < 0:
        raise ArSliceError(f"--threshold must be >= 0, got {cfg.threshold}")
    if cfg.part_tokens < 1:
        raise ArSliceError(f"--part-tokens must be >= 1, got {cfg.part_tokens}")
    if cfg.workers < 0:
        raise ArSliceError(f"--workers must be >= 0 (0 = all cores), got {cfg.workers}")
    if not 1 <= cfg.span_order <= MAX_SPAN_ORDER:
        raise ArSliceError(
            f"--span-order must be between 1 and {MAX_SPAN_ORDER}, got {cfg.span_order} "
            "(1: the span count is the bigram's count; the default 4 counts up to 5-grams)"
        )


def tag_rules(cfg: TagConfig) -> dict:
    """The rules a target is tagged by: what every part task and meta.json carry."""
    return {
        "window": cfg.window,
        "threshold": cfg.threshold,
        "reset_at_doc_boundary": cfg.reset_at_doc_boundary,
        "span_order": cfg.span_order,
    }


def tag_settings(cfg: TagConfig) -> dict:
    """What decides the tag files' bytes besides the inputs (the settings part of the plan)."""
    return {**tag_rules(cfg), "part_tokens": cfg.part_tokens}


def _counted_sources(counts_meta: dict, store) -> list[str]:
    """The counts' source stores that are `store` itself (a store tagged against its own counts
    finds every bigram seen at least once: no AR hit can have a training count of 0)."""
    here = str(Path(store.path).resolve())
    return [
        str(s.get("path"))
        for s in counts_meta.get("sources", [])
        if isinstance(s, dict) and s.get("path") == here and s.get("n_tokens") == store.n_tokens
    ]


def span_training_stores(
    counts_meta: dict, counts_dir: str, span_order: int
) -> tuple[list, int | None]:
    """The training token stores the counts were made from (and their counting unit's row
    length), opened, for counting span n-grams the same way; none for span order 1."""
    from ar_slicing.algorithms.counts.keys import parse_unit
    from ar_slicing.data.store import TokenStore

    if span_order < 2:
        return [], None
    sources = counts_meta.get("sources") or []
    if not sources or any(not isinstance(s, dict) or "dtype" not in s for s in sources):
        raise ArSliceError(
            f"counts {counts_dir} name no training token stores (imported or hand-made counts), so "
            f"the n-grams of span order {span_order} cannot be counted: pass --span-order 1 (span "
            "count = the bigram's count) or count the training stores with `arslice count`"
        )
    stores = []
    for source in sources:
        try:
            store = TokenStore.open(source["path"])
        except ArSliceError as e:
            raise ArSliceError(
                f"counts {counts_dir}: training store {source['path']} is needed for span counts "
                f"but cannot be opened ({e}); restore it or pass --span-order 1"
            ) from None
        if store.n_tokens != source.get("n_tokens") or store.fingerprint != source.get(
            "fingerprint"
        ):
            raise ArSliceError(
                f"counts {counts_dir} were made from {source['path']} with {source.get('n_tokens'):,} "
                f"tokens, which now has {store.n_tokens:,} (or another tokenizer): recount it"
            )
        stores.append(store)
    return stores, parse_unit(str(counts_meta.get("unit") or "stream"))


def _require_memory(cfg: TagConfig, n_tokens: int) -> None:
    """Refuse, before any work, a window whose batches hold more than this machine's memory
    (the counts' own table, loaded once and shared, is not counted)."""
    from ar_slicing.algorithms.tags import row_bytes
    from ar_slicing.machinery.executor import default_workers
    from ar_slicing.machinery.limits import require_memory

    rows = batch_targets(cfg.window, n_tokens)
    workers = cfg.workers or default_workers()
    require_memory(
        workers * rows * row_bytes(),
        f"--window {cfg.window}: tagging {workers} batch(es) of {rows:,} targets at once",
        "use a shorter --window (the paper's is 2048) or fewer --workers",
    )


def _run_tag(cfg: TagConfig) -> dict:

    from ar_slicing.algorithms.counts.restricted import check_covers
    from ar_slicing.data.store import TokenStore
    from ar_slicing.data.tokenizer import require_same_fingerprint
    from ar_slicing.machinery.plan import StagePlan, identity
    from pipeline.stage import run_stage

    t0 = time.time()
    validate_tag(cfg)
    store = TokenStore.open(cfg.tokens)
    if store.n_tokens < 2:
        raise ArSliceError(
            f"token store {cfg.tokens}: {store.n_tokens} token(s), so nothing to tag (a target "
            "needs a token before it); tokenize a validation set with at least one document"
        )
    _require_memory(cfg, store.n_tokens)
    out = Path(cfg.out)
    # Refuse mismatched inputs from the counts' meta.json, before building their lookup table.
    counts_meta = read_json(Path(cfg.counts) / META_NAME)
    require_same_fingerprint(
        store.fingerprint,
        f"token store {cfg.tokens}",
        str(counts_meta.get("fingerprint")),
        f"counts {cfg.counts}",
    )
    check_covers(counts_meta, cfg.counts, store)
    training = span_training_stores(counts_meta, cfg.counts, cfg.span_order)
    plan = StagePlan(
        "tag",
        settings=tag_settings(cfg),
        inputs={"tokens": identity(cfg.tokens), "counts": identity(cfg.counts)},
    )

    def warnings() -> list[str]:
        if not _counted_sources(counts_meta, store):
            return []
        warning = (
            f"the counts {cfg.counts} were made from {cfg.tokens} itself: every bigram of it "
            "has a training count of at least 1; tag a held-out store (tokens/val) instead"
        )
        log.warning(warning)
        return [warning]

    return run_stage(
        "tag",
        out,
        plan,
        lambda stage, warned: _tag_into(stage, cfg, store, counts_meta, training, warned, t0),
        overwrite=cfg.overwrite,
        prepare=warnings,
        detail=lambda meta: f"{meta['counts']['tokens']:,} tokens",
    )


def _count_span_ngrams(cfg: TagConfig, parts: list[PartTask], training, workers: int):
    """Collect the n-grams the parts' long copies need (`workers` processes), count them over
    the training stores (split among all of --workers), and leave in `_SPANS` what the tagging
    workers need: the counts, and per part and batch the rows of its long copies. Returns what
    meta.json records, and the times taken."""
    from ar_slicing.algorithms.counts.ngrams import NgramTable, span_count_tasks
    from ar_slicing.machinery.executor import LocalExecutor, default_workers

    stores, row = training
    t0 = time.time()
    table = NgramTable.empty(cfg.span_order, 1 << 16)
    rows = {}
    for task, (grams, batch_rows) in LocalExecutor(workers).map_unordered(
        span_grams_of_part, parts
    ):
        where = table.add_rows(grams).astype(np.int32)  # the part's rows in the run's table
        rows[task.index] = [where[r] for r in batch_rows]
    t_collect = time.time() - t0
    table.shrink()
    table.trigram_filter()  # made once, before the counting workers are forked
    _SPANS["table"] = table
    all_workers = cfg.workers or default_workers()
    tasks = span_count_tasks(stores, row, cfg.span_order, all_workers)
    counts = np.zeros(table.n_rows, np.int64)
    t1 = time.time()
    if table.n_rows:
        for _, part in LocalExecutor(all_workers).map_unordered(count_spans, tasks):
            counts += part
    table.counts = counts
    # the tagging workers read counts by row; the table itself is not needed any more
    _SPANS.update(counts=counts, rows=rows)
    del _SPANS["table"]
    return {
        "span_order": cfg.span_order,
        "training_stores": [
            {"path": str(s.path.resolve()), "n_tokens": s.n_tokens} for s in stores
        ],
        "unit": "stream" if row is None else f"row:{row}",
        "by_order": table.order_summary(),
    }, {"span_collect_s": t_collect, "span_count_s": time.time() - t1}


@contextmanager
def _shared_with_workers(store, docs, counts, tokens_path: str, counts_path: str):
    """Worker processes forked inside inherit the opened store, documents and counts
    (copy-on-write) instead of rebuilding the counts' lookup table each; under "spawn" they
    open their own. Dropped, with the kernels' buffers, on the way out."""
    keys = (f"store:{tokens_path}", f"docs:{tokens_path}", f"counts:{counts_path}")
    _OPEN.update(zip(keys, (store, docs, counts)))
    try:
        yield
    finally:
        for key in keys:
            _OPEN.pop(key, None)
        _BUFFERS.clear()
        _SPANS.clear()


def _inputs_record(store, tokens_path: str, counts_path: str, counts_meta: dict) -> dict:
    """What meta.json records of the tagged store and the counts."""
    keys = ("total_pairs", "distinct_bigrams", "unit")
    return {
        "tokens": {
            "path": tokens_path,
            "n_tokens": store.n_tokens,
            "n_docs": store.n_docs,
            "git_hash": store.meta.get("git_hash"),
        },
        "counts": {"path": counts_path, **{k: counts_meta.get(k) for k in keys}},
    }


def _tag_into(
    stage, cfg: TagConfig, store, counts_meta: dict, training, warnings: list[str], t0: float
) -> Finished:
    from ar_slicing.algorithms.counts import BigramCounts
    from ar_slicing.algorithms.tags import DocTable, warm
    from ar_slicing.algorithms.windows import window_table, write_window_table
    from ar_slicing.machinery.executor import default_workers
    from ar_slicing.machinery.io import build_meta
    from ar_slicing.machinery.layout import WINDOWS_NAME

    out = stage.out
    # The counts' table is read and built on a thread (Parquet decoding and the build kernel
    # release the GIL) while this one loads the compiled code, which the workers then inherit.
    with ThreadPoolExecutor(1) as background:
        opening = background.submit(BigramCounts.open, cfg.counts)
        warm()
        docs = DocTable.from_store(store)
        counts = opening.result()
    tokens_path = str(Path(cfg.tokens).resolve())
    counts_path = str(Path(cfg.counts).resolve())
    with _shared_with_workers(store, docs, counts, tokens_path, counts_path):
        windows = window_table(store.n_tokens, cfg.window)
        tasks = part_tasks(
            cfg, len(windows["window_id"]), tokens_path, counts_path, str(out.resolve())
        )
        stage.expect([out / WINDOWS_NAME])
        # a part is kept when the ledger records it whole, with the counts it had
        parts = StageParts(stage, [Part(t.path.name, (t.path,), t) for t in tasks])
        write_window_table(out / WINDOWS_NAME, store.n_tokens, cfg.window)
        n_targets = int(windows["n_targets"].sum(dtype=np.int64))
        workers = min(cfg.workers or default_workers(), max(1, len(parts.todo)))
        log.info(
            "tagging %d targets in %d windows of %d: %d parts (%d already done), %d workers",
            n_targets,
            len(windows["window_id"]),
            cfg.window,
            len(tasks),
            len(parts.facts),
            workers,
        )
        span_counts, span_times = {"span_order": cfg.span_order, "by_order": {}}, {}
        if cfg.span_order >= 2:
            # of every part, finished ones too: the counts meta.json records are those of the
            # whole output, whether or not an earlier run wrote some of its parts
            say(f"tag: counting the span n-grams (orders 3..{cfg.span_order + 1}) in training")
            span_workers = min(cfg.workers or default_workers(), len(tasks))
            span_counts, span_times = _count_span_ngrams(cfg, tasks, training, span_workers)
        work_s = _tag_parts(parts, workers, n_targets)

    summary, by_subset = _totals(parts.facts, [None, *docs.subset_names])
    if summary["tokens"] != n_targets:
        raise ArSliceError(
            f"{out}: parts hold {summary['tokens']} rows, windows {n_targets}; rerun"
        )
    wall = time.time() - t0
    tagged = sum(parts.facts[part.name]["rows"] for part in parts.todo)
    meta = build_meta(
        "tag",
        config=cfg,
        inputs=_inputs_record(store, tokens_path, counts_path, counts_meta),
        counts={
            **summary,
            "windows": len(windows["window_id"]),
            "parts": len(tasks),
            "by_subset": by_subset,
        },
        wall_time_s=wall,
        throughput={"tokens_per_s": tagged / work_s if work_s > 0 else 0.0, **span_times},
        skipped={"parts_already_complete": len(tasks) - len(parts.todo)},
        tokens=tokens_path,
        counts_dir=counts_path,
        fingerprint=store.fingerprint,
        **tag_rules(cfg),
        span_counts=span_counts,
        parts=[t.path.name for t in tasks],
        warnings=warnings,
    )
    lines = _summary_lines(out, summary, by_subset, cfg, wall)
    return Finished(meta, lines + [f"tag: warning: {line}" for line in warnings])


def _tag_parts(parts: StageParts, workers: int, n_targets: int) -> float:
    """Tag the parts not done yet (`workers` processes), each recorded in the stage's ledger as
    it finishes; the seconds it took."""
    from tqdm import tqdm

    from ar_slicing.machinery.executor import LocalExecutor

    t0 = time.time()
    with tqdm(total=n_targets, unit="tok", unit_scale=True, desc="tag", disable=None) as bar:
        bar.update(sum(r["rows"] for r in parts.facts.values()))
        for _, result in parts.run(tag_part, LocalExecutor(workers)):
            bar.update(result["rows"])
    return time.time() - t0


def _totals(results: dict, names: list[str | None]) -> tuple[dict, list[dict]]:
    """The parts' per-subset counts added up: (the whole output's tokens, repeats and AR hits,
    and the same per subset that has tokens; `names[0]` is None, the documents of no subset)."""
    totals = {
        key: np.sum([r[key] for r in results.values()], axis=0, dtype=np.int64)
        if results
        else np.zeros(len(names), np.int64)
        for key in ("tokens", "repeats", "ar_hits")
    }
    by_subset = [
        {"subset": name, **{key: int(totals[key][k]) for key in totals}}
        for k, name in enumerate(names)
        if totals["tokens"][k] > 0
    ]
    return {key: int(totals[key].sum()) for key in totals}, by_subset


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "n/a"


def _summary_lines(
    out: Path, summary: dict, by_subset: list[dict], cfg: TagConfig, wall: float
) -> list[str]:
    n = summary["tokens"]
    lines = [
        f"tag: {n:,} tokens in windows of {cfg.window}: {_pct(summary['repeats'], n)} repeats, "
        f"{_pct(summary['ar_hits'], n)} AR hits (train count <= {cfg.threshold}; the paper found "
        f"6.4% on the Pile) -> {out} ({wall:.1f} s)"
    ]
    if len(by_subset) > 1:
        width = max(len(str(s["subset"])) for s in by_subset)
        lines += [
            f"  {str(s['subset']).ljust(width)}  {s['tokens']:>14,} tokens  "
            f"{_pct(s['repeats'], s['tokens']):>7} repeats  {_pct(s['ar_hits'], s['tokens']):>7} AR hits"
            for s in by_subset
        ]
    return lines


COMMAND = Command(
    TagConfig,
    run_tag,
    validate=validate_tag,
    plan_settings=tag_settings,
    inputs=lambda cfg: [("--tokens", cfg.tokens, "dir"), ("--counts", cfg.counts, "dir")],
    summary="evaluation windows, in-context repeats and AR hits",
    examples="""\
  arslice tag --tokens runs/pile/tokens/val --counts runs/pile/counts --out runs/pile/tags
  arslice tag --tokens runs/pile/tokens/val --counts runs/pile/counts --out runs/pile/tags-doc \\
      --reset-at-doc-boundary --threshold 1250 --window 2048
  arslice tag --tokens runs/pile/tokens/val --counts runs/pile/counts --out runs/pile/tags-k8 \
      --span-order 8""",
    pipeline=Wiring(
        table="tag",
        reads=(STORES, COUNTS),
        writes=TAGS,
        defaults=lambda run, table: {
            "tokens": run.layout.store("val"),
            "counts": run.layout.counts,
            "out": run.layout.tags,
        },
    ),
)
