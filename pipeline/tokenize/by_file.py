"""`arslice tokenize --shard-by-file`: one task per input file, which reads its own file.

The default tokenize reads every source in the driver and ships shards of text to the workers;
on a cluster that makes one process read (and decompress, and parse) the whole corpus. Here the
unit of work is an input file instead: a `.jsonl[.gz|.zst]`/`.parquet`/`.txt` source, or each
file a directory source's `--glob` matches. A task reads its file through the same readers (the
same empty-document, bad-record and split rules, with the same split keys, so it keeps the same
documents), encodes it in batches and streams the tokens into one part; its docs part, written
last, marks the file done. The parts are then assembled in file order as usual, so the store
holds the same tokens and documents as the default path; only docs.parquet's row groups differ
(one per file instead of one per shard).

Parallelism is the number of input files (the Pile's training set is 30 files: split them
further for more tasks); a task that dies redoes its whole file, and a rerun skips finished files.
"""

from __future__ import annotations

import glob as globlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ar_slicing.data.readers import HF_PREFIX, DirectoryReader, ReadStats, iter_documents
from ar_slicing.machinery.io import atomic_path, write_parquet_atomic
from pipeline.config import reader_options
from pipeline.tokenize.shards import (
    cached_encoder,
    encode_texts,
    part_paths,
    part_schema,
    shard_documents,
    shard_part,
)

log = logging.getLogger(__name__)

_MAX_EXAMPLES = 10  # bad-record examples kept across files, as one reader keeps


@dataclass(frozen=True)
class FileTask:
    """Read and encode one input file into part `index`: plain values, so any executor ships it."""

    index: int
    source: str  # the --source value
    file: str | None  # the file's path relative to a directory source; None for a file source
    text_field: str
    glob: list[str]
    on_bad_record: str
    split_fraction: float | None
    split_part: str | None
    shard_docs: int  # documents per encode batch
    shard_chars: int  # characters of text per encode batch
    tokenizer_path: str
    parts_dir: str
    dtype: str
    eos_id: int
    threads: int
    encoder: str = "tokenizers"  # the backend (ar_slicing.data.encoders), chosen by the driver

    def documents(self, stats: ReadStats):
        # A directory source restricted to exactly this file keeps the split keys (paths
        # relative to the directory) the driver-read path gives its documents.
        pattern = globlib.escape(self.file) if self.file is not None else self.glob
        return iter_documents(
            [self.source],
            text_field=self.text_field,
            glob=pattern,
            on_bad_record=self.on_bad_record,
            split_fraction=self.split_fraction,
            split_part=self.split_part,
            stats=stats,
        )


def input_files(sources: list[str], glob: list[str]) -> list[tuple[str, str | None]]:
    """(source, file relative to it or None) of every input file, in the order they are read."""
    units = []
    for spec in sources:
        path = Path(spec)
        if not spec.startswith(HF_PREFIX) and path.is_dir():
            units.extend((spec, rel) for rel, _ in DirectoryReader(path, glob).files())
        else:
            units.append((spec, None))  # a file, or an hf:// dataset read by one task
    return units


def encode_file(task: FileTask) -> dict:
    """Read one input file, encode it batch by batch into its tokens part, then write its docs
    part. Returns {docs, tokens, stats} (the read stats, which the ledger keeps for a rerun)."""
    import os

    import pyarrow as pa

    if task.threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    encoder = cached_encoder(task.tokenizer_path, task.encoder)
    dtype = np.dtype(task.dtype)
    stats = ReadStats()
    columns: dict[str, list] = {"n_tokens": [], "source": [], "subset": [], "eos_in_text": []}
    tokens_path, docs_path = part_paths(task.parts_dir, task.index)
    n_tokens = 0
    with atomic_path(tokens_path) as tmp, open(tmp, "wb") as f:
        batches = shard_documents(task.documents(stats), task.shard_docs, task.shard_chars)
        for _, batch in batches:
            stream, lengths, eos_in_text = encode_texts(
                encoder, [d.text for d in batch], dtype, task.eos_id
            )
            stream.tofile(f)
            n_tokens += stream.size
            columns["n_tokens"].append(lengths)
            columns["eos_in_text"].append(eos_in_text)
            columns["source"].extend(d.source for d in batch)
            columns["subset"].extend(d.subset for d in batch)
    ints = {
        k: np.concatenate(columns[k]) if columns[k] else np.zeros(0, np.int32)
        for k in ("n_tokens", "eos_in_text")
    }
    table = pa.table(
        {
            "n_tokens": pa.array(ints["n_tokens"], pa.int32()),
            "source": pa.array(columns["source"], pa.string()),
            "subset": pa.array(columns["subset"], pa.string()),
            "eos_in_text": pa.array(ints["eos_in_text"], pa.int32()),
        },
        schema=part_schema(),
    )
    write_parquet_atomic(docs_path, table)
    return {"docs": table.num_rows, "tokens": int(n_tokens), "stats": asdict(stats)}


def _add_stats(total: ReadStats, part: dict) -> None:
    for name, value in part.items():
        if name == "bad_examples":
            room = _MAX_EXAMPLES - len(total.bad_examples)
            total.bad_examples.extend(value[: max(room, 0)])
        else:
            setattr(total, name, getattr(total, name) + value)


def encode_by_file(
    stage,
    cfg,
    executor,
    parts_dir: Path,
    tokenizer_path: Path,
    dtype,
    eos_id: int,
    stats,
    account,
    encoder: str = "tokenizers",
) -> int:
    """Encode every input file of `cfg.source` into part `i` (i = its place in reading order),
    skipping the files the stage's ledger holds. Adds the read stats into `stats`, reports each
    file to `account({docs, tokens})`. Returns how many files were resumed."""
    from ar_slicing.machinery.executor import default_workers

    units = input_files(list(cfg.source), cfg.glob)
    workers = getattr(executor, "workers", 1)
    local = getattr(executor, "name", "local") == "local"
    threads = (
        (max(1, default_workers() // workers) if workers > 1 else default_workers()) if local else 1
    )
    resumed = 0
    tasks = []
    for index, (source, rel) in enumerate(units):
        done = stage.done(shard_part(index))
        if done is not None:
            resumed += 1
            _add_stats(stats, done["stats"])
            account({"docs": done["docs"], "tokens": done["tokens"]})
            continue
        tasks.append(
            FileTask(
                index=index,
                source=source,
                file=rel,
                **reader_options(cfg),
                shard_docs=cfg.shard_docs,
                shard_chars=int(cfg.shard_mb * 1e6),
                tokenizer_path=str(tokenizer_path),
                parts_dir=str(parts_dir),
                dtype=dtype.str,
                eos_id=eos_id,
                threads=threads,
                encoder=encoder,
            )
        )
    if resumed:
        log.info("resuming: %d of %d input files already encoded", resumed, len(units))
    for task, result in executor.map_unordered(encode_file, tasks):
        stage.record(shard_part(task.index), part_paths(parts_dir, task.index), **result)
        _add_stats(stats, result["stats"])
        account({"docs": result["docs"], "tokens": result["tokens"]})
    return resumed
