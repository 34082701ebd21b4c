"""Parquet sources: one document per row of a text column, streamed by row group."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from ar_slicing.data.readers.base import (
    _PARQUET_BATCH,
    Document,
    ReadStats,
    _BadRecords,
    clean_text,
    decode_utf8,
    pile_subset,
)
from ar_slicing.errors import BadInput

log = logging.getLogger(__name__)


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
