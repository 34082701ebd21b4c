"""The map steps on a Ray cluster: the same interface as `LocalExecutor`, tasks as Ray tasks.

Tasks are the stages' own picklable functions and arguments (a `count_shard(MapTask)`, an
`encode_shard(ShardTask)`, ...). They read their inputs from paths and write their outputs to
paths, so every node must see the run directory under the same path: shared storage is a path
(a local disk for a one-node cluster; NFS, Lustre or a mounted bucket for several nodes). Tasks
run in the driver's working directory, so relative paths resolve as they do in the driver (that
directory must exist on every node too). Only small results (counts, timings) travel back.

  * `map_unordered(fn, tasks)` runs `fn(task)` as a `ray.remote` task with `max_retries`, so a
    task whose worker process or node dies is run again (the stages' tasks write their outputs
    atomically, so a retried task never sees half a file). An exception raised by `fn` itself is
    not retried: a bad input fails the same way every time; it is re-raised in the driver.
  * `map_actors(make_state, tasks)` starts long-lived actors, each building its state once
    (`make_state()`, e.g. a model loaded on its GPU) and then running `state(task)` for the tasks
    it is given. One actor per GPU by default (`num_gpus=1`); on a CPU-only cluster, one per CPU.
    A dead actor is restarted and its unfinished task retried (`max_restarts`, `max_task_retries`).

The cluster is the one at `address` (`ray://host:10001`, `host:6379`, or "auto"), else the one
named by the RAY_ADDRESS environment variable, else a local one started on first use. Every node
needs this package importable by the same Python (install it into the same environment path on
each node).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

# Retries of a task (or restarts of an actor) after its process or node died.
DEFAULT_MAX_RETRIES = 3


def _ray():
    try:
        import ray
    except ImportError:
        raise ArSliceError(
            "--executor ray needs the `ray` package: pip install 'ar-slicing[ray]'"
        ) from None
    return ray


def connect(address: str | None = None) -> Any:
    """Connect to the cluster at `address` (or RAY_ADDRESS), or start a local one; returns `ray`.

    A Ray session already initialised in this process (e.g. by a test or a notebook) is reused.
    """
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(include_dashboard=False)
    except ConnectionError as e:
        where = (
            f"--ray-address {address}"
            if address
            else f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS')}"
        )
        raise ArSliceError(
            f"{where}: cannot connect to a Ray cluster ({e}); start one with `ray start --head`, "
            "or give neither for a local one"
        ) from None
    return ray


@contextlib.contextmanager
def _in_dir(cwd: str):
    """Run in the driver's working directory, so relative paths mean what they meant there
    (the directory must exist under the same path on every node, like the run directory)."""
    before = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError:
        log.warning("%s: no such directory on this node; relative paths will not resolve", cwd)
    try:
        yield
    finally:
        os.chdir(before)


def _call(fn: Callable[[Any], Any], task: Any, cwd: str) -> Any:
    with _in_dir(cwd):
        return fn(task)


class _StateActor:
    """Holds `make_state()` (built once, in the actor's process) and runs `state(task)`."""

    def __init__(self, make_state: Callable[[], Callable[[Any], Any]], cwd: str):
        self.cwd = cwd
        with _in_dir(cwd):
            self.state = make_state()

    def run(self, task: Any) -> Any:
        with _in_dir(self.cwd):
            return self.state(task)


def _reraise(err: BaseException) -> None:
    """Raise the task's own exception (e.g. BadInput, which the CLI prints plainly) when Ray
    wrapped one; a dead worker past its retries becomes an ArSliceError saying so."""
    ray = _ray()
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise err
    if isinstance(err, ray.exceptions.RayError):
        raise ArSliceError(
            f"a Ray task failed after its retries ({type(err).__name__}: {err}); finished "
            "shards are kept, so rerunning the same command resumes"
        ) from None
    raise err


def _as_finished(
    ray, pending: dict[Any, Any], refill: Callable[[Any], tuple[Any, Any] | None]
) -> Iterator[tuple[Any, Any]]:
    """Yield (key, result) for each Ray ref of `pending` (ref -> key) as it finishes, the task's
    own error raised (`_reraise`); after each, `refill(key)` may start one more, as (ref, key)."""
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            key = pending.pop(ref)
            try:
                result = ray.get(ref)
            except Exception as err:
                _reraise(err)
            yield key, result
            started = refill(key)
            if started is not None:
                pending[started[0]] = started[1]


class RayExecutor:
    """Runs the map steps of a stage as Ray tasks (see the module docstring).

    `workers` bounds the tasks in flight (default: the cluster's CPUs divided by `num_cpus`) and
    is what the stages size their work by, like `LocalExecutor.workers`. The cluster is joined
    on first use, so a stage refuses bad inputs before waiting for Ray to start.
    """

    name = "ray"

    def __init__(
        self,
        workers: int | None = None,
        *,
        address: str | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ):
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.max_retries = max_retries
        self._workers = workers
        self._ray = None

    @property
    def ray(self):
        if self._ray is None:
            self._ray = connect(self.address)
            self._remote = self._ray.remote(_call)
        return self._ray

    def _resource(self, name: str) -> int:
        return int(self.ray.cluster_resources().get(name, 0))

    @property
    def cluster_cpus(self) -> int:
        return self._resource("CPU")

    @property
    def cluster_gpus(self) -> int:
        return self._resource("GPU")

    @property
    def workers(self) -> int:
        if self._workers is None:
            self._workers = max(1, int(self.cluster_cpus // max(self.num_cpus, 1e-9)))
        return self._workers

    def call(self, fn: Callable[[Any], Any], arg: Any, *, num_gpus: float = 0) -> Any:
        """`fn(arg)` run once as a Ray task on a worker with `num_gpus` GPUs (e.g. to ask a GPU
        what it supports), its result returned here."""
        ray = self.ray
        ref = self._remote.options(num_cpus=self.num_cpus, num_gpus=num_gpus).remote(
            fn, arg, os.getcwd()
        )
        try:
            return ray.get(ref)
        except Exception as err:
            _reraise(err)

    def map_unordered(
        self, fn: Callable[[Any], Any], tasks: Iterable[Any]
    ) -> Iterator[tuple[Any, Any]]:
        """Yield (task, fn(task)) as Ray tasks finish, at most 2×workers in flight."""
        ray = self.ray
        submit = self._remote.options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=self.max_retries
        ).remote
        fn_ref = ray.put(fn)  # shipped once, not with every task
        cwd = os.getcwd()
        tasks = iter(tasks)
        pending: dict[Any, Any] = {}

        def next_task(_done=None) -> tuple[Any, Any] | None:
            task = next(tasks, None)
            return None if task is None else (submit(fn_ref, task, cwd), task)

        try:
            while len(pending) < max(2 * self.workers, 1) and (started := next_task()) is not None:
                pending[started[0]] = started[1]
            yield from _as_finished(ray, pending, next_task)
        finally:
            for ref in pending:  # the driver stopped early (an error, or the consumer left)
                ray.cancel(ref)

    def map_actors(
        self,
        make_state: Callable[[], Callable[[Any], Any]],
        tasks: Iterable[Any],
        *,
        n_actors: int | None = None,
        num_gpus: float | None = None,
        num_cpus: float | None = None,
    ) -> Iterator[tuple[Any, Any]]:
        """Yield (task, state(task)) from `n_actors` actors, each holding one `make_state()`.

        Default: one actor per GPU (`num_gpus=1`) when the cluster has GPUs, else one per CPU
        (`num_cpus=1`). Each actor has one task at a time, so a fast actor takes more of them.
        """
        ray = self.ray
        if num_gpus is None:
            num_gpus = 1 if self.cluster_gpus else 0
        if num_cpus is None:
            num_cpus = 1
        if num_gpus and self.cluster_gpus < num_gpus:
            raise ArSliceError(
                f"the Ray cluster has {self.cluster_gpus} GPUs, an actor needs {num_gpus}; "
                "add GPU nodes or evaluate on CPUs (--device cpu)"
            )
        if n_actors is None or n_actors < 1:
            n_actors = (
                self.cluster_gpus // num_gpus
                if num_gpus
                else self.cluster_cpus // max(num_cpus, 1e-9)
            )
        n_actors = max(1, int(n_actors))
        tasks = list(tasks)
        n_actors = min(n_actors, max(1, len(tasks)))
        if not tasks:
            return
        actor_cls = ray.remote(_StateActor).options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=self.max_retries,
            max_task_retries=self.max_retries,
        )
        log.info("starting %d Ray actors (num_gpus=%s, num_cpus=%s)", n_actors, num_gpus, num_cpus)
        actors = [actor_cls.remote(make_state, os.getcwd()) for _ in range(n_actors)]
        queue = iter(tasks)
        pending: dict[Any, tuple[Any, Any]] = {}

        def next_for(actor) -> tuple[Any, Any] | None:
            task = next(queue, None)
            return None if task is None else (actor.run.remote(task), (actor, task))

        try:
            for actor in actors:
                if (started := next_for(actor)) is None:
                    break
                pending[started[0]] = started[1]
            for (_actor, task), result in _as_finished(ray, pending, lambda key: next_for(key[0])):
                yield task, result
        finally:
            for actor in actors:
                ray.kill(actor)
