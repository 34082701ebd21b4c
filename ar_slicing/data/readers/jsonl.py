"""`.jsonl`, `.jsonl.gz` and `.jsonl.zst` sources: one JSON object per line (the Pile's format)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

from ar_slicing.data.readers.base import (
    _ZSTD_CHUNK,
    Document,
    ReadStats,
    _BadRecords,
    clean_text,
    decode_utf8,
    pile_subset,
)
from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import json_error

log = logging.getLogger(__name__)


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
