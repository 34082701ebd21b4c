"""Pre-tokenized sources (Megatron/GPT-NeoX `.bin` + `.idx`, raw uint16/uint32 files) copied into a
store unchanged, documents from the index or from the EOS ids."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.data.store import docs_schema, dtype_for_vocab
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import atomic_path, build_meta
from ar_slicing.machinery.layout import DOCS_NAME, TOKENIZER_NAME, TOKENS_NAME
from pipeline.config import config_to_dict
from pipeline.stage import Finished
from pipeline.tokenize.config import _DOCS_BATCH, _IMPORT_CHUNK, TokenizeConfig
from pipeline.tokenize.shards import load_tokenizer_info, source_identity


def import_tokenizer_info(cfg: TokenizeConfig):
    """(tokenizer or None, info) for an import: from --tokenizer, or from --vocab-size/--eos-id."""
    if cfg.tokenizer is not None:
        tok, info = load_tokenizer_info(cfg)
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
    from ar_slicing.data.megatron import bin_path_for, idx_path_for

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


def import_store(stage, cfg: TokenizeConfig, tok, info: dict, t0: float) -> Finished:
    """Copy pre-tokenized streams into the store `stage.out`, unchanged; documents from the
    idx or from the EOS ids."""
    from tqdm import tqdm

    from ar_slicing.data import megatron

    out = stage.out
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
    if total == 0:
        raise BadInput(f"tokenize: {', '.join(cfg.source)} hold no tokens; nothing to import")
    documents = []  # per source: (stream offsets, lengths, source name) of its non-empty documents
    empty = stream_pos = 0
    progress = tqdm(total=total, desc="import", unit=" tokens", unit_scale=True, mininterval=1.0)
    stage.expect(out / name for name in (TOKENS_NAME, DOCS_NAME, TOKENIZER_NAME))
    try:
        with atomic_path(out / TOKENS_NAME) as tmp, open(tmp, "wb") as f:
            for src, how, n in plans:
                if src.kind == "megatron":
                    chunks = megatron.iter_megatron_chunks(how, src.path, _IMPORT_CHUNK)
                else:
                    chunks = megatron.read_chunks(src.path, 0, how, n, _IMPORT_CHUNK)
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
        inputs={"sources": [{"format": s.kind, **source_identity(str(s.path))} for s in sources]},
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
    line = (
        f"tokenize: imported {summary['n_tokens']:,} tokens in {summary['n_docs']:,} docs "
        f"({dtype.name}, stream kept as is) -> {out} in {wall:.1f}s"
    )
    return Finished(meta, [line], summary)


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
