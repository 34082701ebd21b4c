"""`arslice count`: exact bigram counts of training token stores.

Reads one or more token stores (of one tokenizer) and writes into `--out`:
  bigrams.parquet   prev int32, next int32, count int64; sorted by (prev, next); row groups
  meta.json         fingerprint, total_pairs, distinct_bigrams, unit, sources (written last)

Stores given together are counted as their concatenation (the pair across two stores counts;
see `ar_slicing.counts.keys` for what a unit counts). The work is shaped for a distributed
engine: every task is a picklable function of plain arguments that reads and writes files, so
results may arrive in any order:

  map     `count_shard(MapTask)`: one shard of one store -> a partial counts file: the shard's
          distinct pairs, sorted, their counts, and where each fine `prev` bucket starts.
  reduce  `reduce_range(ReduceTask)`: the slices of one range of `prev` values out of every
          partial, merged in bounded memory -> that range of bigrams.parquet, as a Parquet part.
  write   `write_bigrams(...)`: the parts, in order, -> `bigrams.parquet` (their row groups
          copied as they are, one footer listing them all).

Memory does not grow with the corpus: a map task holds one shard, a reduce task a bounded number
of partial entries, and the driver only file names and Parquet footers. An interrupted run
resumes from its finished shards and ranges under `--out/.work`.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.counts.keys import (
    bucket_bounds,
    count_keys,
    key_dtype_for,
    key_shift_for,
    parse_unit,
)
from ar_slicing.counts.parquet import BIGRAMS_NAME, write_bigrams
from ar_slicing.counts.partials import MapTask, count_shard, write_partial
from ar_slicing.counts.tasks import plan_reduce_tasks, run_map, run_reduce
from ar_slicing.errors import BadInput
from pipeline.config import Command, config_to_dict, ray_address_option

log = logging.getLogger(__name__)

# 32 M tokens (~220 MB per map worker at most): fewer, fuller partials leave the reduce less
# to merge
DEFAULT_SHARD_TOKENS = 1 << 25
WORK_NAME = ".work"  # partials and reduced ranges of an unfinished count (kept for resuming)


@dataclass(frozen=True)
class CountConfig:
    out: str = field(metadata={"help": "output directory for bigrams.parquet and meta.json"})
    tokens: list[str] = field(
        default_factory=list,
        metadata={"help": "training token store directories, counted as their concatenation"},
    )
    unit: str | None = field(
        default=None,
        metadata={
            "help": "'stream' (the default): every adjacent pair of the EOS-joined stream; "
            "'row:N': only pairs inside consecutive rows of N tokens (Pythia: row:2049); with "
            "--import, the unit the published counts were made in (it must be stated)"
        },
    )
    workers: int = field(default=0, metadata={"help": "worker processes (0 = all cores)"})
    shard_tokens: int = field(
        default=DEFAULT_SHARD_TOKENS,
        metadata={
            "help": "tokens per map shard: resume granularity; up to ~7 bytes of memory each"
        },
    )
    only_bigrams_of: list[str] | None = field(
        default=None,
        metadata={
            "help": "count only the bigrams that occur in these token stores (the evaluated, "
            "validation stores): memory and disk then scale with them, not with the training "
            "set; `tag` accepts such counts only for these stores"
        },
    )
    import_parquet: list[str] | None = field(
        default=None,
        metadata={
            "flag": "import",
            "help": "instead of counting, import published counts: Parquet files with columns "
            "id0, id1, count (e.g. Confirm-Labs/pile_bigrams); needs --tokenizer and --unit",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "with --import: the tokenizer the counts were made with (file or dir)"},
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output directory"})
    executor: str = field(
        default="local",
        metadata={
            "help": "where map and reduce tasks run: local processes, or a Ray cluster (every "
            "node must see --tokens and --out under the same paths)",
            "choices": ["local", "ray"],
        },
    )
    ray_address: str | None = ray_address_option()


# ---- planning the tasks ----------------------------------------------------------------------


def plan_map_tasks(
    stores, work: Path, row: int | None, shard_tokens: int, shift: int, vocab_size: int
):
    """One MapTask per shard of every store; shards overlap by one token so no pair is lost."""
    tasks = []
    offset = 0
    for s, store in enumerate(stores):
        n_pairs = max(store.n_tokens - 1, 0)
        for k, start in enumerate(range(0, n_pairs, shard_tokens)):
            tasks.append(
                MapTask(
                    tokens_path=str((store.path / "tokens.bin").resolve()),
                    dtype=store.dtype.name,
                    n_tokens=store.n_tokens,
                    start=start,
                    stop=min(start + shard_tokens, n_pairs),
                    stream_offset=offset,
                    row=row,
                    shift=shift,
                    vocab_size=vocab_size,
                    out=str(work / "partials" / f"s{s:04d}-{k:06d}.bin"),
                )
            )
        offset += store.n_tokens
    return tasks


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


# ---- the stage plan ----------------------------------------------------------------------------


PARTIALS_FORMAT = 2  # 2: reduced ranges are Parquet parts; bump when the work files change


def count_settings(unit: str, shard_tokens: int, only_bigrams_of=None) -> dict:
    """What decides the counts (and the resumable work files) besides the input stores."""
    settings = {"unit": unit, "shard_tokens": shard_tokens, "partials_format": PARTIALS_FORMAT}
    if only_bigrams_of:
        settings["only_bigrams_of"] = [str(p) for p in only_bigrams_of]
    return settings


def open_evaluated(paths, stores) -> list:
    """The evaluated stores of a restricted count, of the training stores' tokenizer."""
    from ar_slicing.store import TokenStore
    from ar_slicing.tokenizer import require_same_fingerprint

    evaluated = [TokenStore.open(p) for p in paths or ()]
    for store in evaluated:
        require_same_fingerprint(
            stores[0].fingerprint,
            f"token store {stores[0].path}",
            store.fingerprint,
            f"token store {store.path}",
        )
    return evaluated


