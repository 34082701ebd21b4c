"""Loss files: one atomically written Parquet chunk per run of windows, and the evaluator that makes one."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError
from ar_slicing.io import atomic_path
from ar_slicing.layout import LOSS_PART
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
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


class ChunkEvaluator:
    """Computes and writes loss chunks `(c, runs)` with one model held for many chunks: in the
    driver of a local run, or in each Ray actor of `--executor ray` (which loads its own model
    and tags from the paths in `cfg`). A chunk's windows are the runs of consecutive windows
    `runs` ((w0, w1), ...): one run for an evaluation of every window, several for a window
    subset; their sequences are batched together and their rows follow one another."""

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
                cfg.model,
                device=device,
                fast_path=cfg.fast_path,
                model_config=cfg.model_config,
                trust_remote_code=cfg.trust_remote_code,
            )
        self.out = Path(cfg.out)
        forward = make_forward(loaded, device, dtype)
        self.runner = BatchRunner(forward, batch_size, on_oom=torch.cuda.empty_cache)
        if cfg.windowing == "rolling":
            self.make_sequences = functools.partial(rolling_sequences, prefix=prefix, lead=lead)
        else:
            self.make_sequences = fixed_sequences

    def __call__(self, task: tuple[int, tuple[tuple[int, int], ...]], progress=None) -> dict:
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
        write_chunk(chunk_path(self.out, c), window_id, pos, nll)
        return {
            "rows": rows,
            "read": read,
            "seconds": time.time() - t,
            "batch_size": self.runner.batch_size,
            "backoffs": self.runner.backoffs,
        }
