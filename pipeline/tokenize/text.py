"""Text sources -> a token store: read, shard, encode in workers, assemble (the module docstring of
`pipeline.tokenize` tells the whole story)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ar_slicing.data.encoders import select_encoder
from ar_slicing.data.readers import ReadStats
from ar_slicing.data.store import dtype_for_vocab
from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import (
    atomic_path,
    build_meta,
    write_bytes_atomic,
)
from ar_slicing.machinery.layout import DOCS_NAME, STORE_WORK_DIR, TOKENIZER_NAME, TOKENS_NAME
from pipeline.config import config_to_dict, read_documents
from pipeline.stage import Finished
from pipeline.tokenize.config import TokenizeConfig
from pipeline.tokenize.shards import (
    ShardTask,
    assemble_store,
    cached_encoder,
    encode_shard,
    part_paths,
    preload_pyarrow_pandas,
    shard_documents,
    shard_part,
    source_identity,
)

log = logging.getLogger(__name__)


def encode_store(stage, cfg: TokenizeConfig, tok, info: dict, t0: float) -> Finished:
    """Tokenize text sources into the store `stage.out` (see the package docstring)."""
    from ar_slicing.machinery.executor import get_executor

    out = stage.out
    encoder, encoder_why = select_encoder(tok, cfg.encoder)
    log.info("encoding with %s (%s)", encoder.name, encoder_why)
    dtype = dtype_for_vocab(info["vocab_size"])
    tokenizer_json = tok.to_str(pretty=True)
    executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    parts_dir = out / STORE_WORK_DIR
    parts_dir.mkdir(exist_ok=True)
    tokenizer_path = parts_dir / TOKENIZER_NAME
    write_bytes_atomic(tokenizer_path, tokenizer_json.encode())

    stats = ReadStats()
    shards = Shards(stage, cfg, executor, parts_dir, tokenizer_path, dtype, info, encoder.name)
    totals = shards.encode(stats, t0)
    if totals["docs"] == 0:
        raise BadInput(
            f"tokenize: no documents in {', '.join(cfg.source)} ({stats.describe_empty()}); "
            "check --source, --glob, --text-field and --split-part"
        )
    n_shards = totals["shards"]
    stage.expect(out / name for name in (TOKENS_NAME, DOCS_NAME, TOKENIZER_NAME))
    n_tokens, n_docs, eos_in_text = assemble_store(out, parts_dir, n_shards, dtype)
    if eos_in_text:
        log.warning(
            "%d end-of-document tokens came from the documents' own text (a literal %s); "
            "they stay in the stream, as the tokenizer encodes them",
            eos_in_text,
            cfg.eos_token or "end-of-document string",
        )
    with atomic_path(out / TOKENIZER_NAME) as tmp:
        tmp.write_text(tokenizer_json)
    wall = time.time() - t0
    counts = {
        **stats.as_counts(),
        "tokens": n_tokens,
        "shards": n_shards,
        "eos_in_text": eos_in_text,
    }
    meta = build_meta(
        "tokenize",
        config=config_to_dict(cfg),
        inputs={"sources": [source_identity(s, cfg.glob) for s in cfg.source]},
        counts=counts,
        skipped={
            "bad_records": stats.bad_records,
            "empty": stats.empty,
            "other_split_part": stats.other_split_part,
        },
        wall_time_s=wall,
        throughput={
            "tokens_per_s": n_tokens / max(wall, 1e-9),
            "mb_per_s": stats.bytes / 1e6 / max(wall, 1e-9),
        },
        tokenizer=info,
        encoder={"backend": encoder.name, "why": encoder_why},
        dtype=dtype.name,
        n_tokens=n_tokens,
        n_docs=n_docs,
        eos_appended=True,
        bad_record_examples=stats.bad_examples,
    )
    summary = {
        "out": str(out),
        "skipped": False,
        "n_docs": n_docs,
        "n_tokens": n_tokens,
        "dtype": dtype.name,
        "bytes": stats.bytes,
        "shards": n_shards,
        "shards_resumed": totals["resumed"],
        "bad_records": stats.bad_records,
        "empty": stats.empty,
        "invalid_utf8": stats.invalid_utf8,
        "eos_in_text": eos_in_text,
        "wall_time_s": wall,
        "tokens_per_s": n_tokens / max(wall, 1e-9),
    }
    return Finished(meta, [_summary_line(summary)], summary)  # (finishing drops the shards)


@dataclass
class Shards:
    """The documents encoded shard by shard into the store's work folder `parts_dir`, on
    `executor`'s workers, each shard recorded in the stage's ledger as it returns (a resumed run
    reads the documents again and skips the shards the ledger holds)."""

    stage: Any
    cfg: TokenizeConfig
    executor: Any
    parts_dir: Path
    tokenizer_path: Path
    dtype: np.dtype
    info: dict
    encoder: str

    def encode(self, stats: ReadStats, t0: float) -> dict:
        """Encode every shard not done yet; the totals (docs, tokens, shards, resumed)."""
        from tqdm import tqdm

        progress = tqdm(desc="tokenize", unit=" docs", mininterval=1.0, dynamic_ncols=True)
        totals = {"docs": 0, "tokens": 0, "shards": 0, "resumed": 0}

        def account(counts: dict) -> None:
            totals["docs"] += counts["docs"]
            totals["tokens"] += counts["tokens"]
            totals["shards"] += 1
            progress.update(counts["docs"])
            elapsed = max(time.time() - t0, 1e-9)
            progress.set_postfix(
                tokens=f"{totals['tokens']:,}",
                tok_s=f"{totals['tokens'] / elapsed:,.0f}",
                refresh=False,
            )

        cached_encoder(str(self.tokenizer_path), self.encoder)
        preload_pyarrow_pandas()
        try:
            if self.cfg.shard_by_file:
                totals["resumed"] = self._by_file(stats, account)
            else:
                for task, counts in self.executor.map_unordered(
                    encode_shard, self._tasks(stats, totals, account)
                ):
                    part = part_paths(self.parts_dir, task.index)
                    self.stage.record(shard_part(task.index), part, **counts)
                    account(counts)
        finally:
            progress.close()
        return totals

    def _threads(self) -> int:
        """Threads per encoding task: the machine's cores shared among local workers."""
        from ar_slicing.machinery.executor import default_workers

        if self.cfg.executor != "local":
            return 1  # one task per CPU of the cluster
        workers = self.executor.workers
        return max(1, default_workers() // workers) if workers > 1 else default_workers()

    def _tasks(self, stats: ReadStats, totals: dict, account) -> Iterator[ShardTask]:
        """The shards of the documents, those the ledger holds accounted for and left out."""
        cfg, threads = self.cfg, self._threads()
        docs = read_documents(cfg, stats)
        for index, batch in shard_documents(docs, cfg.shard_docs, int(cfg.shard_mb * 1e6)):
            done = self.stage.done(shard_part(index))
            if done is not None:
                totals["resumed"] += 1
                account(done)
                continue
            yield ShardTask(
                index=index,
                texts=[d.text for d in batch],
                sources=[d.source for d in batch],
                subsets=[d.subset for d in batch],
                tokenizer_path=str(self.tokenizer_path),
                parts_dir=str(self.parts_dir),
                dtype=self.dtype.str,
                eos_id=int(self.info["eos_id"]),
                threads=threads,
                encoder=self.encoder,
            )

    def _by_file(self, stats: ReadStats, account) -> int:
        from pipeline.tokenize.by_file import encode_by_file

        return encode_by_file(
            self.stage,
            self.cfg,
            self.executor,
            self.parts_dir,
            self.tokenizer_path,
            self.dtype,
            int(self.info["eos_id"]),
            stats,
            account,
            self.encoder,
        )


def _summary_line(s: dict) -> str:
    skipped = ", ".join(
        f"{s[k]} {k.replace('_', ' ')}" for k in ("bad_records", "empty") if s.get(k)
    )
    return (
        f"tokenize: {s['n_docs']:,} docs, {s['n_tokens']:,} tokens ({s['dtype']}) -> {s['out']} "
        f"in {s['wall_time_s']:.1f}s ({s['tokens_per_s']:,.0f} tokens/s)"
        + (f"; skipped {skipped}" if skipped else "")
        + (
            f"; {s['invalid_utf8']} docs had invalid UTF-8 replaced"
            if s.get("invalid_utf8")
            else ""
        )
        + (
            f"; resumed {s['shards_resumed']} of {s['shards']} shards"
            if s.get("shards_resumed")
            else ""
        )
    )