def open_stores(store_paths) -> list:
    """The token stores to count, all of one tokenizer, with at least one pair among them."""
    from ar_slicing.store import TokenStore
    from ar_slicing.tokenizer import require_same_fingerprint

    if not store_paths:
        raise BadInput("count: no token stores given (--tokens STORE [STORE ...])")
    stores = [TokenStore.open(p) for p in store_paths]
    for store in stores[1:]:
        require_same_fingerprint(
            stores[0].fingerprint,
            f"token store {stores[0].path}",
            store.fingerprint,
            f"token store {store.path}",
        )
    if sum(s.n_tokens for s in stores) < 2:
        raise BadInput(
            f"count: the token store(s) {', '.join(str(s.path) for s in stores)} hold "
            f"{sum(s.n_tokens for s in stores)} token(s), so no bigram to count; tokenize a "
            "training set with at least one document"
        )
    return stores


def open_count_stage(stores, out, unit: str, shard_tokens: int, overwrite: bool, evaluated=()):
    from ar_slicing.plan import StagePlan, identity, open_stage

    inputs = {"stores": [identity(s.path) for s in stores]}
    if evaluated:
        inputs["only_bigrams_of"] = [identity(s.path) for s in evaluated]
    plan = StagePlan(
        "count",
        settings=count_settings(unit, shard_tokens, [s.path for s in evaluated]),
        inputs=inputs,
    )
    return open_stage(out, plan, overwrite=overwrite)


# ---- the whole count: plan, map, reduce, write -------------------------------------------------


