"""Running a count's tasks on an executor: the map step, the reduce ranges, their join."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ar_slicing.counts import reduce
from ar_slicing.counts.parquet import write_bigrams
from ar_slicing.counts.partials import bucket_sizes

log = logging.getLogger(__name__)


def plan_reduce_tasks(work: Path, partials: list[str], shift: int) -> list[reduce.ReduceTask]:
    """Ranges of fine buckets of about REDUCE_RANGE_ENTRIES partial entries, one task each.

    A fixed size, not a fraction of the total, so a reduce task's memory does not grow with the
    corpus: more data means more ranges, not bigger ones. The ranges are kept in `work`, so a
    resumed run reduces the same ranges.
    """
    from ar_slicing.io import read_json, write_json_atomic

    ranges_path = work / "reduced" / "ranges.json"
    if ranges_path.exists():
        ranges = [tuple(r) for r in read_json(ranges_path)["ranges"]]
    else:
        sizes = sum(bucket_sizes(p) for p in partials) if partials else np.zeros(1, dtype=np.int64)
        ranges = reduce.plan_ranges(np.asarray(sizes), reduce.REDUCE_RANGE_ENTRIES)
        write_json_atomic(ranges_path, {"ranges": ranges})
    return [
        reduce.ReduceTask(
            partials=tuple(partials),
            b_lo=lo,
            b_hi=hi,
            out=str(work / "reduced" / f"r{j:05d}.parquet"),
            shift=shift,
            batch_entries=reduce.REDUCE_RANGE_ENTRIES,
        )
        for j, (lo, hi) in enumerate(ranges)
    ]


def run_map(executor, tasks: list, count, progress: bool) -> int:
    """`count` every task whose partial is not there yet. Returns how many were there."""
    from tqdm import tqdm

    todo = [t for t in tasks if not Path(t.out).is_file()]
    total_tokens = sum(t.n_pairs for t in tasks)
    resumed = len(tasks) - len(todo)
    if resumed:
        log.info("resuming: %d of %d shards already counted", resumed, len(tasks))
    with tqdm(
        total=total_tokens,
        initial=total_tokens - sum(t.n_pairs for t in todo),
        unit="tok",
        unit_scale=True,
        desc="count: map",
        disable=not progress,
    ) as bar:
        for task, _ in executor.map_unordered(count, todo):
            bar.update(task.n_pairs)
    return resumed


def run_reduce(executor, tasks: list, path: Path, progress: bool, results=None) -> tuple[int, int]:
    """Reduce the ranges not reduced yet and join all of them into `path`, in key order, while
    later ranges are still being reduced. Returns (distinct, total pairs); `results`, a dict,
    gets each reduced task's result by its output path."""
    from tqdm import tqdm

    pending = [t for t in tasks if not Path(t.out).exists()]
    finished = {t.out for t in tasks} - {t.out for t in pending}

    def reduced_in_order(bar):
        next_index = 0

        def ready():
            nonlocal next_index
            while next_index < len(tasks) and tasks[next_index].out in finished:
                next_index += 1
                yield tasks[next_index - 1].out

        yield from ready()
        for task, result in executor.map_unordered(reduce.reduce_range, pending):
            if results is not None:
                results[task.out] = result
            finished.add(task.out)
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
