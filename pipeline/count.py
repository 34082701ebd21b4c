"""`arslice count`: exact bigram counts of training token stores.

Reads one or more token stores (of one tokenizer) and writes into `--out`:
  bigrams.parquet   prev int32, next int32, count int64; sorted by (prev, next); row groups
  meta.json         fingerprint, total_pairs, distinct_bigrams, unit, sources (written last)

Stores given together are counted as their concatenation (the pair across two stores counts;
see `ar_slicing.algorithms.counts.keys` for what a unit counts). The work is shaped for a distributed
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
resumes from its finished shards and ranges under `--out/.work`. The tasks are planned by
`ar_slicing.algorithms.counts.tasks` and run by `pipeline.count_work`; `--only-bigrams-of` counts
only the evaluated stores' bigrams (`ar_slicing.algorithms.counts.restricted`), and `--import` reads published counts instead
(`pipeline.count_import`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import BIGRAMS_NAME, STORE_PARTS
from pipeline.config import (
    Command,
    config_to_dict,
    executor_option,
    ray_address_option,
)
from pipeline.stage import Finished, run_stage
from pipeline.wiring import COUNTS, STORES, Run, Table, Wiring

# 32 M tokens (~220 MB per map worker at most): fewer, fuller partials leave the reduce less
# to merge
DEFAULT_SHARD_TOKENS = 1 << 25


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
    executor: str = executor_option(
        "where map and reduce tasks run: local processes, or a Ray cluster (every node must "
        "see --tokens and --out under the same paths)"
    )
    ray_address: str | None = ray_address_option()


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
    from ar_slicing.data.store import TokenStore
    from ar_slicing.data.tokenizer import require_same_fingerprint

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
    from ar_slicing.data.store import TokenStore
    from ar_slicing.data.tokenizer import require_same_fingerprint

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


def count_plan(stores, unit: str, shard_tokens: int, evaluated=()):
    """The count's plan: its settings and the identities of the stores it reads."""
    from ar_slicing.machinery.plan import StagePlan, identity

    inputs = {"stores": [identity(s.path) for s in stores]}
    if evaluated:
        inputs["only_bigrams_of"] = [identity(s.path) for s in evaluated]
    return StagePlan(
        "count",
        settings=count_settings(unit, shard_tokens, [s.path for s in evaluated]),
        inputs=inputs,
    )


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
    progress: bool = True,
    only_bigrams_of=None,
    make_executor=None,
    label: str | None = None,
    summary=None,
) -> dict:
    """Count the bigrams of the concatenation of `store_paths` into `out`. Returns its meta.json.

    With `only_bigrams_of` (store paths), only the bigrams occurring in those stores are
    counted (`ar_slicing.algorithms.counts.restricted`). Resumable: partials of finished shards (and
    finished reduce ranges) under `out/.work` are reused by a rerun with the same inputs and
    settings. `make_executor()`: the executor, made only when there is counting to do (a
    Ray cluster is not started for a count that is skipped); local processes by default. `label`: a complete output's skip is said under it (else
    only logged); `summary(meta)`: the line said when a count ends.
    """
    import time

    from ar_slicing.algorithms.counts.keys import parse_unit
    from pipeline.count_work import count_finished, pairs_detail

    t0 = time.time()
    row = parse_unit(unit)
    _check_shard_tokens(shard_tokens)
    stores = open_stores(store_paths)
    evaluated = open_evaluated(only_bigrams_of, stores)

    def count(stage, executor) -> Finished:
        meta = _count(
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
        return count_finished(meta, summary)

    return run_stage(
        label or "count",
        out,
        count_plan(stores, unit, shard_tokens, evaluated),
        count,
        overwrite=overwrite,
        prepare=make_executor,
        detail=pairs_detail,
        quiet=label is None,
    )


def _check_shard_tokens(shard_tokens: int) -> None:
    if shard_tokens < 2 or shard_tokens >= 1 << 32:
        raise BadInput(f"--shard-tokens {shard_tokens}: must be between 2 and 2**32 - 1")


def _count(
    stage, stores, evaluated, row, unit, shard_tokens, workers, config, executor, progress, t0
):
    import time

    from ar_slicing.algorithms.counts.kernels import warm_kernels
    from ar_slicing.algorithms.counts.keys import key_shift_for
    from ar_slicing.algorithms.counts.tasks import stream_pairs
    from ar_slicing.machinery.executor import LocalExecutor
    from ar_slicing.machinery.io import build_meta
    from pipeline.count_work import count_full, count_restricted_stores, make_work_dir

    out = stage.out
    shift = max(key_shift_for(s.dtype) for s in stores + evaluated)
    sources = [store_record(s) for s in stores]
    work = make_work_dir(out)  # partials kept by an unfinished run of the same plan, else new
    stage.expect([out / BIGRAMS_NAME])

    warm_kernels()
    import pyarrow.parquet  # noqa: F401  (here, so forked reduce workers inherit it loaded)

    executor = executor or LocalExecutor(workers)
    args = (stage, stores, work, row, shard_tokens, shift, executor, progress)
    restriction = {}
    if evaluated:
        from ar_slicing.algorithms.counts.restricted import restriction_of

        restriction = {"only_bigrams_of": [restriction_of(s) for s in evaluated]}
        done = count_restricted_stores(*args, evaluated=evaluated, groups=workers)
    else:
        done = count_full(*args)
    if row is None and not evaluated and done["total_pairs"] != stream_pairs(stores, row):
        raise RuntimeError(  # the stream unit counts every pair exactly once
            f"count: {done['total_pairs']} pairs written but the stream has "
            f"{stream_pairs(stores, row)}"
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
    return meta  # (finishing drops the work folder)


# ---- the command -------------------------------------------------------------------------------


def validate_count(cfg: CountConfig) -> None:
    from ar_slicing.algorithms.counts.keys import parse_unit

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


def count_inputs(cfg: CountConfig) -> list[tuple[str, str]]:
    return [
        *(("--tokens", t) for t in cfg.tokens or ()),
        *(("--only-bigrams-of", t) for t in cfg.only_bigrams_of or ()),
        *(("--import", t) for t in cfg.import_parquet or ()),
    ]


def _plan_settings(cfg: CountConfig) -> dict:
    if cfg.import_parquet:
        from pipeline.count_import import import_settings

        return import_settings(cfg.unit)
    return count_settings(cfg.unit or "stream", cfg.shard_tokens, cfg.only_bigrams_of)


def run_count(cfg: CountConfig) -> dict:
    from ar_slicing.machinery.executor import default_workers, get_executor

    validate_count(cfg)
    if cfg.import_parquet:
        return _run_import(cfg)
    make_executor = None
    if cfg.executor != "local":  # (made only when there is counting to do)

        def make_executor():
            return get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)

    def summary(meta: dict) -> str:
        rate = meta.get("throughput", {}).get("tokens_per_s")
        only = (
            f", only those of {len(meta['only_bigrams_of'])} evaluated store(s) "
            f"({meta['evaluated_bigrams_unseen']:,} of their {meta['evaluated_bigrams']:,} "
            "never seen)"
            if meta.get("only_bigrams_of")
            else ""
        )
        timing = f" ({meta['wall_time_s']:.1f} s, {rate / 1e6:.1f} M tokens/s)" if rate else ""
        return f"{_totals(meta)} from {len(meta['sources'])} store(s){only} -> {cfg.out}{timing}"

    return count_stores(
        list(cfg.tokens),
        cfg.out,
        unit=cfg.unit or "stream",
        workers=cfg.workers if cfg.workers > 0 else default_workers(),  # (the executor's, if given)
        shard_tokens=cfg.shard_tokens,
        overwrite=cfg.overwrite,
        config=config_to_dict(cfg),
        make_executor=make_executor,
        only_bigrams_of=list(cfg.only_bigrams_of or []),
        label="count",
        summary=summary,
    )


def _run_import(cfg: CountConfig) -> dict:
    from ar_slicing.machinery.executor import default_workers, get_executor
    from pipeline.count_import import import_counts

    executor = None
    if cfg.executor != "local":
        executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    return import_counts(
        list(cfg.import_parquet),
        cfg.out,
        tokenizer=cfg.tokenizer,
        unit=cfg.unit,
        workers=cfg.workers if cfg.workers > 0 else default_workers(),
        overwrite=cfg.overwrite,
        config=config_to_dict(cfg),
        executor=executor,
        label="count",
        summary=lambda meta: (
            f"{_totals(meta)} imported from {len(meta['sources'])} file(s) -> {cfg.out}"
        ),
    )


def _totals(meta: dict) -> str:
    """The head of a count's (or an import's) summary line: what its bigrams.parquet holds."""
    return (
        f"count: {meta['total_pairs']:,} pairs, {meta['distinct_bigrams']:,} distinct bigrams "
        f"(unit {meta['unit']})"
    )


def _defaults(run: Run, table: Table) -> dict:
    """The run's training store; `only_bigrams_of = ["val"]` names its validation store."""
    if table.values.get("only_bigrams_of"):
        table.values["only_bigrams_of"] = [
            str(run.layout.store(s)) if s in STORE_PARTS else s
            for s in table.values["only_bigrams_of"]
        ]
    return {"tokens": [run.layout.store("train")], "out": run.layout.counts}


COMMAND = Command(
    CountConfig,
    run_count,
    validate=validate_count,
    plan_settings=_plan_settings,
    inputs=count_inputs,
    summary="exact training bigram counts of token stores",
    examples="""\
  arslice count --tokens runs/pile/tokens/train --out runs/pile/counts
  arslice count --tokens runs/pile/tokens/train-00 runs/pile/tokens/train-01 --out runs/pile/counts
  arslice count --tokens runs/pile/tokens/train --only-bigrams-of runs/pile/tokens/val --out runs/pile/counts
  arslice count --tokens runs/pythia/tokens/train --unit row:2049 --workers 16 --out runs/pythia/counts
  arslice count --import pile_bigrams/*.parquet --tokenizer EleutherAI/gpt-neox-20b --unit row:2048 --out runs/pythia/counts  # needs the hub
  arslice count --tokens /shared/pile/tokens/train --out /shared/pile/counts --executor ray --ray-address auto  # needs a Ray cluster""",
    pipeline=Wiring(table="count", reads=(STORES,), writes=COUNTS, defaults=_defaults),
)


def store_record(store) -> dict:
    """How counts' meta.json names a training store it counted (tag reads the stores back from
    these records to count span n-grams)."""
    return {
        "path": str(store.path.resolve()),
        "fingerprint": store.fingerprint,
        "n_tokens": store.n_tokens,
        "dtype": store.dtype.name,
    }
