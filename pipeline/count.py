"""`arslice count`: exact bigram counts of training token stores.

Reads one or more token stores (of one tokenizer) and writes into `--out`:
  bigrams.parquet   prev int32, next int32, count int64; sorted by (prev, next); row groups
  meta.json         fingerprint, total_pairs, distinct_bigrams, unit, sources (written last)

Stores given together are counted as their concatenation (the pair across two stores counts).
The work is a map step per shard and a reduce step per range of `prev` (see
`ar_slicing.counts`); an interrupted run resumes from its finished shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ar_slicing.counts import DEFAULT_SHARD_TOKENS
from pipeline.config import Command, config_to_dict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CountConfig:
    tokens: list[str] = field(
        metadata={"help": "training token store directories, counted as their concatenation"}
    )
    out: str = field(metadata={"help": "output directory for bigrams.parquet and meta.json"})
    unit: str = field(
        default="stream",
        metadata={
            "help": "'stream': every adjacent pair of the EOS-joined stream; 'row:N': only pairs "
            "inside consecutive rows of N tokens (Pythia: row:2049)"
        },
    )
    workers: int = field(default=0, metadata={"help": "worker processes (0 = all cores)"})
    shard_tokens: int = field(
        default=DEFAULT_SHARD_TOKENS,
        metadata={
            "help": "tokens per map shard: resume granularity; up to ~7 bytes of memory each"
        },
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
    ray_address: str | None = field(
        default=None,
        metadata={"help": "Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"},
    )


def run_count(cfg: CountConfig) -> dict:
    from ar_slicing.counts import count_stores
    from ar_slicing.executor import default_workers, get_executor
    from ar_slicing.io import is_complete

    was_complete = is_complete(cfg.out) and not cfg.overwrite
    executor = None
    if cfg.executor != "local" and not was_complete:
        executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    workers = cfg.workers if cfg.workers > 0 else default_workers()  # (the executor's, if given)
    meta = count_stores(
        list(cfg.tokens),
        cfg.out,
        unit=cfg.unit,
        workers=workers,
        shard_tokens=cfg.shard_tokens,
        overwrite=cfg.overwrite,
        config=config_to_dict(cfg),
        executor=executor,
    )
    if was_complete:
        print(f"count: {cfg.out} is complete ({meta['total_pairs']:,} pairs); --overwrite to redo")
        return meta
    rate = meta.get("throughput", {}).get("tokens_per_s")
    print(
        f"count: {meta['total_pairs']:,} pairs, {meta['distinct_bigrams']:,} distinct bigrams "
        f"(unit {meta['unit']}) from {len(meta['sources'])} store(s) -> {cfg.out}"
        + (f" ({meta['wall_time_s']:.1f} s, {rate / 1e6:.1f} M tokens/s)" if rate else "")
    )
    return meta


COMMAND = Command(
    CountConfig,
    run_count,
    summary="exact training bigram counts of token stores",
    examples="""\
  arslice count --tokens runs/pile/tokens/train --out runs/pile/counts
  arslice count --tokens runs/pile/tokens/train-00 runs/pile/tokens/train-01 --out runs/pile/counts
  arslice count --tokens runs/pythia/tokens/train --unit row:2049 --workers 16 --out runs/pythia/counts
  arslice count --tokens /shared/pile/tokens/train --out /shared/pile/counts --executor ray --ray-address auto""",
)
