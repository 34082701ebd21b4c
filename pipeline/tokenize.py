"""`arslice tokenize`: text sources (or pre-tokenized data) -> a token store (DESIGN.md).

Text sources are read in order by `ar_slicing.readers` and cut into shards of consecutive
documents (at most `shard_docs` documents or `shard_mb` MB of text, so the cut points depend only
on the input). Worker processes encode each shard with the tokenizer's batched encoder and write
its tokens (EOS after every document) and document table to `<out>/.parts/` atomically; the docs
part, written second, marks the shard done. A final assembly concatenates the parts in shard
order into `tokens.bin` and `docs.parquet`, writes `tokenizer.json`, `meta.json` last, and removes
the parts. So the store's bytes do not depend on the worker count, and a killed run resumes at
shard granularity (it re-reads the sources but encodes only the shards not yet done).

Documents are encoded without the tokenizer's own added special tokens (no BOS); an EOS string
written literally in a document's text is encoded as the tokenizer encodes it (as EOS, for GPT-2
style tokenizers, as GPT-NeoX's preprocessing did) and counted in meta.json as `eos_in_text`.

Pre-tokenized sources (Megatron/GPT-NeoX `.bin` + `.idx`, raw uint16/uint32 files) are copied
into a store as they are, without appending anything (`eos_appended: false`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import (
    atomic_path,
    build_meta,
    prepare_out_dir,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
    write_meta,
)
from ar_slicing.readers import (
    ReadStats,
    check_split_options,
    is_pretokenized,
    iter_documents,
)
from ar_slicing.store import DOCS_NAME, TOKENIZER_NAME, TOKENS_NAME, docs_schema, dtype_for_vocab
from pipeline.config import (
    Command,
    config_to_dict,
    glob_option,
    on_bad_record_option,
    text_field_option,
)

log = logging.getLogger(__name__)

PARTS_DIR = ".parts"
PLAN_NAME = "plan.json"
PARTS_FORMAT = 2  # bump when the parts' layout changes, so older parts are never reused
SOURCE_FORMATS = ("raw-uint16", "raw-uint32", "megatron")
# Config fields that decide the shards' contents: finished shards are reused only when all agree.
# Tokens per read/convert/write step of an import, and docs.parquet rows per batch.
_IMPORT_CHUNK = 1 << 24
_DOCS_BATCH = 1 << 20
PLAN_KEYS = (
    "text_field",
    "glob",
    "split_fraction",
    "split_part",
    "max_docs",
    "shard_docs",
    "shard_mb",
)


@dataclass(frozen=True)
class TokenizeConfig:
    source: list[str] = field(
        metadata={
            "help": "text sources (.jsonl[.gz|.zst], .parquet, .txt, directories, hf://...) "
            "or pre-tokenized files (X.bin with X.idx beside it, raw token files)"
        }
    )
    out: str = field(metadata={"help": "token store directory to write"})
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer.json, transformers tokenizer directory or hub name (optional "
            "for pre-tokenized imports given --vocab-size and --eos-id)"
        },
    )
    workers: int = field(default=0, metadata={"help": "encoding processes (0 = all cores)"})
    text_field: str = text_field_option()
    on_bad_record: str = on_bad_record_option()
    source_format: str | None = field(
        default=None,
        metadata={
            "help": "format of pre-tokenized sources (default: X.bin with X.idx is megatron)",
            "choices": list(SOURCE_FORMATS),
        },
    )
    glob: str = glob_option()
    split_fraction: float | None = field(
        default=None,
        metadata={
            "help": "keep a deterministic part of the documents: a document is 'val' when "
            "sha256 of its path relative to the source root (plus ':N', its record number, in "
            "multi-document files) maps below this fraction"
        },
    )
    split_part: str | None = field(
        default=None,
        metadata={"help": "which part to keep with --split-fraction", "choices": ["train", "val"]},
    )
    max_docs: int | None = field(default=None, metadata={"help": "stop after this many documents"})
    eos_token: str | None = field(
        default=None,
        metadata={
            "help": "the token appended after each document (default: <|endoftext|> or the like)"
        },
    )
    vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "vocabulary size of a pre-tokenized import: needed without --tokenizer; with "
            "one it may widen the tokenizer's to the model's padded embedding (Pythia: 50304)"
        },
    )
    eos_id: int | None = field(
        default=None,
        metadata={"help": "end-of-document id of a pre-tokenized import made without --tokenizer"},
    )
    shard_docs: int = field(default=10_000, metadata={"help": "most documents per shard"})
    shard_mb: float = field(default=1.0, metadata={"help": "most MB of text per shard"})
    overwrite: bool = field(default=False, metadata={"help": "redo a complete store"})
    executor: str = field(
        default="local",
        metadata={
            "help": "where shards are encoded: local processes, or a Ray cluster, one task per "
            "shard (every node must see --out under the same path; the sources are read here)",
            "choices": ["local", "ray"],
        },
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"},
    )
    shard_by_file: bool = field(
        default=False,
        metadata={
            "help": "one task per input file, which reads its own file (nothing is read here: "
            "for clusters); the same tokens, docs.parquet row groups follow the files"
        },
    )


@dataclass(frozen=True)
class ShardTask:
    """One shard of documents to encode: plain values only, so any executor can ship it."""

    index: int
    texts: list[str]
    sources: list[str]
    subsets: list[str | None]
    tokenizer_path: str
    parts_dir: str
    dtype: str
    eos_id: int
    threads: int  # encoder threads inside the worker


def part_paths(parts_dir: str | Path, index: int) -> tuple[Path, Path]:
    """The tokens part and docs part of shard `index` (1000 shards per subdirectory)."""
    sub = Path(parts_dir) / f"{index // 1000:05d}"
    return sub / f"{index:08d}.tokens", sub / f"{index:08d}.docs.parquet"


def part_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("n_tokens", pa.int32()),
            ("source", pa.string()),
            ("subset", pa.string()),
            ("eos_in_text", pa.int32()),  # EOS ids the text itself produced (a literal EOS string)
        ]
    )


_TOKENIZER_CACHE: dict[tuple, object] = {}


def cached_tokenizer(path: str):
    """The tokenizer at `path`, loaded once per process (keyed by the file's mtime and size too, so
    a store redone with another tokenizer under the same path never sees a stale one). The stage
    loads it before starting its workers, so forked workers inherit it instead of parsing it."""
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _TOKENIZER_CACHE:
        from tokenizers import Tokenizer

        _TOKENIZER_CACHE.clear()
        _TOKENIZER_CACHE[key] = Tokenizer.from_file(path)
    return _TOKENIZER_CACHE[key]


def encode_texts(tok, texts: list[str], dtype: np.dtype, eos_id: int):
    """(stream: every text's ids then EOS, lengths int32, EOS ids inside each text int32)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: faster
    encodings = encode(texts, add_special_tokens=False)
    eos = np.array([eos_id], dtype=dtype)
    pieces = []
    lengths = np.empty(len(encodings), dtype=np.int32)
    eos_in_text = np.empty(len(encodings), dtype=np.int32)
    for i, enc in enumerate(encodings):
        ids = np.array(enc.ids, dtype=dtype)
        lengths[i] = ids.size
        eos_in_text[i] = np.count_nonzero(ids == eos_id)
        pieces.append(ids)
        pieces.append(eos)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return stream, lengths, eos_in_text


def encode_shard(task: ShardTask) -> dict:
    """Encode one shard and write its tokens part, then its docs part (the completion marker)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if task.threads <= 1:
        # One encoder thread per worker process: the processes already use every core.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = cached_tokenizer(task.tokenizer_path)
    stream, lengths, eos_in_text = encode_texts(tok, task.texts, np.dtype(task.dtype), task.eos_id)
    tokens_path, docs_path = part_paths(task.parts_dir, task.index)
    with atomic_path(tokens_path) as tmp:
        stream.tofile(tmp)
    table = pa.table(
        {
            "n_tokens": pa.array(lengths, pa.int32()),
            "source": pa.array(task.sources, pa.string()),
            "subset": pa.array(task.subsets, pa.string()),
            "eos_in_text": pa.array(eos_in_text, pa.int32()),
        },
        schema=part_schema(),
    )
    with atomic_path(docs_path) as tmp:
        pq.write_table(table, tmp)
    return {"docs": len(task.texts), "tokens": int(stream.size)}


def _done_shard_counts(parts_dir: Path, index: int, itemsize: int) -> dict | None:
    """{docs, tokens} of a shard finished by an earlier run, or None if it is not done."""
    import pyarrow.parquet as pq

    tokens_path, docs_path = part_paths(parts_dir, index)
    if not (docs_path.is_file() and tokens_path.is_file()):
        return None
    return {
        "docs": pq.ParquetFile(docs_path).metadata.num_rows,
        "tokens": tokens_path.stat().st_size // itemsize,
    }


def _source_identity(spec: str) -> dict:
    """What identifies a source's content for the resume plan (path, size, mtime)."""
    p = Path(spec)
    if p.is_file():
        st = p.stat()
        return {"source": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if p.is_dir():
        return {"source": str(p.resolve())}
    return {"source": spec}


def _remove_stale_tmp_files(out: Path) -> None:
    """Temporary files a killed run left behind (atomic writes that never got renamed)."""
    for tmp in out.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def _prepare_parts(parts_dir: Path, plan: dict) -> None:
    """Keep finished shards only if they were made under the same plan; else start afresh."""
    plan_path = parts_dir / PLAN_NAME
    if parts_dir.exists():
        old = read_json(plan_path) if plan_path.is_file() else None
        if old != plan:
            log.info("discarding %s: made with a different configuration or input", parts_dir)
            shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan_path, plan)


def _shard_documents(docs, shard_docs: int, shard_bytes: int) -> Iterator[tuple[int, list]]:
    """Cut the document stream into consecutive shards (index, [Document, ...])."""
    batch, size, index = [], 0, 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)  # characters: a cheap, deterministic stand-in for bytes
        if len(batch) >= shard_docs or size >= shard_bytes:
            yield index, batch
            batch, size, index = [], 0, index + 1
    if batch:
        yield index, batch


