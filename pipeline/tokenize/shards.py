"""Shards of documents: encoding one into its parts (a part of the stage's ledger), assembling the
store from them."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.data.store import docs_schema
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import atomic_path, write_parquet_atomic
from ar_slicing.machinery.layout import DOCS_NAME, TOKENS_NAME


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
    encoder: str = "tokenizers"  # the backend (ar_slicing.data.encoders), chosen by the driver


DOCS_PART_SUFFIX = ".docs.parquet"  # a shard's docs part; its tokens part ends in ".tokens"


def part_paths(parts_dir: str | Path, index: int) -> tuple[Path, Path]:
    """The tokens part and docs part of shard `index` (1000 shards per subdirectory)."""
    sub = Path(parts_dir) / f"{index // 1000:05d}"
    return sub / f"{index:08d}.tokens", sub / f"{index:08d}{DOCS_PART_SUFFIX}"


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


_ENCODER_CACHE: dict[tuple, object] = {}


def cached_encoder(path: str, backend: str):
    """The encoder `backend` ("tokenizers" | "tiktoken", see `ar_slicing.data.encoders`) of the
    tokenizer at `path`, made once per process (the stage makes it before forking workers)."""
    from ar_slicing.data.encoders import TokenizersEncoder, tiktoken_for

    tok = cached_tokenizer(path)
    key = (id(tok), backend)
    if key not in _ENCODER_CACHE:
        _ENCODER_CACHE.clear()
        if backend == "tiktoken":
            encoder, why = tiktoken_for(tok)
            if encoder is None:
                raise ArSliceError(f"--encoder tiktoken: cannot reproduce {path} ({why})")
        else:
            encoder = TokenizersEncoder(tok)
        _ENCODER_CACHE[key] = encoder
    return _ENCODER_CACHE[key]


def encode_texts(encoder, texts: list[str], dtype: np.dtype, eos_id: int):
    """(stream: every text's ids then EOS, lengths int32, EOS ids inside each text int32)."""
    encodings = encoder.encode_batch(texts)
    eos = np.array([eos_id], dtype=dtype)
    pieces = []
    lengths = np.empty(len(encodings), dtype=np.int32)
    eos_in_text = np.empty(len(encodings), dtype=np.int32)
    for i, enc in enumerate(encodings):
        ids = np.asarray(enc).astype(dtype)
        lengths[i] = ids.size
        eos_in_text[i] = np.count_nonzero(ids == eos_id)
        pieces.append(ids)
        pieces.append(eos)
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return stream, lengths, eos_in_text


def shard_part(index: int) -> str:
    """The ledger's name of shard (or input file) `index`."""
    return f"shard {index:08d}"


def encode_shard(task: ShardTask) -> dict:
    """Encode one shard and write its tokens part, then its docs part. Returns {docs, tokens}."""
    import pyarrow as pa

    if task.threads <= 1:
        # One encoder thread per worker process: the processes already use every core.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    encoder = cached_encoder(task.tokenizer_path, task.encoder)
    stream, lengths, eos_in_text = encode_texts(
        encoder, task.texts, np.dtype(task.dtype), task.eos_id
    )
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
    write_parquet_atomic(docs_path, table)
    return {"docs": len(task.texts), "tokens": int(stream.size)}


def source_identity(spec: str, glob: str | list[str] | None = None) -> dict:
    """What identifies a source's content in the stage plan: a file's path, size and mtime; a
    directory's files matching `glob` (one pattern or several) likewise (so an edited file is a
    changed input); a hub dataset by its name."""
    from ar_slicing.data.readers import DirectoryReader

    p = Path(spec)
    if p.is_file():
        st = p.stat()
        return {"source": str(p.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if p.is_dir():
        files = [f for _, f in DirectoryReader(p, glob or "**/*").files()]
        return {
            "source": str(p.resolve()),
            "files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
            "latest_mtime_ns": max((f.stat().st_mtime_ns for f in files), default=0),
        }
    return {"source": spec}


def shard_documents(docs, shard_docs: int, shard_bytes: int) -> Iterator[tuple[int, list]]:
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


def load_tokenizer_info(cfg):
    from ar_slicing.data.tokenizer import describe, load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    info = describe(tok, cfg.tokenizer, cfg.eos_token)
    return tok, info


def preload_pyarrow_pandas() -> None:
    """Build one small Arrow array now: pyarrow imports pandas on its first conversion (about a
    CPU-second), and doing it before the workers fork spares each of them that import."""
    import pyarrow as pa

    pa.array([0], pa.int32())


def assemble_store(
    out: Path, parts_dir: Path, n_shards: int, dtype: np.dtype
) -> tuple[int, int, int]:
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
