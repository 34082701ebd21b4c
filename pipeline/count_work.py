"""A count's work inside its stage (`pipeline.count`): the tasks of `ar_slicing.algorithms.counts`
run on an executor, the map shards, the reduce ranges and their join into bigrams.parquet, or a
restricted count's groups.

Every file of the work (`OUT/.work/`) is a part of the count's ledger (`ar_slicing.machinery.plan`):
a task's file is kept by a resumed run when the ledger records it whole, and the driver records
each as its task returns (`StageParts`; the workers only write files).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts import reduce
from ar_slicing.algorithms.counts.keys import bucket_bounds, count_keys
from ar_slicing.algorithms.counts.parquet import write_bigrams
from ar_slicing.algorithms.counts.partials import bucket_sizes, count_shard, write_partial
from ar_slicing.algorithms.counts.tasks import (
    boundary_keys,
    pair_ranges,
    plan_map_tasks,
    stream_pairs,
)
from ar_slicing.machinery.layout import (
    BIGRAMS_NAME,
    COUNT_PARTIALS_DIR,
    COUNT_REDUCED_DIR,
    COUNT_WORK_DIR,
)
from ar_slicing.machinery.plan.stage_parts import Part, StageParts
from pipeline.stage import Finished

log = logging.getLogger(__name__)

REDUCED_PART = "r{:05d}.parquet"  # in COUNT_REDUCED_DIR: the Parquet part of reduce range j


def pairs_detail(meta: dict) -> str:
    """What a complete count (or import) holds, for the line that says it is skipped."""
    return f"{meta['total_pairs']:,} pairs"


def count_finished(meta: dict, summary) -> Finished:
    """A count's (or an import's) end, for the runner: the facts its meta.json records and, when
    the caller gave `summary(meta)`, that line."""
    return Finished(meta, [summary(meta)] if summary is not None else [])


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


def count_restricted_stores(
    stage, stores, work, row, shard_tokens, shift, executor, progress, *, evaluated, groups: int
) -> dict:
    """Count only the bigrams of the `evaluated` stores: their key set, then about `groups`
    tasks of consecutive training pairs counted into dense partials over it, summed into the
    rows. A partial's name says which pairs it counted, so a rerun with other groups (other
    workers) never adds up partials of two groupings."""
    import time

    from ar_slicing.algorithms.counts.parquet import write_bigrams_batches
    from ar_slicing.algorithms.counts.restricted import (
        RestrictedTask,
        count_restricted,
        key_counts,
        key_set,
        read_keys,
        restricted_rows,
        write_keys,
    )

    t_keys = time.time()
    keys_path = work / "only-keys.bin"
    if stage.done(work_part(keys_path)) is None:
        write_keys(keys_path, key_set(evaluated, shift, shard_tokens))
        stage.record(work_part(keys_path), [keys_path])
    keys = read_keys(keys_path, shift)
    t_keys = time.time() - t_keys

    total = max(sum(s.n_tokens - 1 for s in stores if s.n_tokens), 1)
    group_pairs = max(shard_tokens, -(-total // max(groups, 1)))
    tasks = []
    for s, _k, pairs in pair_ranges(stores, group_pairs):
        name = f"g{s:04d}-{pairs['start']:012d}-{pairs['stop']:012d}.bin"
        tasks.append(
            RestrictedTask(
                **pairs,
                row=row,
                shift=shift,
                shard_tokens=shard_tokens,
                keys=str(keys_path),
                out=str(work / COUNT_PARTIALS_DIR / name),
            )
        )
    t_map = time.time()
    resumed = run_map(executor, tasks, count_restricted, progress, stage=stage)
    t_map = time.time() - t_map

    t_reduce = time.time()
    extra = key_counts(keys, boundary_keys(stores, row, shift))
    part = work / COUNT_REDUCED_DIR / REDUCED_PART.format(0)
    rows = restricted_rows(keys, [t.out for t in tasks], extra)
    write_bigrams_batches(part, rows, shift)
    distinct, total_pairs = write_bigrams(work.parent / BIGRAMS_NAME, [str(part)])
    return {
        "distinct": distinct,
        "total_pairs": total_pairs,
        "counts": {"groups": len(tasks), "groups_resumed": resumed},
        "times": {
            "key_set_s": t_keys,
            "map_s": t_map,
            "reduce_and_write_s": time.time() - t_reduce,
        },
        "meta": {
            # every pair of the training stream in the unit, counted or not
            "stream_pairs": stream_pairs(stores, row),
            "evaluated_bigrams": int(keys.size),
            "evaluated_bigrams_unseen": int(keys.size) - distinct,
        },
    }
