"""`[train] side_by_side = N` of a pipeline config: its models trained N at a time, one process
each (the train stage's way of running the configs of its `[train.models.<name>]` tables). The
processes start with torch's CPU kernels pinned (`models.cpu_kernels`), so a run's models are
trained in one of them even one at a time, unless the run's own process is pinned already: the
stages that evaluate keep the CPU's fastest code."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ar_slicing.errors import BadInput
from pipeline.config import Command, print_summaries, say, summaries_printed

SIDE_BY_SIDE_KEY = "side_by_side"  # a key of the pipeline's [train] table, not of the stage


def _train_worker(counter, speak: bool) -> None:
    """Worker initializer: pin torch's CPU kernels (before anything loads torch here), give this
    process's progress bars their own terminal line, and print its summaries when the command
    that started it prints its own."""
    import os

    from models import cpu_kernels

    cpu_kernels.pin()
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

    from ar_slicing.machinery.executor import process_pool

    ctx = get_context("spawn")  # a fresh interpreter: no torch loaded, no thread pool inherited
    counter = ctx.Value("i", 0)
    at_once = f"{workers} side by side" if workers > 1 else "one at a time"
    say(f"train: {len(configs)} models, {at_once}, in processes with pinned CPU kernels")
    with process_pool(workers, ctx, _train_worker, (counter, summaries_printed())) as pool:
        futures = [pool.submit(command.run, cfg) for cfg in configs.values()]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def run_models(command: Command, configs: Mapping[str, Any], table: Mapping, where: str) -> None:
    """Train every model of the pipeline: one after another, or `side_by_side` at a time."""
    n = table.get(SIDE_BY_SIDE_KEY, 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadInput(f"{where}: {SIDE_BY_SIDE_KEY} = {n!r}; use a whole number >= 1")
    from models import cpu_kernels

    workers = min(n, len(configs))
    if workers > 1 or not cpu_kernels.is_pinned():
        train_side_by_side(command, configs, workers)
    else:
        for cfg in configs.values():
            command.run(cfg)
