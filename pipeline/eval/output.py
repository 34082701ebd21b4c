"""Loss files: one atomically written Parquet chunk per run of windows, and the evaluator that makes one."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import write_parquet_atomic
from ar_slicing.machinery.layout import LOSS_PART
from pipeline.eval.config import EvalConfig
from pipeline.eval.forward import BatchRunner, make_forward
from pipeline.eval.inputs import TagsInput, fixed_sequences, open_tags, rolling_sequences

log = logging.getLogger(__name__)


def losses_schema():
    import pyarrow as pa

    # never null, like the tag table's keys (REQUIRED in Parquet)
    return pa.schema(
        [
            pa.field("window_id", pa.int32(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),
            pa.field("nll", pa.float32(), nullable=False),
        ]
    )


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return out_dir / LOSS_PART.format(chunk)


def chunk_keys(tags: TagsInput, w0: int, w1: int) -> tuple[np.ndarray, np.ndarray]:
    """(window_id, pos) of every target of windows w0..w1-1, in tag-row order."""
    n = tags.n_targets[w0:w1]
    window_id = np.repeat(np.arange(w0, w1, dtype=np.int32), n)
    first_row = np.repeat(np.cumsum(n) - n, n)
    pos = (np.arange(int(n.sum()), dtype=np.int64) - first_row + 1).astype(np.int32)
    return window_id, pos


def write_chunk(path: Path, window_id, pos, nll: np.ndarray) -> None:
    """The loss part `path`, written whole or not at all: refused (ArSliceError) when a loss is
    not finite; any other failure of the write is raised as an ArSliceError naming the file, its
    temporary removed."""
    import pyarrow as pa

    bad = np.flatnonzero(~np.isfinite(nll))
    if bad.size:
        i = int(bad[0])
        raise ArSliceError(
            f"non-finite loss ({nll[i]}) at window {int(window_id[i])} pos {int(pos[i])} "
            f"({bad.size} such rows in {path.name}); the model overflows in this dtype — try "
            "--dtype fp32 — or its weights are broken. Nothing was written for this chunk."
        )
    table = pa.table(
        {"window_id": pa.array(window_id), "pos": pa.array(pos), "nll": pa.array(nll)},
        schema=losses_schema(),
    )
    try:
        write_parquet_atomic(path, table)
    except OSError as err:
        raise ArSliceError(
            f"could not write the loss part {path} ({type(err).__name__}: {err}); nothing of it "
            "was kept, and a rerun resumes at it"
        ) from err


@dataclasses.dataclass
class ComputedChunk:
    """A chunk's losses, computed and not yet written."""

    path: Path
    window_id: np.ndarray
    pos: np.ndarray
    nll: np.ndarray
    stats: dict  # what the stage records of it ("rows", "read", "seconds", ...)

    def write(self) -> dict:
        write_chunk(self.path, self.window_id, self.pos, self.nll)
        return self.stats


class ChunkEvaluator:
    """Computes and writes loss chunks `(c, runs)` with one model held for many chunks: in the
    driver of a local run (`run_all`: each chunk written while the next one computes), or in each
    Ray actor of `--executor ray` (a call per chunk, which loads its own model and tags from the
    paths in `cfg`). A chunk's windows are the runs of consecutive windows `runs`
    ((w0, w1), ...): one run for an evaluation of every window, several for a window subset;
    their sequences are batched together and their rows follow one another."""

    def __init__(
        self,
        cfg: EvalConfig,
        device: str,
        dtype: str,
        batch_size: int,
        loaded=None,
        tags=None,
        prefix: int | None = None,  # the rolling windows' prefix token (default: the store's EOS)
        lead: tuple[int, ...] = (),  # read after the prefix, before each document (--harness-bos)
    ):
        import torch

        self.tags = tags if tags is not None else open_tags(cfg.tags, cfg.tokens)
        if loaded is None:
            from models import load_model

            loaded = load_model(
                cfg.spec,
                device=device,
                fast_path=cfg.fast_path,
                model_config=cfg.model_config,
                trust_remote_code=cfg.trust_remote_code,
            )
        self.out = Path(cfg.out)
        self.kernels_taken: dict = {}  # {fused op: the paths it took} (models/kernels)
        forward = make_forward(loaded, device, dtype, cfg.kernels, self.kernels_taken)
        self.runner = BatchRunner(forward, batch_size, on_oom=torch.cuda.empty_cache)
        if cfg.windowing == "rolling":
            self.make_sequences = functools.partial(rolling_sequences, prefix=prefix, lead=lead)
        else:
            self.make_sequences = fixed_sequences
        self.warmup_s = self._warm_up(device, loaded) if device.startswith("cuda") else 0.0

    def _warm_up(self, device: str, loaded) -> float:
        """One forward of a single window before the first chunk, so that the device's one-time
        costs (kernel loading, Triton compiles, library handles) are paid here, once, and not
        counted in the first chunk's rate. Returns its seconds."""
        t = time.time()
        width = max(1, min(self.tags.window, loaded.max_positions or self.tags.window))
        ids = np.zeros((1, width), dtype=np.int64)
        nll = self.runner.forward(ids, ids)
        if not isinstance(nll, np.ndarray):
            nll.result()
        return time.time() - t

    def compute(self, task: tuple[int, tuple[tuple[int, int], ...]], progress=None):
        """The losses of chunk `task` = (c, runs), not yet written: a ComputedChunk."""
        c, runs = task
        t = time.time()
        sequences, keys, rows = [], [], 0
        for w0, w1 in runs:
            sequences += [
                dataclasses.replace(s, row0=s.row0 + rows)
                for s in self.make_sequences(self.tags, w0, w1)
            ]
            keys.append(chunk_keys(self.tags, w0, w1))
            rows += int(self.tags.n_targets[w0:w1].sum())
        nll = np.full(rows, np.nan, dtype=np.float32)
        read = self.runner.run(sequences, nll, progress)
        window_id, pos = (np.concatenate(k) for k in zip(*keys))
        stats = {
            "rows": rows,
            "read": read,
            "seconds": time.time() - t,
            "batch_size": self.runner.batch_size,
            "backoffs": self.runner.backoffs,
            "kernels": {op: sorted(paths) for op, paths in self.kernels_taken.items()},
        }
        return ComputedChunk(chunk_path(self.out, c), window_id, pos, nll, stats)

    def __call__(self, task: tuple[int, tuple[tuple[int, int], ...]], progress=None) -> dict:
        """Compute chunk `task` and write its file; returns what the stage records of it."""
        return self.compute(task, progress).write()

    def run_all(self, tasks, progress=None) -> Iterator[tuple]:
        """(task, what the stage records of it) for each of `tasks`, in order, each yielded once
        its file is in place. A chunk is written by a background thread while the next one
        computes: at most one write in flight, so at most two chunks' losses are held. A write
        that fails raises its ArSliceError here, after every chunk written before it was
        yielded, and leaves no part of its file; a chunk that fails to compute first lets the
        write before it finish (and yields it when it succeeded)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="loss-parts") as writer:
            pending = None  # (task, the future of its write)
            for task in tasks:
                try:
                    chunk = self.compute(task, progress)
                except BaseException:
                    if pending is not None and pending[1].exception() is None:
                        yield pending[0], pending[1].result()
                    raise
                if pending is not None:
                    yield pending[0], pending[1].result()
                pending = (task, writer.submit(chunk.write))
            if pending is not None:
                yield pending[0], pending[1].result()
