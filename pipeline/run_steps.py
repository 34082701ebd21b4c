"""The pipeline's own steps that are not a stage command: models trained side by side (one
process each) and a pretrained tokenizer copied into the run under the stage plan."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.io import atomic_path, build_meta
from pipeline.config import (
    Command,
    print_summaries,
    say,
    summaries_printed,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainedTokenizer:
    """The `[tokenizer] pretrained = NAME` table: copy an existing tokenizer to `out`."""

    pretrained: str
    out: str


def _train_worker(counter, speak: bool) -> None:
    """Worker initializer: give this process's progress bars their own terminal line, and
    print its summaries when the command that started it prints its own."""
    import os

    if speak:
        print_summaries()
    with counter.get_lock():
        os.environ["TQDM_POSITION"] = str(counter.value)  # read by tqdm >= 4.66 as a default
        counter.value += 1


def train_side_by_side(command: Command, configs: Mapping[str, Any], workers: int) -> None:
    """Train the models in `workers` processes at once (each with its config's `threads`).

    Models are independent (each its own output directory, batch order and seed), so this
    changes only the wall time; a worker's error is raised here once the others have finished.
    """
    from multiprocessing import get_context

    from ar_slicing.executor import process_pool

    ctx = get_context("spawn")  # a fresh interpreter: no torch thread pool inherited via fork
    counter = ctx.Value("i", 0)
    say(f"train: {len(configs)} models, {workers} side by side")
    with process_pool(workers, ctx, _train_worker, (counter, summaries_printed())) as pool:
        futures = [pool.submit(command.run, cfg) for cfg in configs.values()]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def copy_pretrained_tokenizer(cfg: PretrainedTokenizer, overwrite: bool = False) -> dict:
    """Copy the tokenizer `cfg.pretrained` (a file, directory or hub name) to `cfg.out`, under
    the same stage plan as every other output (same name and fingerprint: skipped)."""
    from ar_slicing.plan import StagePlan, open_stage
    from ar_slicing.tokenizer import describe, load_tokenizer

    tok = load_tokenizer(cfg.pretrained)
    info = describe(tok, cfg.pretrained)
    plan = StagePlan(
        "tokenizer",
        settings={"pretrained": cfg.pretrained},
        inputs={"fingerprint": info["fingerprint"]},
    )
    out = Path(cfg.out)
    stage = open_stage(out, plan, overwrite=overwrite, single_file=True)
    if stage.complete:
        say(f"tokenizer: {out} is complete; pass --overwrite to copy it again")
        stage.skip()
        return {"tokenizer": str(out), "skipped": True}
    with stage.running():
        with atomic_path(out) as tmp:
            tok.save(str(tmp))
        stage.finish(
            build_meta(
                "tokenizer", config=cfg, inputs=plan.inputs, counts={}, wall_time_s=0, **info
            )
        )
    say(f"tokenizer: copied {cfg.pretrained} ({info['vocab_size']} tokens) to {out}")
    return {"tokenizer": str(out), **info}
