"""Executors for the map steps of the stages (one shard in, one file out).

Tasks are plain picklable callables with picklable arguments that write their own output files,
so the order results arrive in never matters: a stage's final output is assembled from the files.
`LocalExecutor` (a process pool; inline with one worker) is the default.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

log = logging.getLogger(__name__)


def process_pool(
    workers: int,
    mp_context: Any = None,
    initializer: Callable[..., Any] | None = None,
    initargs: tuple = (),
) -> ProcessPoolExecutor:
    """A `ProcessPoolExecutor` whose workers die with the process that made it. Every pool of
    the project is made here: a stage killed with SIGKILL would otherwise leave its workers
    blocked on the task queue for ever (the queue's other end stays open in each of them)."""
    return ProcessPoolExecutor(
        capped_workers(workers),
        mp_context=mp_context,
        initializer=_start_worker,
        initargs=(os.getpid(), initializer, initargs),
    )


# prctl(2): the signal the kernel sends this process when the thread that started it exits.
# (The thread, not the process: pools are used from the thread that makes them, which outlives
# them; ProcessPoolExecutor starts its workers from the submitting thread.)
_PR_SET_PDEATHSIG = 1


def _start_worker(parent: int, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not process_alive(parent):  # it died before the kernel knew to tell us
        os._exit(1)
    if initializer is not None:
        initializer(*initargs)


def process_alive(pid: int) -> bool:
    """True while the process `pid` exists (another user's included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_workers() -> int:
    return max(
        1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


_WARNED: set[int] = set()


def capped_workers(asked: int) -> int:
    """`asked` worker processes, at most one per CPU of this machine (more only take turns on
    them, each with its own memory); the first time a number is capped, a warning says so."""
    cpus = default_workers()
    if asked <= cpus:
        return asked
    if asked not in _WARNED:
        _WARNED.add(asked)
        log.warning(
            "--workers %d: this machine has %d CPU(s); running %d worker processes",
            asked,
            cpus,
            cpus,
        )
    return cpus


class LocalExecutor:
    """Runs `fn(task)` for each task on a local process pool, at most `workers` at a time (one
    per CPU at most, and never more processes than tasks)."""

    name = "local"

    def __init__(self, workers: int | None = None):
        self.workers = capped_workers(workers or default_workers())

    def map_unordered(
        self, fn: Callable[[Any], Any], tasks: Iterable[Any]
    ) -> Iterator[tuple[Any, Any]]:
        """Yield (task, fn(task)) as tasks finish. Keeps at most 2×workers tasks in flight."""
        tasks = iter(tasks)
        if self.workers <= 1:
            for task in tasks:
                yield task, fn(task)
            return
        first = list(itertools.islice(tasks, self.workers))
        if not first:
            return
        with process_pool(len(first)) as pool:  # (never more processes than tasks)
            pending = {pool.submit(fn, task): task for task in first}
            for task in tasks:
                pending[pool.submit(fn, task)] = task
                if len(pending) >= 2 * self.workers:
                    break
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    task = pending.pop(fut)
                    yield task, fut.result()
                    nxt = next(tasks, None)
                    if nxt is not None:
                        pending[pool.submit(fn, nxt)] = nxt


def get_executor(name: str = "local", workers: int | None = None, **options: Any):
    """The executor called `name` ("local"; other engines register here)."""
    if name == "local":
        return LocalExecutor(workers)
    if name == "ray":  # options: address, num_cpus, num_gpus, max_retries (see ray_executor)
        from ar_slicing.machinery.ray_executor import RayExecutor

        return RayExecutor(workers, **options)
    from ar_slicing.errors import ArSliceError

    raise ArSliceError(f"unknown executor {name!r}; available: local, ray")
