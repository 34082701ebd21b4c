"""Plain text files (one document each) and directories of files (matched by glob patterns,
read in sorted order; `.jsonl*` and `.parquet` files inside them by record)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from ar_slicing.data.readers.base import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    Document,
    ReadStats,
    decode_utf8,
)
from ar_slicing.data.readers.jsonl import JsonlReader
from ar_slicing.data.readers.parquet import ParquetReader
from ar_slicing.errors import BadInput

log = logging.getLogger(__name__)


def _read_text_file(path: Path, stats: ReadStats) -> str:
    try:
        return decode_utf8(path.read_bytes(), stats)
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from None


class TextFileReader:
    def __init__(self, path: Path):
        self.path = path

    def documents(self, stats: ReadStats, on_bad_record: str) -> Iterator[Document]:
        yield Document(_read_text_file(self.path, stats), str(self.path), None, self.path.name)


def check_glob(patterns: Sequence[str]) -> None:
    """Refuse a pattern that names no file inside a directory source: an empty one, or an
    absolute path (pathlib refuses both with an exception of its own)."""
    for pattern in patterns:
        if not pattern or pattern.startswith("/"):
            why = "empty" if not pattern else "an absolute path"
            raise BadInput(
                f"glob {pattern!r}: {why}, not a pattern of files inside a source folder; give "
                "one such as '*.txt' or '**/*.jsonl.zst'"
            )


class DirectoryReader:
    """Every file under `root` matching `glob`, in sorted relative-path order.

    JSON Lines and Parquet files are read record by record (so `--glob '*.jsonl.zst'` reads a
    directory of Pile shards); any other file is one plain-text document.
    """

    def __init__(self, root: Path, glob: str | Sequence[str], text_field: str = "text"):
        self.root, self.text_field = root, text_field
        # one pattern or several; a file any of them matches is read once
        self.patterns = [glob] if isinstance(glob, str) else list(glob)
        check_glob(self.patterns)

    def files(self) -> list[tuple[str, Path]]:
        found = {}
        for pattern in self.patterns:
            for p in self.root.glob(pattern):
                if p.is_file():
                    found[p.relative_to(self.root).as_posix()] = p
        if not found:
            wanted = repr(self.patterns[0]) if len(self.patterns) == 1 else repr(self.patterns)
            raise BadInput(f"source {self.root}: no files match {wanted}; pass --glob PATTERN")
        return sorted(found.items())

    def documents(self, stats: ReadStats, on_bad_record: str) -> Iterator[Document]:
        for rel, path in self.files():
            name = path.name.lower()
            if name.endswith(JSONL_SUFFIXES):
                yield from JsonlReader(path, self.text_field, rel).documents(stats, on_bad_record)
            elif name.endswith(PARQUET_SUFFIXES):
                yield from ParquetReader(path, self.text_field, rel).documents(stats, on_bad_record)
            else:
                yield Document(_read_text_file(path, stats), str(path), None, rel)