def count_stores(
    store_paths,
    out: str | Path,
    *,
    unit: str = "stream",
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    config: dict | None = None,
    executor=None,
    progress: bool = True,
    only_bigrams_of=None,
) -> dict:
    """Count the bigrams of the concatenation of `store_paths` into `out`. Returns its meta.json.

    With `only_bigrams_of` (store paths), only the bigrams occurring in those stores are
    counted (`ar_slicing.counts.restricted`). Resumable: partials of finished shards (and
    finished reduce ranges) under `out/.work` are reused by a rerun with the same inputs and
    settings.
    """
    import time

    t0 = time.time()
    row = parse_unit(unit)
    _check_shard_tokens(shard_tokens)
    stores = open_stores(store_paths)
    evaluated = open_evaluated(only_bigrams_of, stores)
    stage = open_count_stage(stores, out, unit, shard_tokens, overwrite, evaluated)
    if stage.complete:
        meta = stage.skip()
        log.debug("%s is complete (%s pairs); --overwrite to redo", out, meta.get("total_pairs"))
        return meta
    with stage.running():
        return _count(
            stage,
            stores,
            evaluated,
            row,
            unit,
            shard_tokens,
            workers,
            config,
            executor,
            progress,
            t0,
        )


def _check_shard_tokens(shard_tokens: int) -> None:
    if shard_tokens < 2 or shard_tokens >= 1 << 32:
        raise BadInput(f"--shard-tokens {shard_tokens}: must be between 2 and 2**32 - 1")


