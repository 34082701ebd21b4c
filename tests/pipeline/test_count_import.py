"""`arslice count --import`: published counts (Parquet id0, id1, count) as a counts directory."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ar_slicing.algorithms.counts import BigramCounts
from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import read_json
from pipeline.count import count_stores
from pipeline.count_import import import_counts
from tests import FIXTURES

# Confirm-Labs/pile_bigrams' schema
SCHEMA = pa.schema([("id0", pa.uint16()), ("id1", pa.uint16()), ("count", pa.uint32())])
# files of that dataset's schema and names, made as theirs were (make_pile_bigrams.py there)
CONFIRM_LABS = FIXTURES / "confirm_labs"


def published(path, rows, schema=SCHEMA, row_group_size=50):
    """A Parquet file of (id0, id1, count) rows in the given (unsorted) order."""
    columns = list(zip(*rows)) if rows else [[], [], []]
    table = pa.table([pa.array(c, f.type) for c, f in zip(columns, schema)], schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def rows_of(out):
    with open(out / "bigrams.parquet", "rb") as f:
        t = pq.read_table(f)
    return list(zip(*(t.column(c).to_pylist() for c in ("prev", "next", "count"))))


def test_import_equals_the_count_it_was_exported_from(
    tmp_path, bpe_tokenizer, bpe_tokenizer_path, stdlib_texts
):
    """Counts of real text, exported in the published schema, shuffled and split over files,
    import back to the same bigrams.parquet rows, with the tokenizer's fingerprint."""
    from ar_slicing.data.store import write_token_store
    from ar_slicing.data.tokenizer import describe

    info = describe(bpe_tokenizer, "stdlib-bpe")
    docs = [e.ids for e in bpe_tokenizer.encode_batch(stdlib_texts[:10])]
    store = write_token_store(tmp_path / "s", docs, tokenizer_info=info)
    counted = count_stores([store.path], tmp_path / "counted", unit="row:2048", progress=False)
    rows = rows_of(tmp_path / "counted")
    shuffled = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    files = [
        published(tmp_path / f"part-{k}.parquet", shuffled[k::3], row_group_size=97)
        for k in range(3)
    ]
    meta = import_counts(
        files,
        tmp_path / "imported",
        tokenizer=str(bpe_tokenizer_path),
        unit="row:2048",
        workers=2,
        progress=False,
    )
    assert rows_of(tmp_path / "imported") == rows  # sorted by (prev, next), same counts
    assert meta["fingerprint"] == info["fingerprint"] == counted["fingerprint"]
    assert meta["total_pairs"] == counted["total_pairs"]
    assert meta["distinct_bigrams"] == counted["distinct_bigrams"] == len(rows)
    assert meta["unit"] == "row:2048" and meta["imported"]["format"] == "id0, id1, count"
    assert [s["path"] for s in meta["sources"]] == [str(f.resolve()) for f in files]
    assert read_json(tmp_path / "imported" / "meta.json") == meta
    assert not (tmp_path / "imported" / ".work").exists()
    counts = BigramCounts.open(tmp_path / "imported")
    p, q, c = rows[len(rows) // 2]
    assert counts.lookup(np.array([p, 0]), np.array([q, 0]))[0] == c


def test_import_reads_confirm_labs_files(tmp_path, bpe_tokenizer_path):
    """Shards of Confirm-Labs/pile_bigrams' schema and names (uint16 ids, uint32 counts, rows in
    no order, `datasets`' schema metadata) import to exactly the pairs inside the 2048-token rows
    they were counted from."""
    files = sorted((CONFIRM_LABS / "data").glob("bigrams-*-of-*.parquet"))
    assert [f.name[: len("bigrams-00000-of-00002")] for f in files] == [
        "bigrams-00000-of-00002",
        "bigrams-00001-of-00002",
    ]
    assert all(pq.read_schema(f).remove_metadata() == SCHEMA for f in files)
    ids = np.fromfile(CONFIRM_LABS / "rows.bin", dtype="<u2").reshape(-1, 2048)
    want = Counter((int(a), int(b)) for row in ids for a, b in zip(row[:-1], row[1:]))
    out = tmp_path / "c"
    tokenizer = str(bpe_tokenizer_path)
    meta = import_counts(files, out, tokenizer=tokenizer, unit="row:2048", progress=False)
    assert rows_of(out) == sorted((a, b, n) for (a, b), n in want.items())
    assert meta["total_pairs"] == sum(want.values()) == ids.shape[0] * 2047
    assert meta["distinct_bigrams"] == len(want)
    assert [s["path"] for s in meta["sources"]] == [str(f.resolve()) for f in files]


def test_cli_import(tmp_path, bpe_tokenizer_path, capsys):
    from pipeline.cli import main

    f = published(tmp_path / "b.parquet", [(5, 6, 3), (1, 2, 1), (5, 1, 2)])
    args = [
        "count",
        "--import",
        str(f),
        "--tokenizer",
        str(bpe_tokenizer_path),
        "--out",
        str(tmp_path / "c"),
    ]
    assert main([*args, "--unit", "row:2048"]) == 0
    assert (
        "6 pairs, 3 distinct bigrams (unit row:2048) imported from 1 file(s)"
        in capsys.readouterr().out
    )
    assert rows_of(tmp_path / "c") == [(1, 2, 1), (5, 1, 2), (5, 6, 3)]
    # a rerun says the count is complete, in the words of every stage, and imports nothing
    assert main([*args, "--unit", "row:2048"]) == 0
    out = capsys.readouterr().out
    assert f"count: {tmp_path / 'c'} is complete (6 pairs); skipped (--overwrite to redo)" in out
    assert "imported from" not in out
    assert main([*args[:-1], str(tmp_path / "d")]) == 2  # no --unit: the unit must be stated
    assert "--unit" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rows, schema, message",
    [
        (
            [(1, 2, 3), (-1, 2, 1)],
            pa.schema([("id0", pa.int32()), ("id1", pa.int32()), ("count", pa.int64())]),
            "id0 -1 is outside",
        ),
        ([(1, 2, 3), (7, 5000, 1)], None, "id1 5000 is outside the tokenizer's vocabulary 0..1023"),
        ([(1, 2, 3), (4, 4, 1), (1, 2, 5)], None, r"the pair \(1, 2\) is listed 2 times"),
        ([(1, 2, 3), (4, 4, 0)], None, "count 0"),
        ([(1, 2, None)], None, "null value"),
    ],
)
def test_bad_published_rows_are_refused(tmp_path, bpe_tokenizer_path, rows, schema, message):
    f = published(tmp_path / "bad.parquet", rows, schema or SCHEMA)
    with pytest.raises(BadInput, match=message) as e:
        import_counts(
            [f], tmp_path / "c", tokenizer=str(bpe_tokenizer_path), unit="stream", progress=False
        )
    assert str(f) in str(e.value)
    assert not (tmp_path / "c" / "meta.json").exists()