def run_tokenize(cfg: TokenizeConfig) -> dict:
    sources = list(cfg.source)
    if not sources:
        raise ArSliceError("give at least one --source")
    kinds = {is_pretokenized(s, cfg.source_format) for s in sources}
    if len(kinds) > 1:
        raise ArSliceError(
            "cannot mix text sources and pre-tokenized files in one store; tokenize them into "
            "separate stores"
        )
    if kinds == {True}:
        return run_import(cfg)
    return run_text(cfg)


def _load_tokenizer_info(cfg: TokenizeConfig):
    from ar_slicing.tokenizer import describe, load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    info = describe(tok, cfg.tokenizer, cfg.eos_token)
    return tok, info


def run_text(cfg: TokenizeConfig) -> dict:
    """Tokenize text sources into a store (see the module docstring)."""
    from tqdm import tqdm

    from ar_slicing.executor import default_workers, get_executor

    if cfg.tokenizer is None:
        raise ArSliceError(
            "text sources need --tokenizer (a tokenizer.json, directory or hub name)"
        )
    if cfg.shard_docs < 1 or cfg.shard_mb <= 0:
        raise ArSliceError("--shard-docs and --shard-mb must be positive")
    check_split_options(cfg.split_fraction, cfg.split_part)
    if cfg.shard_by_file and cfg.max_docs is not None:
        raise ArSliceError(
            "--max-docs counts documents across the sources in order; it does not go with "
            "--shard-by-file"
        )
    out = Path(cfg.out)
    if not prepare_out_dir(out, cfg.overwrite):
        print(f"tokenize: {out} is already complete; pass --overwrite to redo it")
        return {"out": str(out), "skipped": True}
    t0 = time.time()
    tok, info = _load_tokenizer_info(cfg)
    dtype = dtype_for_vocab(info["vocab_size"])
    tokenizer_json = tok.to_str(pretty=True)
    executor = get_executor(cfg.executor, cfg.workers or None, address=cfg.ray_address)
    workers = executor.workers
    parts_dir = out / PARTS_DIR
    _remove_stale_tmp_files(out)
    plan = {
        "parts_format": PARTS_FORMAT,
        "tokenizer": info["fingerprint"],
        "eos_id": info["eos_id"],
        "dtype": dtype.name,
        "sources": [_source_identity(s) for s in cfg.source],
        # on_bad_record is left out on purpose: the shards finished before a run stopped at a bad
        # record hold the same documents under --on-bad-record skip, so that rerun resumes.
        **{k: getattr(cfg, k) for k in PLAN_KEYS},
        **({"shard_by_file": True} if cfg.shard_by_file else {}),  # parts are files, not shards
    }
    _prepare_parts(parts_dir, plan)
    tokenizer_path = parts_dir / TOKENIZER_NAME
    write_bytes_atomic(tokenizer_path, tokenizer_json.encode())

    stats = ReadStats()
    docs = iter_documents(
        cfg.source,
        text_field=cfg.text_field,
        glob=cfg.glob,
        on_bad_record=cfg.on_bad_record,
        split_fraction=cfg.split_fraction,
        split_part=cfg.split_part,
        max_docs=cfg.max_docs,
        stats=stats,
    )
    threads = max(1, default_workers() // workers) if workers > 1 else default_workers()
    if cfg.executor != "local":
        threads = 1  # one task per CPU of the cluster
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

    def tasks() -> Iterator[ShardTask]:
        for index, batch in _shard_documents(docs, cfg.shard_docs, int(cfg.shard_mb * 1e6)):
            done = _done_shard_counts(parts_dir, index, dtype.itemsize)
            if done is not None:
                totals["resumed"] += 1
                account(done)
                continue
            yield ShardTask(
                index=index,
                texts=[d.text for d in batch],
                sources=[d.source for d in batch],
                subsets=[d.subset for d in batch],
                tokenizer_path=str(tokenizer_path),
                parts_dir=str(parts_dir),
                dtype=dtype.str,
                eos_id=int(info["eos_id"]),
                threads=threads,
            )

    cached_tokenizer(str(tokenizer_path))
    _load_pyarrow_pandas_shim()
    try:
        if cfg.shard_by_file:
            from pipeline.tokenize_by_file import encode_by_file

            totals["resumed"] = encode_by_file(
                cfg, executor, parts_dir, tokenizer_path, dtype, int(info["eos_id"]), stats, account
            )
        else:
            for _task, counts in executor.map_unordered(encode_shard, tasks()):
                account(counts)
    finally:
        progress.close()
    n_shards = totals["shards"]
    n_tokens, n_docs, eos_in_text = _assemble(out, parts_dir, n_shards, dtype)
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
        inputs={"sources": [_source_identity(s) for s in cfg.source]},
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
        dtype=dtype.name,
        n_tokens=n_tokens,
        n_docs=n_docs,
        eos_appended=True,
        bad_record_examples=stats.bad_examples,
    )
    write_meta(out, meta)
    shutil.rmtree(parts_dir, ignore_errors=True)
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
    _print_summary(summary)
    return summary


