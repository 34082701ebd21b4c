"""Corpus readers: text sources -> a stream of documents, each with its source and Pile subset.

Supported sources (one `--source` each, read in the order given):
  FILE.jsonl / .jsonl.gz / .jsonl.zst   one JSON object per line (the Pile's own format:
                                         `{"text": ..., "meta": {"pile_set_name": ...}}`)
  FILE.parquet                           rows with a text column (`--text-field`)
  FILE.txt                               one document
  DIRECTORY                              every file matching `--glob` (default `**/*.txt`; several
                                         patterns read every file any of them matches), sorted
                                         by relative path: .jsonl*/.parquet files by record, any
                                         other file as one document
  hf://OWNER/NAME[/CONFIG][@SPLIT]       a Hugging Face hub dataset, streamed (split default
                                         `train`), e.g. `hf://monology/pile-uncopyrighted@validation`
  hf://LOCAL_PATH[@SPLIT]                a local dataset directory or data file, read by the same
                                         `datasets.load_dataset`

What counts as a bad record (a line that is not JSON, a record without the text field or whose
text is not a string, a null Parquet cell) raises `BadInput` naming the file and line, unless
`on_bad_record="skip"`, which counts, logs and skips it. Empty documents are counted and skipped.
Invalid UTF-8 (and lone surrogates from JSON escapes) is replaced by U+FFFD and counted. A
truncated `.gz`/`.zst` file is always an error: its tail is unknowable.

Every document carries a `key` for the deterministic train/val split: its path relative to the
source root (the directory given, or the file's own directory), plus `:N` (the 1-based line or
record number) for files that hold many documents.

The dispatch (`open_source`, `iter_documents`) and the split are here; one module per kind of
source (`jsonl`, `parquet`, `files`, `hf`) and what they share (`base`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from ar_slicing.data.readers.base import (  # noqa: F401  (re-exported: the readers' shared names)
    BAD_RECORD_POLICIES,
    HF_PREFIX,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    PRETOKENIZED_SUFFIXES,
    SUPPORTED,
    TEXT_SUFFIXES,
    Document,
    ReadStats,
    _utf8_len,
)
from ar_slicing.data.readers.files import DirectoryReader, TextFileReader  # noqa: F401
from ar_slicing.data.readers.hf import HFDatasetReader, parse_hf_spec  # noqa: F401
from ar_slicing.data.readers.jsonl import JsonlReader  # noqa: F401
from ar_slicing.data.readers.parquet import ParquetReader  # noqa: F401
from ar_slicing.errors import ArSliceError, BadInput

log = logging.getLogger(__name__)


def check_sources(sources: Sequence[str]) -> None:
    """Refuse, before anything is read, a source list that is empty, holds an empty path (an
    unset variable would otherwise mean the current directory) or a local path that is missing."""
    from ar_slicing.errors import ArSliceError, BadInput

    if not sources:
        raise ArSliceError("give at least one --source")
    for s in sources:
        if not str(s).strip():
            raise ArSliceError(
                f"--source {s!r}: an empty path (an unset variable?); give a file, a directory "
                "or hf://OWNER/NAME"
            )
    missing = [s for s in sources if not str(s).startswith(HF_PREFIX) and not Path(s).exists()]
    if missing:  # all of them at once
        raise BadInput("; ".join(f"source {s}: no such file or directory" for s in missing))


def is_pretokenized(spec: str, source_format: str | None = None) -> bool:
    return source_format is not None or (
        not spec.startswith(HF_PREFIX) and spec.endswith(PRETOKENIZED_SUFFIXES)
    )


def split_part_of(key: str, fraction: float) -> str:
    """Which part of a split the document `key` falls in: "val" when sha256(key) maps below
    `fraction` of [0, 1), else "train".

    The first 8 bytes of the digest, read as an unsigned integer over 2**64, are uniform on
    [0, 1), so about `fraction` of the documents land in "val", the same ones on every machine.
    """
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "val" if h / 2**64 < fraction else "train"


def iter_documents(
    sources: Sequence[str],
    *,
    text_field: str = "text",
    glob: str | Sequence[str] = "**/*.txt",
    on_bad_record: str = "error",
    split_fraction: float | None = None,
    split_part: str | None = None,
    max_docs: int | None = None,
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Every non-empty document of `sources` in order, after the split filter and `max_docs`."""
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise ArSliceError(
            f"on_bad_record must be one of {BAD_RECORD_POLICIES}, not {on_bad_record!r}"
        )
    check_split_options(split_fraction, split_part)
    stats = stats if stats is not None else ReadStats()
    if max_docs is not None and max_docs <= 0:
        return
    for spec in sources:
        reader = open_source(spec, text_field=text_field, glob=glob)
        for doc in reader.documents(stats, on_bad_record):
            if not doc.text:
                stats.empty += 1
                continue
            if split_part is not None and split_part_of(doc.key, split_fraction) != split_part:
                stats.other_split_part += 1
                continue
            stats.documents += 1
            stats.bytes += _utf8_len(doc.text)
            yield doc
            if max_docs is not None and stats.documents >= max_docs:
                return


def check_split_options(split_fraction: float | None, split_part: str | None) -> None:
    if (split_fraction is None) != (split_part is None):
        raise ArSliceError("--split-fraction and --split-part go together: give both or neither")
    if split_fraction is not None and not 0.0 <= split_fraction <= 1.0:
        raise ArSliceError(f"--split-fraction must be in [0, 1], not {split_fraction}")
    if split_part not in (None, "train", "val"):
        raise ArSliceError(f"--split-part must be 'train' or 'val', not {split_part!r}")


def open_source(spec: str, *, text_field: str = "text", glob: str | Sequence[str] = "**/*.txt"):
    """The reader for one `--source` value, chosen by its form and file suffix."""
    if spec.startswith(HF_PREFIX):
        return HFDatasetReader(spec, text_field)
    path = Path(spec)
    if path.is_dir():
        return DirectoryReader(path, glob, text_field)
    if not path.exists():
        raise BadInput(f"source {spec}: no such file or directory")
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return JsonlReader(path, text_field)
    if name.endswith(PARQUET_SUFFIXES):
        return ParquetReader(path, text_field)
    if name.endswith(TEXT_SUFFIXES):
        return TextFileReader(path)
    if name.endswith(PRETOKENIZED_SUFFIXES):
        raise BadInput(
            f"source {spec}: a pre-tokenized file cannot be mixed with text sources; import it "
            "on its own (`arslice tokenize --source X.bin ...`)"
        )
    raise BadInput(f"source {spec}: unknown file type; supported: {SUPPORTED}")
