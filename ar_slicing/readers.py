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
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import json_error

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt",)
PRETOKENIZED_SUFFIXES = (".bin", ".idx")
HF_PREFIX = "hf://"
BAD_RECORD_POLICIES = ("error", "skip")
# Bad records logged one by one under --on-bad-record skip before the log goes quiet.
_MAX_LOGGED_BAD = 10
# Records per batch when streaming Parquet row groups.
_PARQUET_BATCH = 1024
# Compressed bytes fed to the zstd decompressor per read.
_ZSTD_CHUNK = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")

SUPPORTED = (
    ".jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt, a directory of text files, "
    "hf://OWNER/NAME[/CONFIG][@SPLIT], or pre-tokenized .bin/.idx"
)


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # the file (or hf:// dataset) the document came from
    subset: str | None  # the Pile's meta.pile_set_name, when the record has one
    key: str  # relative path (+ ":N" record number) that decides the train/val split


@dataclass
class ReadStats:
    """What the readers saw; the tokenize stage records it in meta.json."""

    documents: int = 0  # documents yielded
    bytes: int = 0  # UTF-8 bytes of the yielded documents' text
    bad_records: int = 0  # skipped under on_bad_record="skip"
    empty: int = 0  # empty documents, skipped
    invalid_utf8: int = 0  # documents whose text had invalid UTF-8 replaced
    other_split_part: int = 0  # documents left out because they belong to the other split part
    bad_examples: list[str] = field(default_factory=list)

    def as_counts(self) -> dict[str, int]:
        return {
            "documents": self.documents,
            "bytes": self.bytes,
            "bad_records": self.bad_records,
            "empty": self.empty,
            "invalid_utf8": self.invalid_utf8,
            "other_split_part": self.other_split_part,
        }

    def describe_empty(self) -> str:
        """Why nothing was kept, for the error a source without documents gets."""
        return (
            f"{self.empty} empty, {self.bad_records} bad records skipped, "
            f"{self.other_split_part} in the other split part"
        )


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
        if not str(s).startswith(HF_PREFIX) and not Path(s).exists():
            raise BadInput(f"source {s}: no such file or directory")


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


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


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


class _BadRecords:
    """Applies the on_bad_record policy: raise, or count + log + skip."""

    def __init__(self, stats: ReadStats, policy: str):
        self.stats, self.policy = stats, policy

    def __call__(self, where: str, problem: str) -> None:
        if self.policy == "error":
            raise BadInput(
                f"{where}: {problem}; fix the record, or pass --on-bad-record skip to skip it"
            )
        self.stats.bad_records += 1
        if len(self.stats.bad_examples) < _MAX_LOGGED_BAD:
            self.stats.bad_examples.append(f"{where}: {problem}")
            log.warning("skipping bad record %s: %s", where, problem)
        elif len(self.stats.bad_examples) == _MAX_LOGGED_BAD:
            self.stats.bad_examples.append("...")
            log.warning("more bad records skipped; only their count is kept")


def clean_text(text: str, stats: ReadStats) -> str:
    """`text` with lone surrogates (JSON `\\udXXX` escapes, not encodable as UTF-8) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        stats.invalid_utf8 += 1
        text = _SURROGATE.sub("\ufffd", text)
    return text


def decode_utf8(data: bytes, stats: ReadStats) -> str:
    """`data` as UTF-8; invalid sequences become U+FFFD and the document is counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return data.decode("utf-8", "replace")