def _load_pyarrow_pandas_shim() -> None:
    """Build one small Arrow array now: pyarrow imports pandas on its first conversion (about a
    CPU-second), and doing it before the workers fork spares each of them that import."""
    import pyarrow as pa

    pa.array([0], pa.int32())


def _assemble(out: Path, parts_dir: Path, n_shards: int, dtype: np.dtype) -> tuple[int, int, int]:
    """Concatenate the parts, in shard order, into tokens.bin and docs.parquet.

    Returns (tokens, documents, EOS ids that came from document text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    offset, doc_id, eos_in_text = 0, 0, 0
    with atomic_path(out / TOKENS_NAME) as tokens_tmp, atomic_path(out / DOCS_NAME) as docs_tmp:
        with (
            open(tokens_tmp, "wb") as tokens_file,
            pq.ParquetWriter(docs_tmp, docs_schema()) as writer,
        ):
            for index in range(n_shards):
                tokens_path, docs_path = part_paths(parts_dir, index)
                part = pq.ParquetFile(docs_path).read()  # (read_table would import pyarrow.dataset)
                lengths = part.column("n_tokens").to_numpy().astype(np.int64)
                expected = int((lengths + 1).sum()) * dtype.itemsize
                if tokens_path.stat().st_size != expected:
                    raise BadInput(
                        f"{tokens_path}: {tokens_path.stat().st_size} bytes, expected {expected}; "
                        f"delete {parts_dir} and rerun"
                    )
                with open(tokens_path, "rb") as f:
                    shutil.copyfileobj(f, tokens_file, 1 << 22)
                # (a part may hold no documents: an input file with none kept, --shard-by-file)
                offsets = offset + np.concatenate([[0], np.cumsum(lengths + 1)])[:-1].astype(
                    np.int64
                )
                n = len(lengths)
                writer.write_table(
                    pa.table(
                        {
                            "doc_id": pa.array(np.arange(doc_id, doc_id + n, dtype=np.int64)),
                            "offset": pa.array(offsets, pa.int64()),
                            "n_tokens": part.column("n_tokens"),
                            "source": part.column("source"),
                            "subset": part.column("subset"),
                        },
                        schema=docs_schema(),
                    )
                )
                offset += int((lengths + 1).sum())
                doc_id += n
                eos_in_text += int(part.column("eos_in_text").to_numpy().sum())
            if n_shards == 0:
                writer.write_table(docs_schema().empty_table())
    return offset, doc_id, eos_in_text


def _print_summary(s: dict) -> None:
    skipped = ", ".join(
        f"{s[k]} {k.replace('_', ' ')}" for k in ("bad_records", "empty") if s.get(k)
    )
    print(
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


# ---- pre-tokenized imports -------------------------------------------------------------------


def _import_tokenizer_info(cfg: TokenizeConfig):
    """(tokenizer or None, info) for an import: from --tokenizer, or from --vocab-size/--eos-id."""
    if cfg.tokenizer is not None:
        tok, info = _load_tokenizer_info(cfg)
        if cfg.eos_id is not None and cfg.eos_id != info["eos_id"]:
            raise ArSliceError(
                f"--eos-id {cfg.eos_id} disagrees with the tokenizer's end-of-document id {info['eos_id']}"
            )
        if cfg.vocab_size is not None and cfg.vocab_size < info["vocab_size"]:
            raise ArSliceError(
                f"--vocab-size {cfg.vocab_size} is below the tokenizer's {info['vocab_size']}"
            )
        if cfg.vocab_size is not None:
            info["vocab_size"] = cfg.vocab_size  # e.g. Pythia's padded embedding (50304)
        return tok, info
    if cfg.vocab_size is None or cfg.eos_id is None:
        raise ArSliceError(
            "a pre-tokenized import needs --tokenizer, or both --vocab-size and --eos-id "
            "(for the Pythia data: --tokenizer EleutherAI/pythia-160m, or --vocab-size 50304 --eos-id 0)"
        )
    if not 0 <= cfg.eos_id < cfg.vocab_size:
        raise ArSliceError(
            f"--eos-id {cfg.eos_id} is outside the vocabulary 0..{cfg.vocab_size - 1}"
        )
    # Without a tokenizer, stores of the same import settings still share one fingerprint.
    ident = (
        f"pre-tokenized import without a tokenizer: vocab_size={cfg.vocab_size} eos_id={cfg.eos_id}"
    )
    return None, {
        "name": f"none (vocab_size={cfg.vocab_size}, eos_id={cfg.eos_id})",
        "fingerprint": hashlib.sha256(ident.encode()).hexdigest(),
        "vocab_size": cfg.vocab_size,
        "eos_id": cfg.eos_id,
    }


@dataclass
class _ImportSource:
    path: Path  # the token data
    kind: str  # "megatron" | "raw-uint16" | "raw-uint32"


def _resolve_import_source(spec: str, source_format: str | None) -> _ImportSource:
    from ar_slicing.megatron import bin_path_for, idx_path_for

    path = Path(spec)
    if source_format in (None, "megatron"):
        bin_path = bin_path_for(path)
        if idx_path_for(bin_path).is_file():
            return _ImportSource(bin_path, "megatron")
        if source_format == "megatron":
            raise BadInput(
                f"source {spec}: no {idx_path_for(bin_path).name} beside it (needed for megatron)"
            )
        if not path.exists():
            raise BadInput(f"source {spec}: no such file")
        raise BadInput(
            f"source {spec}: no {idx_path_for(bin_path).name} beside it; for a headerless token file "
            "pass --source-format raw-uint16 or raw-uint32"
        )
    if not path.is_file():
        raise BadInput(f"source {spec}: no such file")
    return _ImportSource(path, source_format)


def run_import(cfg: TokenizeConfig) -> dict:
    """Copy pre-tokenized streams into a store, unchanged; documents from the idx or from EOS."""
    from tqdm import tqdm

    from ar_slicing import megatron

    if cfg.split_fraction is not None or cfg.max_docs is not None:
        raise ArSliceError("--split-fraction and --max-docs apply to text sources, not to imports")
    out = Path(cfg.out)
    if not prepare_out_dir(out, cfg.overwrite):
        print(f"tokenize: {out} is already complete; pass --overwrite to redo it")
        return {"out": str(out), "skipped": True}
    t0 = time.time()
    tok, info = _import_tokenizer_info(cfg)
    vocab, eos = int(info["vocab_size"]), int(info["eos_id"])
    dtype = dtype_for_vocab(vocab)
    sources = [_resolve_import_source(s, cfg.source_format) for s in cfg.source]
    plans = []  # (source, its MegatronIndex or raw dtype, its token count)
    for src in sources:
        if src.kind == "megatron":
            index = megatron.read_index(megatron.idx_path_for(src.path))
            megatron.check_bin(index, src.path)
            plans.append((src, index, index.n_tokens))
        else:
            raw = megatron.raw_dtype(src.path, src.kind)
            plans.append((src, raw, src.path.stat().st_size // raw.itemsize))
    total = sum(n for _, _, n in plans)
    documents = []  # per source: (stream offsets, lengths, source name) of its non-empty documents
    empty = stream_pos = 0
    progress = tqdm(total=total, desc="import", unit=" tokens", unit_scale=True, mininterval=1.0)
    try:
        with atomic_path(out / TOKENS_NAME) as tmp, open(tmp, "wb") as f:
            for src, how, n in plans:
                if src.kind == "megatron":
                    chunks = megatron.iter_megatron_chunks(how, src.path, _IMPORT_CHUNK)
                else:
                    data = np.memmap(src.path, dtype=how, mode="r") if n else np.zeros(0, how)
                    chunks = (data[a : a + _IMPORT_CHUNK] for a in range(0, n, _IMPORT_CHUNK))
                eos_ends, seen = [], 0
                for chunk in chunks:
                    _check_range(chunk, vocab, src.path, seen)
                    if src.kind != "megatron":
                        eos_ends.append(np.flatnonzero(chunk == eos).astype(np.int64) + seen + 1)
                    chunk.astype(dtype, copy=False).tofile(f)
                    seen += chunk.size
                    progress.update(chunk.size)
                if src.kind == "megatron":
                    doc_off, doc_len = megatron.megatron_documents(how)
                else:
                    doc_off, doc_len = _documents_from_eos_ends(eos_ends, n)
                if doc_len.size and doc_len.max() >= 2**31:
                    raise BadInput(
                        f"{src.path}: a document of {int(doc_len.max())} tokens does not fit "
                        "docs.parquet's int32 n_tokens"
                    )
                keep = doc_len > 0
                empty += int((~keep).sum())
                documents.append((doc_off[keep] + stream_pos, doc_len[keep], str(src.path)))
                stream_pos += n
    finally:
        progress.close()
    n_docs = _write_import_docs(out / DOCS_NAME, documents)
    if tok is not None:
        with atomic_path(out / TOKENIZER_NAME) as tmp:
            tmp.write_text(tok.to_str(pretty=True))
    wall = time.time() - t0
    meta = build_meta(
        "tokenize",
        config=config_to_dict(cfg),
        inputs={"sources": [{"format": s.kind, **_source_identity(str(s.path))} for s in sources]},
        counts={"documents": n_docs, "tokens": stream_pos, "empty": empty},
        skipped={"empty": empty},
        wall_time_s=wall,
        throughput={"tokens_per_s": stream_pos / max(wall, 1e-9)},
        tokenizer=info,
        dtype=dtype.name,
        n_tokens=stream_pos,
        n_docs=n_docs,
        eos_appended=False,
    )
    write_meta(out, meta)
    summary = {
        "out": str(out),
        "skipped": False,
        "n_docs": n_docs,
        "n_tokens": stream_pos,
        "dtype": dtype.name,
        "empty": empty,
        "wall_time_s": wall,
        "tokens_per_s": stream_pos / max(wall, 1e-9),
    }
    print(
        f"tokenize: imported {summary['n_tokens']:,} tokens in {summary['n_docs']:,} docs "
        f"({dtype.name}, stream kept as is) -> {out} in {wall:.1f}s"
    )
    return summary


def _write_import_docs(path: Path, documents) -> int:
    """docs.parquet of an import, written in batches (the Pythia index has ~10^8 rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    doc_id = 0
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, docs_schema()) as writer:
        for offsets, lengths, name in documents:
            for a in range(0, offsets.size, _DOCS_BATCH):
                off, n = offsets[a : a + _DOCS_BATCH], lengths[a : a + _DOCS_BATCH]
                batch = {
                    "doc_id": pa.array(np.arange(doc_id, doc_id + off.size, dtype=np.int64)),
                    "offset": pa.array(off.astype(np.int64)),
                    "n_tokens": pa.array(n.astype(np.int32)),
                    "source": pa.array([name] * off.size, pa.string()),
                    "subset": pa.nulls(off.size, pa.string()),
                }
                writer.write_table(pa.table(batch, schema=docs_schema()))
                doc_id += off.size
        if doc_id == 0:
            writer.write_table(docs_schema().empty_table())
    return doc_id


