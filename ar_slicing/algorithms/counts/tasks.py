"""A count's tasks, planned and run on an executor: the map shards, the reduce ranges, their join.

Every file of the work (`OUT/.work/`) is a part of the count's ledger (`ar_slicing.machinery.plan`): a
task's file is kept by a resumed run when the ledger records it whole, and the driver records
each as its task returns (the workers only write files).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts import reduce
from ar_slicing.algorithms.counts.keys import bucket_bounds, count_keys, key_dtype_for
from ar_slicing.algorithms.counts.parquet import write_bigrams
from ar_slicing.algorithms.counts.partials import MapTask, bucket_sizes, count_shard, write_partial
from ar_slicing.machinery.layout import (
    BIGRAMS_NAME,
    COUNT_PARTIALS_DIR,
    COUNT_REDUCED_DIR,
    COUNT_WORK_DIR,
    TOKENS_NAME,
)
from ar_slicing.machinery.plan.stage_parts import Part, StageParts

log = logging.getLogger(__name__)

REDUCED_PART = "r{:05d}.parquet"  # in COUNT_REDUCED_DIR: the Parquet part of reduce range j


def make_work_dir(out: Path) -> Path:
    """The work folder of a count into `out`, with its partials and reduced folders: the one an
    unfinished run of the same plan left (so it resumes), else a new one."""
    work = out / COUNT_WORK_DIR
    (work / COUNT_PARTIALS_DIR).mkdir(parents=True, exist_ok=True)
    (work / COUNT_REDUCED_DIR).mkdir(parents=True, exist_ok=True)
    return work


def work_part(path: str | Path) -> str:
    """The ledger's name of a work file: its path inside the work folder (`partials/x.bin`)."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}"


def plan_reduce_tasks(
    work: Path, partials: list[str], shift: int, *, stage
) -> list[reduce.ReduceTask]:
    """Ranges of fine buckets of about REDUCE_RANGE_ENTRIES partial entries, one task each.

    A fixed size, not a fraction of the total, so a reduce task's memory does not grow with the
    corpus: more data means more ranges, not bigger ones. The ranges are kept in `work` (and
    the ledger), so a resumed run reduces the same ranges.
    """
    from ar_slicing.machinery.io import write_json_atomic

    ranges_path = work / COUNT_REDUCED_DIR / "ranges.json"
    planned = stage.done(work_part(ranges_path))
    if planned is not None:
        ranges = [tuple(r) for r in planned["ranges"]]
    else:
        sizes = sum(bucket_sizes(p) for p in partials) if partials else np.zeros(1, dtype=np.int64)
        ranges = reduce.plan_ranges(np.asarray(sizes), reduce.REDUCE_RANGE_ENTRIES)
        write_json_atomic(ranges_path, {"ranges": ranges})
        stage.record(work_part(ranges_path), [ranges_path], ranges=ranges)
    return [
        reduce.ReduceTask(
            partials=tuple(partials),
            b_lo=lo,
            b_hi=hi,
            out=str(work / COUNT_REDUCED_DIR / REDUCED_PART.format(j)),
            shift=shift,
            batch_entries=reduce.REDUCE_RANGE_ENTRIES,
        )
        for j, (lo, hi) in enumerate(ranges)
    ]


def run_map(executor, tasks: list, count, progress: bool, *, stage) -> int:
    """`count` every task whose partial the ledger does not hold. Returns how many it held."""
    from tqdm import tqdm

    parts = StageParts(stage, task_parts(tasks))
    total_tokens = sum(t.n_pairs for t in tasks)
    resumed = len(parts.facts)
    if resumed:
        log.info("resuming: %d of %d shards already counted", resumed, len(tasks))
    with tqdm(
        total=total_tokens,
        initial=total_tokens - sum(part.task.n_pairs for part in parts.todo),
        unit="tok",
        unit_scale=True,
        desc="count: map",
        disable=not progress,
    ) as bar:
        for part, _ in parts.run(count, executor):
            bar.update(part.task.n_pairs)
    return resumed


def task_parts(tasks: list) -> list[Part]:
    """The ledger's parts of `tasks`, each task's one work file (`task.out`)."""
    return [Part(work_part(task.out), (Path(task.out),), task) for task in tasks]


