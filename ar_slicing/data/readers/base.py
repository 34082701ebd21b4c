"""What every corpus reader shares: the document record, the read statistics, the bad-record
policy and the text clean-up (invalid UTF-8, lone surrogates)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from ar_slicing.errors import BadInput

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


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


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
