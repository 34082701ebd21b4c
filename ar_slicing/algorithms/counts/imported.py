"""Published bigram counts (Parquet files of `id0, id1, count`) turned into partial files.

Confirm Labs publish the Pile's bigram counts this way (`Confirm-Labs/pile_bigrams`: the
deduplicated Pile tokenized with GPT-NeoX-20B's tokenizer, each document between its BOS and
EOS token, packed into rows of 2048 tokens whose pairs were counted with DuckDB). An import task
reads some row groups of one file, checks every value (no nulls, ids within the vocabulary,
counts of at least one, no pair twice), and writes them as a sorted partial, so the reduce of a
count turns the files into bigrams.parquet; a pair listed in two files is found after the
reduce by `find_duplicate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.algorithms.counts.keys import bucket_bounds, key_dtype_for
from ar_slicing.algorithms.counts.partials import read_partial_slice, write_partial
from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import COUNT_PARTIALS_DIR

COLUMNS = ("id0", "id1", "count")
ROW_GROUPS_PER_TASK = 8


@dataclass(frozen=True)
class ImportTask:
    """Row groups rg_lo..rg_hi-1 of one Parquet file -> one partial file."""

    path: str
    rg_lo: int
    rg_hi: int
    vocab_size: int
    shift: int
    out: str

    @property
    def n_pairs(self) -> int:
        """What the progress bar counts: row groups (their rows are only known once read)."""
        return self.rg_hi - self.rg_lo


def plan_import_tasks(paths, work: Path, vocab_size: int, shift: int) -> list[ImportTask]:
    """Import tasks for every file, after checking each one has the three columns."""
    import pyarrow.parquet as pq

    tasks = []
    for f, path in enumerate(paths):
        try:
            meta = pq.read_metadata(path)
        except Exception as e:
            raise BadInput(f"--import {path}: not a readable Parquet file ({e})") from None
        names = meta.schema.names
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise BadInput(
                f"--import {path}: no column(s) {', '.join(missing)} (it has {', '.join(names)}); "
                "expected the columns id0, id1, count"
            )
        for k, lo in enumerate(range(0, meta.num_row_groups, ROW_GROUPS_PER_TASK)):
            hi = min(lo + ROW_GROUPS_PER_TASK, meta.num_row_groups)
            out = str(work / COUNT_PARTIALS_DIR / f"i{f:04d}-{k:06d}.bin")
            tasks.append(ImportTask(str(path), lo, hi, vocab_size, shift, out))
    return tasks


def import_part(task: ImportTask) -> dict:
    """Map step of an import: checked, sorted keys and counts of some row groups, as a partial."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = pq.ParquetFile(task.path)
    table = file.read_row_groups(range(task.rg_lo, task.rg_hi), columns=list(COLUMNS))
    where = f"--import {task.path} (row groups {task.rg_lo}..{task.rg_hi - 1})"
    cols = {}
    for name in COLUMNS:
        column = table.column(name)
        if column.null_count:
            raise BadInput(f"{where}: {column.null_count} null value(s) in column {name}")
        if not pa.types.is_integer(column.type):
            raise BadInput(f"{where}: column {name} is {column.type}, expected integers")
        cols[name] = column.to_numpy().astype(np.int64, copy=False)
    id0, id1, count = cols["id0"], cols["id1"], cols["count"]
    for name, ids in (("id0", id0), ("id1", id1)):
        if ids.size and (ids.min() < 0 or ids.max() >= task.vocab_size):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise BadInput(
                f"{where}: {name} {bad} is outside the tokenizer's vocabulary 0..{task.vocab_size - 1}"
                + (
                    " (negative ids are never token ids)"
                    if bad < 0
                    else "; is it the right --tokenizer?"
                )
            )
    if count.size and count.min() < 1:
        raise BadInput(
            f"{where}: count {int(count.min())}: every listed pair must have a count >= 1"
        )
    kd = key_dtype_for(task.shift)
    keys = (id0.astype(np.uint64) << np.uint64(task.shift)) | id1.astype(np.uint64)
    keys = keys.astype(kd)
    order = np.argsort(keys, kind="stable")
    keys, count = keys[order], count[order]
    same = np.flatnonzero(keys[1:] == keys[:-1])
    if same.size:
        p, q = _pair(keys[same[0]], task.shift)
        raise BadInput(f"{where}: the pair ({p}, {q}) is listed {_runs(keys, same[0])} times")
    offsets = np.append(
        np.searchsorted(keys, bucket_bounds(task.shift, task.vocab_size).astype(kd)), keys.size
    )
    write_partial(task.out, keys, count, offsets.astype(np.int64))
    return {"rows": int(keys.size), "pairs": int(count.sum())}


def _pair(key, shift: int) -> tuple[int, int]:
    return int(key) >> shift, int(key) & ((1 << shift) - 1)


def _runs(keys: np.ndarray, at: int) -> int:
    end = at
    while end + 1 < keys.size and keys[end + 1] == keys[at]:
        end += 1
    return end - at + 1


def find_duplicate(tasks: list[ImportTask], b_lo: int, b_hi: int, shift: int) -> str:
    """A pair that two files (or two parts of one file) both list, within fine buckets
    b_lo..b_hi-1, named with the files that list it."""
    keys, owners = [], []
    for t in tasks:
        k, _ = read_partial_slice(t.out, b_lo, b_hi)
        keys.append(k)
        owners.append(np.full(k.size, tasks.index(t)))
    keys, owners = np.concatenate(keys), np.concatenate(owners)
    order = np.argsort(keys, kind="stable")
    keys, owners = keys[order], owners[order]
    at = int(np.flatnonzero(keys[1:] == keys[:-1])[0])
    p, q = _pair(keys[at], shift)
    files = sorted({tasks[int(i)].path for i in owners[keys == keys[at]]})
    return f"the pair ({p}, {q}) is listed more than once, in {' and '.join(files)}"