def run_reduce(
    executor, tasks: list, path: Path, progress: bool, results=None, *, stage
) -> tuple[int, int]:
    """Reduce the ranges the ledger does not hold and join all of them into `path`, in key
    order, while later ranges are still being reduced. Returns (distinct, total pairs);
    `results`, a dict, gets each range's result by its output path."""
    from tqdm import tqdm

    parts = StageParts(stage, task_parts(tasks))
    finished = {part.task.out for part in parts.all if part.name in parts.facts}
    if results is not None:
        results.update(
            {
                part.task.out: parts.facts[part.name]
                for part in parts.all
                if part.name in parts.facts
            }
        )

    def reduced_in_order(bar):
        next_index = 0

        def ready():
            nonlocal next_index
            while next_index < len(tasks) and tasks[next_index].out in finished:
                next_index += 1
                yield tasks[next_index - 1].out

        yield from ready()
        for part, result in parts.run(reduce.reduce_range, executor):
            if results is not None:
                results[part.task.out] = result
            finished.add(part.task.out)
            bar.update(1)
            yield from ready()
        yield from ready()

    with tqdm(
        total=len(tasks),
        initial=len(finished),
        unit="range",
        desc="count: reduce",
        disable=not progress,
    ) as bar:
        return write_bigrams(path, reduced_in_order(bar))


def pair_ranges(stores, size: int) -> Iterator[tuple[int, int, dict]]:
    """Every store of the concatenation cut into ranges of at most `size` pairs, in order, as
    (store index, range index, the fields of a task over the range: the store's file, dtype and
    length, pairs start..stop-1 and the store's offset in the stream). Consecutive ranges
    overlap by one token, so no pair is lost."""
    offset = 0
    for s, store in enumerate(stores):
        n_pairs = max(store.n_tokens - 1, 0)
        for k, start in enumerate(range(0, n_pairs, size)):
            yield (
                s,
                k,
                {
                    "tokens_path": str((store.path / TOKENS_NAME).resolve()),
                    "dtype": store.dtype.name,
                    "n_tokens": store.n_tokens,
                    "start": start,
                    "stop": min(start + size, n_pairs),
                    "stream_offset": offset,
                },
            )
        offset += store.n_tokens


def plan_map_tasks(
    stores, work: Path, row: int | None, shard_tokens: int, shift: int, vocab_size: int
):
    """One MapTask per shard of every store (`pair_ranges`)."""
    return [
        MapTask(
            **pairs,
            row=row,
            shift=shift,
            vocab_size=vocab_size,
            out=str(work / COUNT_PARTIALS_DIR / f"s{s:04d}-{k:06d}.bin"),
        )
        for s, k, pairs in pair_ranges(stores, shard_tokens)
    ]


def boundary_keys(stores, row: int | None, shift: int) -> np.ndarray:
    """Keys of the pairs that span two consecutive (non-empty) stores of the concatenation."""
    pairs, offset, last = [], 0, None
    for store in stores:
        if store.n_tokens:
            if last is not None and (row is None or offset % row != 0):
                pairs.append((last, int(store.tokens[0])))
            last = int(store.tokens[-1])
        offset += store.n_tokens
    kd = key_dtype_for(shift)
    return np.array([(p << shift) | n for p, n in pairs], dtype=kd)


def boundary_partial(work: Path, edge: np.ndarray, shift: int, vocab_size: int, *, stage) -> str:
    """The partial of the pairs across stores (written once; a resumed run finds it)."""
    edge_out = work / COUNT_PARTIALS_DIR / "boundaries.bin"
    if stage.done(work_part(edge_out)) is None:
        keys, counts = count_keys(edge)
        offsets = np.append(
            np.searchsorted(keys, bucket_bounds(shift, vocab_size).astype(keys.dtype)),
            keys.size,
        )
        write_partial(edge_out, keys, counts, offsets.astype(np.int64))
        stage.record(work_part(edge_out), [edge_out])
    return str(edge_out)


def stream_pairs(stores, row: int | None) -> int:
    """Pairs of the concatenated stream in the unit: N - 1, less those ending a row of `row`."""
    n = max(sum(s.n_tokens for s in stores) - 1, 0)
    return n - (n // row if row else 0)


def count_full(stage, stores, work, row, shard_tokens, shift, executor, progress) -> dict:
    """Map every shard, reduce every `prev` range, join the parts into bigrams.parquet."""
    import time

    vocab_size = max(s.vocab_size for s in stores)
    tasks = plan_map_tasks(stores, work, row, shard_tokens, shift, vocab_size)
    t_map = time.time()
    resumed = run_map(executor, tasks, count_shard, progress, stage=stage)
    t_map = time.time() - t_map

    partials = [t.out for t in tasks]
    edge = boundary_keys(stores, row, shift)
    if edge.size:
        partials.append(boundary_partial(work, edge, shift, vocab_size, stage=stage))

    t_reduce = time.time()
    reduce_tasks = plan_reduce_tasks(work, partials, shift, stage=stage)
    distinct, total_pairs = run_reduce(
        executor, reduce_tasks, work.parent / BIGRAMS_NAME, progress, stage=stage
    )
    return {
        "distinct": distinct,
        "total_pairs": total_pairs,
        "counts": {
            "shards": len(tasks),
            "shards_resumed": resumed,
            "reduce_ranges": len(reduce_tasks),
        },
        "times": {"map_s": t_map, "reduce_and_write_s": time.time() - t_reduce},
    }
