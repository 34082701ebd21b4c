"""Joining Parquet parts byte-wise: the result must read back as the parts' rows, in order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ar_slicing.algorithms.counts.parquet_concat import (
    ParquetConcat,
    ParquetFormatError,
    decode_struct,
    encode_struct,
    key_value_metadata,
    read_footer,
)

SCHEMA = pa.schema([("a", pa.int32()), ("b", pa.int64()), ("s", pa.string())])


def write_part(path, n_rows, start, *, row_group_size=7, meta=None, **options):
    """A part of `n_rows` rows numbered from `start`, in row groups of `row_group_size`."""
    a = np.arange(start, start + n_rows, dtype=np.int32)
    table = pa.table(
        [pa.array(a), pa.array(a.astype(np.int64) * 3), pa.array([f"r{x}" for x in a])],
        schema=SCHEMA,
    )
    with pq.ParquetWriter(path, SCHEMA, **options) as writer:
        if n_rows:
            writer.write_table(table, row_group_size=row_group_size)
        if meta:
            writer.add_key_value_metadata(meta)
    return table


@pytest.mark.parametrize(
    "options",
    [
        {},  # dictionaries + snappy: dictionary page offsets must move too
        {
            "compression": "none",
            "use_dictionary": False,
            "column_encoding": {"a": "DELTA_BINARY_PACKED"},
        },
        {"write_page_index": True},  # column and offset indexes live outside the chunks
    ],
)
def test_concatenation_reads_back_as_the_parts_in_order(tmp_path, options):
    sizes = [20, 0, 1, 33]
    tables, start = [], 0
    for i, n in enumerate(sizes):
        tables.append(
            write_part(tmp_path / f"p{i}.parquet", n, start, meta={"part": str(i)}, **options)
        )
        start += n
    out = tmp_path / "all.parquet"
    with open(out, "wb") as sink:
        concat = ParquetConcat(sink)
        seen = [key_value_metadata(concat.append(tmp_path / f"p{i}.parquet")) for i in range(4)]
        assert concat.finish(drop_metadata={"part"}) == sum(sizes)
    assert [m[b"part"] for m in seen] == [b"0", b"1", b"2", b"3"]
    expected = pa.concat_tables(tables)
    got = pq.read_table(out)
    assert got.schema.remove_metadata() == SCHEMA and got.equals(expected)
    meta = pq.read_metadata(out)
    assert meta.num_rows == sum(sizes)
    assert meta.num_row_groups == 3 + 0 + 1 + 5
    assert b"part" not in meta.metadata and b"ARROW:schema" in meta.metadata
    # every row group readable on its own (its offsets point at its own bytes)
    f = pq.ParquetFile(out)
    rows = [f.read_row_group(i).column("a").to_pylist() for i in range(f.num_row_groups)]
    assert sum(rows, []) == list(range(sum(sizes)))
    assert f.read_row_group(3).column("a").to_pylist() == [20]
    if options.get("write_page_index"):
        # each column and offset index, found through the new footer, is its part's own
        merged, _ = read_footer(out)
        data = out.read_bytes()
        moved = [cc for rg in merged[4][1][1] for cc in rg[1][1][1]]
        originals = []
        for i in range(4):
            footer, _ = read_footer(tmp_path / f"p{i}.parquet")
            part = (tmp_path / f"p{i}.parquet").read_bytes()
            for rg in footer.get(4, (None, (None, [])))[1][1]:
                originals += [(cc, part) for cc in rg[1][1][1]]
        assert len(moved) == len(originals) == 3 * 9
        for cc, (old, part) in zip(moved, originals):
            for offset, length in ((4, 5), (6, 7)):  # offset index, column index
                at, n = cc[offset][1], cc[length][1]
                assert data[at : at + n] == part[old[offset][1] : old[offset][1] + n]


def test_footer_codec_round_trips_a_real_footer(tmp_path):
    write_part(tmp_path / "p.parquet", 30, 0, meta={"k": "v"})
    footer, start = read_footer(tmp_path / "p.parquet")
    raw = (tmp_path / "p.parquet").read_bytes()[start:-8]
    assert encode_struct(decode_struct(raw)) == raw
    assert encode_struct(footer) == raw
    assert key_value_metadata(footer)[b"k"] == b"v"


def test_parts_of_different_schemas_or_not_parquet_are_refused(tmp_path):
    write_part(tmp_path / "p.parquet", 5, 0)
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "other.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really PAR1")
    with open(tmp_path / "out.parquet", "wb") as sink:
        concat = ParquetConcat(sink)
        concat.append(tmp_path / "p.parquet")
        with pytest.raises(ParquetFormatError, match="schema differs"):
            concat.append(tmp_path / "other.parquet")
        with pytest.raises(ParquetFormatError):
            concat.append(tmp_path / "junk.parquet")
    with open(tmp_path / "none.parquet", "wb") as sink, pytest.raises(ParquetFormatError):
        ParquetConcat(sink).finish()


def test_join_without_sendfile_copies_the_same_bytes(tmp_path, monkeypatch):
    for i in range(3):
        write_part(tmp_path / f"p{i}.parquet", 40, 40 * i)

    def join(name):
        with open(tmp_path / name, "wb") as sink:
            concat = ParquetConcat(sink)
            for i in range(3):
                concat.append(tmp_path / f"p{i}.parquet")
            concat.finish()
        return (tmp_path / name).read_bytes()

    fast = join("fast.parquet")
    monkeypatch.delattr("os.sendfile")
    assert join("slow.parquet") == fast
    assert pq.read_table(tmp_path / "slow.parquet").column("a").to_pylist() == list(range(120))