def _check_range(chunk: np.ndarray, vocab_size: int, path: Path, start: int) -> None:
    if chunk.size == 0:
        return
    lo, hi = chunk.min(), chunk.max()
    if lo < 0 or hi >= vocab_size:
        bad = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
        raise BadInput(
            f"{path}: token {int(chunk[bad])} at token index {start + bad} is outside the vocabulary "
            f"0..{vocab_size - 1}; pass the right --tokenizer or --vocab-size"
        )


def _documents_from_eos_ends(eos_ends: list[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents of a raw stream: each ends with (and includes) an EOS; a tail without one is the last."""
    ends = np.concatenate(eos_ends) if eos_ends else np.zeros(0, np.int64)
    if ends.size == 0 or ends[-1] != n:
        ends = np.append(ends, np.int64(n)) if n else ends
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64) if ends.size else ends
    return starts, ends - starts


COMMAND = Command(
    TokenizeConfig,
    run_tokenize,
    summary="text sources or pre-tokenized data -> token store",
    examples="""
  arslice tokenize --source val.jsonl.zst --tokenizer gpt2 --out runs/pile/tokens/val
  arslice tokenize --source 00.jsonl.zst 01.jsonl.zst --tokenizer tokenizer.json --out runs/pile/tokens/train --workers 16
  arslice tokenize --source /shared/pile/train --glob '*.jsonl.zst' --tokenizer gpt2 --out /shared/pile/tokens/train --executor ray --ray-address auto --shard-by-file
  arslice tokenize --source /usr/lib/python3.11 --glob '**/*.py' --split-fraction 0.1 --split-part val \\
      --tokenizer runs/demo/tokenizer.json --out runs/demo/tokens/val
  arslice tokenize --source data.parquet --text-field content --on-bad-record skip --tokenizer t.json --out store
  arslice tokenize --source hf://monology/pile-uncopyrighted@validation --tokenizer gpt2 --out val --max-docs 10000
  arslice tokenize --source pile_0.87_deduped_text_document.bin --tokenizer EleutherAI/pythia-160m --out pythia
  arslice tokenize --source train.bin --source-format raw-uint16 --vocab-size 50257 --eos-id 50256 --out store""",
)