def _count(
    stage, stores, evaluated, row, unit, shard_tokens, workers, config, executor, progress, t0
):
    import time

    from ar_slicing.counts.kernels import warm_kernels
    from ar_slicing.executor import LocalExecutor
    from ar_slicing.io import build_meta

    out = stage.out
    shift = max(key_shift_for(s.dtype) for s in stores + evaluated)
    sources = [
        {
            "path": str(s.path.resolve()),
            "fingerprint": s.fingerprint,
            "n_tokens": s.n_tokens,
            "dtype": s.dtype.name,
        }
        for s in stores
    ]
    work = out / WORK_NAME  # partials kept by an unfinished run of the same plan, else new
    (work / "partials").mkdir(parents=True, exist_ok=True)
    (work / "reduced").mkdir(parents=True, exist_ok=True)

    warm_kernels()
    import pyarrow.parquet  # noqa: F401  (here, so forked reduce workers inherit it loaded)

    executor = executor or LocalExecutor(workers)
    args = (stores, work, row, shard_tokens, shift, executor, progress)
    restriction = {}
    if evaluated:
        from ar_slicing.counts.restricted import restriction_of

        restriction = {"only_bigrams_of": [restriction_of(s) for s in evaluated]}
        done = _count_restricted(*args, evaluated=evaluated, groups=workers)
    else:
        done = _count_full(*args)
    if row is None and not evaluated and done["total_pairs"] != _stream_pairs(stores, row):
        raise RuntimeError(  # the stream unit counts every pair exactly once
            f"count: {done['total_pairs']} pairs written but the stream has "
            f"{_stream_pairs(stores, row)}"
        )
    wall = time.time() - t0
    n_tokens = sum(s.n_tokens for s in stores)
    meta = build_meta(
        "count",
        config=config
        or {"tokens": [str(s.path) for s in stores], "unit": unit, "shard_tokens": shard_tokens},
        inputs={"stores": sources, **restriction},
        counts={"tokens": n_tokens, **done["counts"]},
        wall_time_s=wall,
        throughput={"tokens_per_s": n_tokens / max(wall, 1e-9), **done["times"]},
        fingerprint=stores[0].fingerprint,
        total_pairs=done["total_pairs"],
        distinct_bigrams=done["distinct"],
        unit=unit,
        sources=sources,
        **restriction,
        **done.get("meta", {}),
    )
    meta = stage.finish(meta)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _stream_pairs(stores, row: int | None) -> int:
    """Pairs of the concatenated stream in the unit: N - 1, less those ending a row of `row`."""
    n = max(sum(s.n_tokens for s in stores) - 1, 0)
    return n - (n // row if row else 0)


def _count_full(stores, work, row, shard_tokens, shift, executor, progress) -> dict:
    """Map every shard, reduce every `prev` range, join the parts into bigrams.parquet."""
    import time

    vocab_size = max(s.vocab_size for s in stores)
    tasks = plan_map_tasks(stores, work, row, shard_tokens, shift, vocab_size)
    t_map = time.time()
    resumed = run_map(executor, tasks, count_shard, progress)
    t_map = time.time() - t_map

    partials = [t.out for t in tasks]
    edge = boundary_keys(stores, row, shift)
    if edge.size:
        partials.append(_boundary_partial(work, edge, shift, vocab_size))

    t_reduce = time.time()
    reduce_tasks = plan_reduce_tasks(work, partials, shift)
    distinct, total_pairs = run_reduce(executor, reduce_tasks, work.parent / BIGRAMS_NAME, progress)
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


def _count_restricted(
    stores, work, row, shard_tokens, shift, executor, progress, *, evaluated, groups: int
) -> dict:
    """Count only the bigrams of the `evaluated` stores: their key set, then about `groups`
    tasks of consecutive training pairs counted into dense partials over it, summed into the
    rows. A partial's name says which pairs it counted, so a rerun with other groups (other
    workers) never adds up partials of two groupings."""
    import time

    from ar_slicing.counts import restricted
    from ar_slicing.counts.parquet import write_bigrams_batches

    t_keys = time.time()
    keys_path = work / "only-keys.bin"
    if not keys_path.is_file():
        restricted.write_keys(keys_path, restricted.key_set(evaluated, shift, shard_tokens))
    keys = restricted.read_keys(keys_path, shift)
    t_keys = time.time() - t_keys

    total = max(sum(s.n_tokens - 1 for s in stores if s.n_tokens), 1)
    group_pairs = max(shard_tokens, -(-total // max(groups, 1)))
    tasks, offset = [], 0
    for s, store in enumerate(stores):
        for start in range(0, max(store.n_tokens - 1, 0), group_pairs):
            stop = min(start + group_pairs, store.n_tokens - 1)
            tasks.append(
                restricted.RestrictedTask(
                    tokens_path=str((store.path / "tokens.bin").resolve()),
                    dtype=store.dtype.name,
                    n_tokens=store.n_tokens,
                    start=start,
                    stop=stop,
                    stream_offset=offset,
                    row=row,
                    shift=shift,
                    shard_tokens=shard_tokens,
                    keys=str(keys_path),
                    out=str(work / "partials" / f"g{s:04d}-{start:012d}-{stop:012d}.bin"),
                )
            )
        offset += store.n_tokens
    t_map = time.time()
    resumed = run_map(executor, tasks, restricted.count_restricted, progress)
    t_map = time.time() - t_map

    t_reduce = time.time()
    extra = restricted.key_counts(keys, boundary_keys(stores, row, shift))
    part = work / "reduced" / "r00000.parquet"
    rows = restricted.restricted_rows(keys, [t.out for t in tasks], extra)
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
            "stream_pairs": _stream_pairs(stores, row),
            "evaluated_bigrams": int(keys.size),
            "evaluated_bigrams_unseen": int(keys.size) - distinct,
        },
    }


def _boundary_partial(work: Path, edge: np.ndarray, shift: int, vocab_size: int) -> str:
    """The partial of the pairs across stores (written once; a resumed run finds it)."""
    edge_out = work / "partials" / "boundaries.bin"
    if not edge_out.is_file():
        keys, counts = count_keys(edge)
        offsets = np.append(
            np.searchsorted(keys, bucket_bounds(shift, vocab_size).astype(keys.dtype)),
            keys.size,
        )
        write_partial(edge_out, keys, counts, offsets.astype(np.int64))
    return str(edge_out)


# ---- the command -------------------------------------------------------------------------------


def validate_count(cfg: CountConfig) -> None:
    _check_shard_tokens(cfg.shard_tokens)
    if cfg.workers < 0:
        raise BadInput(f"--workers must be >= 0 (0 = all cores), got {cfg.workers}")
    if cfg.import_parquet:
        from pipeline.count_import import check_import

        if cfg.tokens or cfg.only_bigrams_of:
            raise BadInput(
                "count: --import replaces counting: give no --tokens or --only-bigrams-of"
            )
        check_import(cfg.import_parquet, cfg.tokenizer, cfg.unit)
        return
    parse_unit(cfg.unit or "stream")
    if not cfg.tokens or any(not str(t).strip() for t in cfg.tokens):
        raise BadInput("count: --tokens needs one or more token store directories (not empty)")


def _plan_settings(cfg: CountConfig) -> dict:
    if cfg.import_parquet:
        from pipeline.count_import import import_settings

        return import_settings(cfg.unit)
    return count_settings(cfg.unit or "stream", cfg.shard_tokens, cfg.only_bigrams_of)


def run_count(cfg: CountConfig) -> dict:
    from ar_slicing.executor import default_workers, get_executor

    validate_count(cfg)
    if cfg.import_parquet:
        return _run_import(cfg)
    unit = cfg.unit or "stream"
    stores = open_stores(cfg.tokens)
    evaluated = open_evaluated(cfg.only_bigrams_of, stores)
    stage = open_count_stage(stores, cfg.out, unit, cfg.shard_tokens, cfg.overwrite, evaluated)
    if stage.complete:
        meta = stage.skip()
        print(f"count: {cfg.out} is complete ({meta['total_pairs']:,} pairs); --overwrite to redo")
        return meta
    executor = None
    if cfg.executor != "local":
        executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    workers = cfg.workers if cfg.workers > 0 else default_workers()  # (the executor's, if given)
    meta = count_stores(
        list(cfg.tokens),
        cfg.out,
        unit=unit,
        workers=workers,
        shard_tokens=cfg.shard_tokens,
        overwrite=cfg.overwrite,
        config=config_to_dict(cfg),
        executor=executor,
        only_bigrams_of=list(cfg.only_bigrams_of or []),
    )
    rate = meta.get("throughput", {}).get("tokens_per_s")
    only = (
        f", only those of {len(meta['only_bigrams_of'])} evaluated store(s) "
        f"({meta['evaluated_bigrams_unseen']:,} of their {meta['evaluated_bigrams']:,} never seen)"
        if meta.get("only_bigrams_of")
        else ""
    )
    print(
        f"count: {meta['total_pairs']:,} pairs, {meta['distinct_bigrams']:,} distinct bigrams "
        f"(unit {meta['unit']}) from {len(meta['sources'])} store(s){only} -> {cfg.out}"
        + (f" ({meta['wall_time_s']:.1f} s, {rate / 1e6:.1f} M tokens/s)" if rate else "")
    )
    return meta


def _run_import(cfg: CountConfig) -> dict:
    from ar_slicing.executor import default_workers, get_executor
    from pipeline.count_import import import_counts

    executor = None
    if cfg.executor != "local":
        executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    meta = import_counts(
        list(cfg.import_parquet),
        cfg.out,
        tokenizer=cfg.tokenizer,
        unit=cfg.unit,
        workers=cfg.workers if cfg.workers > 0 else default_workers(),
        overwrite=cfg.overwrite,
        config=config_to_dict(cfg),
        executor=executor,
    )
    print(
        f"count: {meta['total_pairs']:,} pairs, {meta['distinct_bigrams']:,} distinct bigrams "
        f"(unit {meta['unit']}) imported from {len(meta['sources'])} file(s) -> {cfg.out}"
    )
    return meta


COMMAND = Command(
    CountConfig,
    run_count,
    validate=validate_count,
    plan_settings=_plan_settings,
    summary="exact training bigram counts of token stores",
    examples="""\
  arslice count --tokens runs/pile/tokens/train --out runs/pile/counts
  arslice count --tokens runs/pile/tokens/train-00 runs/pile/tokens/train-01 --out runs/pile/counts
  arslice count --tokens runs/pile/tokens/train --only-bigrams-of runs/pile/tokens/val --out runs/pile/counts
  arslice count --tokens runs/pythia/tokens/train --unit row:2049 --workers 16 --out runs/pythia/counts
  arslice count --import pile_bigrams/*.parquet --tokenizer EleutherAI/gpt-neox-20b --unit row:2048 --out runs/pythia/counts
  arslice count --tokens /shared/pile/tokens/train --out /shared/pile/counts --executor ray --ray-address auto""",
)