def pile_subset(meta: Any) -> str | None:
    """`meta.pile_set_name` of a Pile record (meta may be a dict or a JSON string)."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            return None
    if isinstance(meta, dict):
        value = meta.get("pile_set_name")
        return None if value is None else str(value)
    return None


# ---- .jsonl, .jsonl.gz, .jsonl.zst -------------------------------------------------------------


class _ZstdStream(io.RawIOBase):
    """A strict zstd decoder: unlike `zstandard.stream_reader`, a truncated last frame is an error."""

    def __init__(self, path: Path):
        import zstandard

        self.path = path
        self._zstd = zstandard
        self._file = open(path, "rb")
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._in_frame = False  # fed bytes of a frame that has not ended yet
        self.compressed_pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._file.read(_ZSTD_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise BadInput(
                        f"{self.path}: truncated zstd stream (ends inside a frame at compressed "
                        f"byte {self.compressed_pos}); re-download or re-compress the file"
                    )
                return 0
            self.compressed_pos += len(chunk)
            self._pending = self._feed(chunk)
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _feed(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            try:
                out.append(self._dobj.decompress(chunk))
            except self._zstd.ZstdError as e:
                raise BadInput(
                    f"{self.path}: corrupt zstd data near compressed byte {self.compressed_pos} ({e})"
                ) from None
            self._in_frame = not self._dobj.eof
            if self._dobj.eof:  # a frame ended: the rest of the chunk starts the next one
                chunk = self._dobj.unused_data
                self._dobj = self._zstd.ZstdDecompressor().decompressobj()
            else:
                chunk = b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_binary(path: Path):
    name = path.name.lower()
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdStream(path), buffer_size=1 << 20)
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


class JsonlReader:
    def __init__(self, path: Path, text_field: str, key: str | None = None):
        self.path, self.text_field = path, text_field
        self.root_key = key or path.name

    def documents(self, stats: ReadStats, on_bad_record: str) -> Iterator[Document]:
        bad = _BadRecords(stats, on_bad_record)
        source = str(self.path)
        lineno, offset = 0, 0
        with _open_binary(self.path) as f:
            while True:
                try:
                    line = f.readline()
                except (EOFError, OSError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                    raise BadInput(
                        f"{self.path}: compressed stream is truncated or corrupt after line {lineno} "
                        f"(uncompressed byte {offset}): {e}; re-download or re-compress the file"
                    ) from None
                if not line:
                    break
                lineno += 1
                where = f"{self.path}:{lineno} (byte {offset})"
                offset += len(line)
                if not line.strip():
                    continue  # blank lines separate nothing in JSON Lines
                text_line = decode_utf8(line, stats)
                try:
                    record = json.loads(text_line)
                except json.JSONDecodeError as e:
                    bad(where, f"not valid JSON ({json_error(e, line=False)})")
                    continue
                if not isinstance(record, dict):
                    bad(where, f"expected a JSON object, got {type(record).__name__}")
                    continue
                if self.text_field not in record:
                    keys = ", ".join(sorted(record)[:10])
                    bad(
                        where,
                        f"no field {self.text_field!r} (fields: {keys}); pass --text-field NAME",
                    )
                    continue
                text = record[self.text_field]
                if not isinstance(text, str):
                    bad(where, f"field {self.text_field!r} is {type(text).__name__}, not a string")
                    continue
                yield Document(
                    clean_text(text, stats),
                    source,
                    pile_subset(record.get("meta")),
                    f"{self.root_key}:{lineno}",
                )


# ---- Parquet ---------------------------------------------------------------------------------


class ParquetReader:
    def __init__(self, path: Path, text_field: str, key: str | None = None):
        self.path, self.text_field = path, text_field
        self.root_key = key or path.name

    def documents(self, stats: ReadStats, on_bad_record: str) -> Iterator[Document]:
        import pyarrow.parquet as pq

        bad = _BadRecords(stats, on_bad_record)
        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:
            raise BadInput(f"{self.path}: not a readable Parquet file ({e})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise BadInput(
                f"{self.path}: no column {self.text_field!r} (columns: {', '.join(names)}); "
                "pass --text-field NAME"
            )
        subset_col = next((c for c in ("meta", "pile_set_name", "subset") if c in names), None)
        columns = [self.text_field] + ([subset_col] if subset_col else [])
        source, row = str(self.path), 0
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns):
                texts = batch.column(self.text_field).to_pylist()
                subsets = (
                    batch.column(subset_col).to_pylist() if subset_col else [None] * len(texts)
                )
                for text, sub in zip(texts, subsets):
                    row += 1
                    where = f"{self.path}: row {row}"
                    if not isinstance(text, str):
                        if isinstance(text, bytes):
                            text = decode_utf8(text, stats)
                        else:
                            kind = "null" if text is None else type(text).__name__
                            bad(where, f"column {self.text_field!r} is {kind}, not a string")
                            continue
                    subset = pile_subset(sub) if subset_col == "meta" else sub
                    yield Document(
                        clean_text(text, stats), source, subset, f"{self.root_key}:{row}"
                    )
        except BadInput:
            raise
        except Exception as e:
            raise BadInput(f"{self.path}: cannot read row group after row {row} ({e})") from None


# ---- plain text files and directories --------------------------------------------------------


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


class DirectoryReader:
    """Every file under `root` matching `glob`, in sorted relative-path order.

    JSON Lines and Parquet files are read record by record (so `--glob '*.jsonl.zst'` reads a
    directory of Pile shards); any other file is one plain-text document.
    """

    def __init__(self, root: Path, glob: str | Sequence[str], text_field: str = "text"):
        self.root, self.text_field = root, text_field
        # one pattern or several; a file any of them matches is read once
        self.patterns = [glob] if isinstance(glob, str) else list(glob)

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


# ---- Hugging Face datasets -------------------------------------------------------------------

_DATA_FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".gz": "json",
    ".zst": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """`hf://OWNER/NAME[/CONFIG][@SPLIT]` -> (path or hub id, config or None, split).

    A local path (file or directory) after `hf://` is passed to `load_dataset` as it is.
    """
    rest = spec[len(HF_PREFIX) :]
    split = "train"
    if "@" in rest:
        rest, split = rest.rsplit("@", 1)
    if not rest or not split:
        raise BadInput(f"source {spec}: expected hf://OWNER/NAME[/CONFIG][@SPLIT]")
    if os.path.exists(rest):
        return rest, None, split
    parts = rest.strip("/").split("/")
    if len(parts) <= 2:
        return "/".join(parts), None, split
    return "/".join(parts[:2]), "/".join(parts[2:]), split


class HFDatasetReader:
    def __init__(self, spec: str, text_field: str):
        self.spec, self.text_field = spec, text_field
        self.name, self.config, self.split = parse_hf_spec(spec)

    def _load(self):
        try:
            from datasets import load_dataset

            path = Path(self.name)
            if path.is_file():
                builder = _DATA_FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise BadInput(
                        f"source {self.spec}: unknown data file type {path.suffix!r}; "
                        f"load_dataset reads {', '.join(sorted(set(_DATA_FILE_BUILDERS)))}"
                    )
                return load_dataset(
                    builder, data_files={self.split: str(path)}, split=self.split, streaming=True
                )
            from ar_slicing import hub

            if hub.is_hub_name(self.name):
                hub.require([(f"dataset {self.spec}", self.name, "dataset")])
            return load_dataset(self.name, self.config, split=self.split, streaming=True)
        except ArSliceError:
            raise
        except Exception as e:
            raise BadInput(
                f"source {self.spec}: load_dataset({self.name!r}, {self.config!r}, "
                f"split={self.split!r}, streaming=True) failed: {e}. Check the name, config and "
                "split, or download the data and pass the files"
            ) from None

    def documents(self, stats: ReadStats, on_bad_record: str) -> Iterator[Document]:
        bad = _BadRecords(stats, on_bad_record)
        dataset = self._load()
        key_root = Path(self.name).name if os.path.exists(self.name) else self.name
        index = 0
        for record in dataset:
            index += 1
            where = f"{self.spec}: record {index}"
            if self.text_field not in record:
                keys = ", ".join(sorted(record)[:10])
                bad(where, f"no field {self.text_field!r} (fields: {keys}); pass --text-field NAME")
                continue
            text = record[self.text_field]
            if not isinstance(text, str):
                kind = "null" if text is None else type(text).__name__
                bad(where, f"field {self.text_field!r} is {kind}, not a string")
                continue
            subset = pile_subset(record.get("meta"))
            if subset is None and isinstance(record.get("pile_set_name"), str):
                subset = record["pile_set_name"]
            yield Document(clean_text(text, stats), self.spec, subset, f"{key_root}:{index}")
