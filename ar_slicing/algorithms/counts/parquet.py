"""bigrams.parquet: its schema, the Parquet part each reduce task encodes, and the join of parts.

The parts' encoded row groups are copied into bigrams.parquet as they are and one footer lists
them all (`parquet_concat`), so the driver's share of the write is byte copies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Rows per Parquet row group of bigrams.parquet (readers can stream it group by group).
ROW_GROUP_ROWS = 1 << 21


def bigrams_schema():
    """prev int32, next int32, count int64 (docs/design.md "Counts")."""
    import pyarrow as pa

    return pa.schema([("prev", pa.int32()), ("next", pa.int32()), ("count", pa.int64())])


# a part's total pairs, kept in its key/value metadata (and left out of bigrams.parquet)
PART_PAIRS_KEY = "arslice.part_pairs"


def write_bigrams_part(path: str | Path, keys: np.ndarray, counts: np.ndarray, shift: int) -> int:
    """Sorted (keys, counts) -> one Parquet part of bigrams.parquet, written atomically.

    Row groups of ROW_GROUP_ROWS rows, explicit schema. Returns the part's total pairs.
    """
    return write_bigrams_batches(path, [(keys, counts)], shift)


def write_bigrams_batches(path: str | Path, batches, shift: int) -> int:
    """`write_bigrams_part` of (keys, counts) batches that follow one another in key order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = bigrams_schema()
    mask = (1 << shift) - 1
    total = 0
    from ar_slicing.machinery.io import atomic_path

    with atomic_path(path) as tmp:
        # an open file, not a path: pyarrow would read "row:5/..." as a URI scheme
        with (
            open(tmp, "wb") as sink,
            pq.ParquetWriter(
                sink,
                schema,
                # No dictionaries: most (next, count) values are distinct or tiny, and building
                # dictionaries doubled the write time. Deltas on every column instead: `prev` is
                # sorted, `next` ascends within a `prev` and counts are mostly tiny, so delta bit
                # packing alone is ~3.4x smaller than snappy over plain and needs no compression
                # pass: faster to write and to read back.
                compression="none",
                use_dictionary=False,
                column_encoding={
                    "prev": "DELTA_BINARY_PACKED",
                    "next": "DELTA_BINARY_PACKED",
                    "count": "DELTA_BINARY_PACKED",
                },
                write_page_index=False,
            ) as writer,
        ):
            for keys, counts in batches:
                for a in range(0, keys.size, ROW_GROUP_ROWS):
                    k = keys[a : a + ROW_GROUP_ROWS]
                    c = np.ascontiguousarray(counts[a : a + ROW_GROUP_ROWS], dtype=np.int64)
                    prev = (k >> k.dtype.type(shift)).astype(np.int32)
                    nxt = (k & k.dtype.type(mask)).astype(np.int32)
                    columns = [_arrow_view(x, f.type) for x, f in zip((prev, nxt, c), schema)]
                    writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
                    total += int(c.sum())
            writer.add_key_value_metadata({PART_PAIRS_KEY: str(total)})
    return total


def _arrow_view(values: np.ndarray, arrow_type):
    """A contiguous numpy array as an Arrow array without copying. Not `pa.array`: its first
    call imports pandas (0.2 s, paid again in every fresh worker process)."""
    import pyarrow as pa

    return pa.Array.from_buffers(arrow_type, values.size, [None, pa.py_buffer(values)])


def write_bigrams(path: str | Path, parts) -> tuple[int, int]:
    """Parquet parts (paths, in key order) -> bigrams.parquet. Returns (distinct, total pairs).

    The parts' encoded row groups are copied as they are and one footer lists them all
    (`parquet_concat`): the driver's share of the write is byte copies.
    """
    from ar_slicing.algorithms.counts.parquet_concat import ParquetConcat, key_value_metadata
    from ar_slicing.machinery.io import atomic_path

    total = 0
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as sink:
            concat = ParquetConcat(sink)
            for part in parts:
                footer = concat.append(part)
                total += int(key_value_metadata(footer)[PART_PAIRS_KEY.encode()])
            distinct = concat.finish(drop_metadata={PART_PAIRS_KEY})
    return distinct, total
