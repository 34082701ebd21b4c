"""`arslice count --import`: published bigram counts (Parquet id0, id1, count) -> a counts directory.

The files are mapped into partials (`ar_slicing.algorithms.counts.imported`) and reduced as a count's are,
so `bigrams.parquet` is sorted and written like any count's; the result is refused, and
bigrams.parquet removed, when two files list the same pair. `meta.json` names the files (with
their sha256), the tokenizer's fingerprint and the unit the counts were made in, as stated.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ar_slicing.algorithms.counts.keys import parse_unit
from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import BIGRAMS_NAME

log = logging.getLogger(__name__)

IMPORT_FORMAT = 1  # bump when the import's work files change


def check_import(paths, tokenizer: str | None, unit: str | None) -> None:
    """Refuse an import without its tokenizer and stated unit, or of missing files."""
    if tokenizer is None or unit is None:
        raise BadInput(
            "count --import needs --tokenizer (the tokenizer the counts were made with) and "
            "--unit (the unit they were counted in, e.g. row:2048 for Confirm-Labs/pile_bigrams)"
        )
    parse_unit(unit)
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise BadInput(f"--import {missing[0]}: no such file")


def import_settings(unit: str | None, tokenizer_fingerprint: str | None = None) -> dict:
    """What decides an import's bytes besides the files."""
    return {"unit": unit, "import_format": IMPORT_FORMAT, "tokenizer": tokenizer_fingerprint}


def import_counts(
    paths,
    out: str | Path,
    *,
    tokenizer: str | None,
    unit: str | None,
    workers: int = 1,
    overwrite: bool = False,
    config: dict | None = None,
    executor=None,
    progress: bool = True,
    label: str | None = None,
    summary=None,
) -> dict:
    """Published counts (Parquet files of id0, id1, count) -> a counts directory, checked.
    `label`: a complete output's skip is said under it (else only logged); `summary(meta)`: the
    line said when an import ends (as `pipeline.count.count_stores` takes them)."""
    import time

    from ar_slicing.data.tokenizer import describe, load_tokenizer
    from ar_slicing.machinery.executor import LocalExecutor
    from ar_slicing.machinery.plan import StagePlan, file_identity
    from pipeline.count_work import count_finished, pairs_detail
    from pipeline.stage import run_stage

    t0 = time.time()
    check_import(paths, tokenizer, unit)
    info = describe(load_tokenizer(tokenizer), tokenizer)
    plan = StagePlan(
        "count",
        settings=import_settings(unit, info["fingerprint"]),
        inputs={"import": [{"path": str(Path(p).resolve()), **file_identity(p)} for p in paths]},
    )
    return run_stage(
        label or "count",
        out,
        plan,
        lambda stage, pool: count_finished(
            _import_into(stage, pool, paths, info, unit, config, progress, t0), summary
        ),
        overwrite=overwrite,
        prepare=lambda: executor or LocalExecutor(workers),
        detail=pairs_detail,
        quiet=label is None,
    )


def _import_into(stage, pool, paths, info, unit, config, progress, t0) -> dict:
    """Map the files into partials, reduce them into bigrams.parquet (refusing a pair listed
    twice); the facts meta.json records (finishing drops the work folder)."""
    import time

    from ar_slicing.algorithms.counts.imported import find_duplicate, import_part, plan_import_tasks
    from ar_slicing.algorithms.counts.partials import bucket_sizes
    from ar_slicing.machinery.io import build_meta, sha256_file
    from pipeline.count_work import (
        make_work_dir,
        plan_reduce_tasks,
        run_map,
        run_reduce,
    )

    out = stage.out
    vocab_size = int(info["vocab_size"])
    shift = 16 if vocab_size <= 1 << 16 else 32
    sources = [
        {
            "path": str(Path(p).resolve()),
            "bytes": Path(p).stat().st_size,
            "sha256": sha256_file(p),
        }
        for p in paths
    ]
    work = make_work_dir(out)
    stage.expect([out / BIGRAMS_NAME])
    tasks = plan_import_tasks(paths, work, vocab_size, shift)
    run_map(pool, tasks, import_part, progress, stage=stage)
    reduce_tasks = plan_reduce_tasks(work, [t.out for t in tasks], shift, stage=stage)
    results: dict = {}
    distinct, total_pairs = run_reduce(
        pool, reduce_tasks, out / BIGRAMS_NAME, progress, results, stage=stage
    )
    entries = sum(int(bucket_sizes(t.out).sum()) for t in tasks)
    if entries != distinct:  # the reduce added up a pair that two tasks listed
        (out / BIGRAMS_NAME).unlink(missing_ok=True)
        sizes = sum(bucket_sizes(t.out) for t in tasks)
        bad = next(
            (
                t
                for t in reduce_tasks
                if t.out in results and results[t.out]["distinct"] < sizes[t.b_lo : t.b_hi].sum()
            ),
            None,
        )
        where = find_duplicate(tasks, bad.b_lo, bad.b_hi, shift) if bad else "pairs repeat"
        shutil.rmtree(work, ignore_errors=True)
        raise BadInput(f"--import: {where}; published counts must list each pair once")
    wall = time.time() - t0
    meta = build_meta(
        "count",
        config=config or {"import": list(map(str, paths)), "unit": unit},
        inputs={"import": sources, "tokenizer": info},
        counts={"files": len(paths), "import_tasks": len(tasks), "rows": entries},
        wall_time_s=wall,
        throughput={"rows_per_s": entries / max(wall, 1e-9)},
        fingerprint=info["fingerprint"],
        total_pairs=total_pairs,
        distinct_bigrams=distinct,
        unit=unit,
        imported={"format": "id0, id1, count", "files": sources, "tokenizer": info["name"]},
        sources=sources,
    )
    return meta