def test_pair_listed_in_two_files_is_refused(tmp_path, bpe_tokenizer_path):
    a = published(tmp_path / "a.parquet", [(1, 2, 3), (9, 9, 1)])
    b = published(tmp_path / "b.parquet", [(4, 4, 1), (9, 9, 7)])
    with pytest.raises(BadInput, match=r"\(9, 9\) is listed more than once") as e:
        import_counts(
            [a, b], tmp_path / "c", tokenizer=str(bpe_tokenizer_path), unit="stream", progress=False
        )
    assert str(a.resolve()) in str(e.value) and str(b.resolve()) in str(e.value)
    assert not (tmp_path / "c" / "bigrams.parquet").exists()
    assert not (tmp_path / "c" / "meta.json").exists()


def test_files_that_are_not_published_counts_are_refused(tmp_path, bpe_tokenizer_path):
    kw = dict(tokenizer=str(bpe_tokenizer_path), unit="stream", progress=False)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"prev": [1], "next": [2], "count": [3]}), other)
    with pytest.raises(BadInput, match="no column.*id0, id1.*it has prev, next, count"):
        import_counts([other], tmp_path / "c", **kw)
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet")
    with pytest.raises(BadInput, match="not a readable Parquet file"):
        import_counts([text], tmp_path / "c", **kw)
    with pytest.raises(BadInput, match="no such file"):
        import_counts([tmp_path / "missing.parquet"], tmp_path / "c", **kw)
    with pytest.raises(BadInput, match="--tokenizer"):
        import_counts([other], tmp_path / "c", tokenizer=None, unit="stream")
