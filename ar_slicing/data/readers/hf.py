"""Hugging Face datasets (`hf://OWNER/NAME[/CONFIG][@SPLIT]` or a local dataset), streamed."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from ar_slicing.data.readers.base import (
    HF_PREFIX,
    Document,
    ReadStats,
    _BadRecords,
    clean_text,
    pile_subset,
)
from ar_slicing.errors import ArSliceError, BadInput

log = logging.getLogger(__name__)

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
            from ar_slicing.machinery import hub

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
