"""The tokenize stage's config and the names its parts share."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import (
    executor_option,
    glob_option,
    normalize_glob,
    on_bad_record_option,
    ray_address_option,
    text_field_option,
)

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
    glob: list[str] = glob_option()
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
    encoder: str = field(
        default="auto",
        metadata={
            "help": "encoding backend: 'tiktoken' (several times faster per core) for GPT-2-family "
            "byte-level BPEs it reproduces exactly, checked on probe texts and samples of the data; "
            "'auto' picks it where it does, else 'tokenizers'",
            "choices": ["auto", "tokenizers", "tiktoken"],
        },
    )
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
    executor: str = executor_option(
        "where shards are encoded: local processes, or a Ray cluster, one task per shard "
        "(every node must see --out under the same path; the sources are read here)"
    )
    ray_address: str | None = ray_address_option()
    shard_by_file: bool = field(
        default=False,
        metadata={
            "help": "one task per input file, which reads its own file (nothing is read here: "
            "for clusters); the same tokens, docs.parquet row groups follow the files"
        },
    )

    def __post_init__(self):
        normalize_glob(self)
