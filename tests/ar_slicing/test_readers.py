"""Corpus readers on real files made here: Pile-style JSON Lines (plain, gzip, zstd), Parquet, text
files and directories, local datasets through `datasets.load_dataset`, and each kind of bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.data.readers import ReadStats, iter_documents, parse_hf_spec, split_part_of
from ar_slicing.errors import BadInput

PILE_RECORDS = [
    {"text": "def f(x):\n    return x + 1\n", "meta": {"pile_set_name": "Github"}},
    {"text": "The quick brown fox.", "meta": {"pile_set_name": "Pile-CC"}},
    {"text": "Ünïcödé ✓ text — with dashes", "meta": {"pile_set_name": "Wikipedia (en)"}},
    {"text": "no meta here"},
]


def jsonl_bytes(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def read_all(sources, **kw):
    stats = ReadStats()
    docs = list(iter_documents([str(s) for s in sources], stats=stats, **kw))
    return docs, stats


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_pile_format(tmp_path, suffix):
    data = jsonl_bytes(PILE_RECORDS)
    if suffix.endswith(".gz"):
        data = gzip.compress(data)
    elif suffix.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = write(tmp_path / f"val{suffix}", data)
    docs, stats = read_all([path])
    assert [d.text for d in docs] == [r["text"] for r in PILE_RECORDS]
    assert [d.subset for d in docs] == ["Github", "Pile-CC", "Wikipedia (en)", None]
    assert {d.source for d in docs} == {str(path)}
    assert [d.key for d in docs] == [f"val{suffix}:{i}" for i in range(1, 5)]
    assert stats.documents == 4
    assert stats.bytes == sum(len(r["text"].encode()) for r in PILE_RECORDS)


def test_zst_of_several_frames_is_read_through(tmp_path):
    # The Pile's own .zst files are one frame, but concatenated shards are common.
    frames = [zstandard.ZstdCompressor().compress(jsonl_bytes([r])) for r in PILE_RECORDS]
    path = write(tmp_path / "multi.jsonl.zst", b"".join(frames))
    docs, _ = read_all([path])
    assert [d.text for d in docs] == [r["text"] for r in PILE_RECORDS]


def test_truncated_zst_is_an_error_naming_the_file(tmp_path, stdlib_texts):
    records = [{"text": t} for t in stdlib_texts[:20]]
    data = zstandard.ZstdCompressor().compress(jsonl_bytes(records))
    path = write(tmp_path / "cut.jsonl.zst", data[: len(data) // 2])
    with pytest.raises(BadInput, match=r"cut\.jsonl\.zst.*truncated"):
        read_all([path])
    # skip mode does not hide a truncated file: its tail is unknowable
    with pytest.raises(BadInput, match="truncated"):
        read_all([path], on_bad_record="skip")


def test_truncated_gzip_is_an_error(tmp_path, stdlib_texts):
    data = gzip.compress(jsonl_bytes([{"text": t} for t in stdlib_texts[:20]]))
    path = write(tmp_path / "cut.jsonl.gz", data[: len(data) // 2])
    with pytest.raises(BadInput, match=r"cut\.jsonl\.gz.*truncated or corrupt"):
        read_all([path])


def test_malformed_json_line_names_file_and_line(tmp_path):
    lines = (
        jsonl_bytes(PILE_RECORDS[:2]) + b'{"text": "unterminated\n' + jsonl_bytes(PILE_RECORDS[2:])
    )
    path = write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(
        BadInput,
        match=r"bad\.jsonl:3 \(byte \d+\): not valid JSON \(Invalid control character at "
        r"column 23\); .*--on-bad-record skip",
    ):
        read_all([path])
    docs, stats = read_all([path], on_bad_record="skip")
    assert [d.text for d in docs] == [r["text"] for r in PILE_RECORDS]
    assert stats.bad_records == 1
    assert "bad.jsonl:3" in stats.bad_examples[0]


def test_byte_offset_in_error_is_where_the_line_starts(tmp_path):
    good = jsonl_bytes(PILE_RECORDS[:2])
    path = write(tmp_path / "bad.jsonl", good + b"not json\n")
    with pytest.raises(BadInput, match=rf"bad\.jsonl:3 \(byte {len(good)}\)"):
        read_all([path])


def test_record_without_text_field(tmp_path):
    path = write(
        tmp_path / "x.jsonl", jsonl_bytes([{"text": "ok"}, {"content": "other field"}, [1, 2]])
    )
    with pytest.raises(
        BadInput, match=r"x\.jsonl:2.*no field 'text' \(fields: content\).*--text-field"
    ):
        read_all([path])
    docs, stats = read_all([path], on_bad_record="skip")
    assert [d.text for d in docs] == ["ok"] and stats.bad_records == 2
    docs, stats = read_all([path], text_field="content", on_bad_record="skip")
    assert [d.text for d in docs] == ["other field"] and stats.bad_records == 2


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    raw = (
        b'{"text": "caf\xe9 bad byte"}\n'
        + b'{"text": "lone \\ud800 surrogate"}\n'
        + b'{"text": "fine"}\n'
    )
    path = write(tmp_path / "u.jsonl", raw)
    docs, stats = read_all([path])
    assert [d.text for d in docs] == ["caf\ufffd bad byte", "lone \ufffd surrogate", "fine"]
    assert stats.invalid_utf8 == 2
    for d in docs:
        d.text.encode("utf-8")  # every text is valid UTF-8 now


def test_empty_documents_are_counted_and_skipped(tmp_path):
    path = write(
        tmp_path / "e.jsonl", jsonl_bytes([{"text": ""}, {"text": "a"}, {"text": ""}]) + b"\n"
    )
    docs, stats = read_all([path])
    assert [d.text for d in docs] == ["a"]
    assert stats.empty == 2 and stats.documents == 1


def test_parquet_text_column_and_pile_meta(tmp_path):
    table = pa.table(
        {
            "content": [r["text"] for r in PILE_RECORDS],
            "meta": [r.get("meta", {"pile_set_name": None}) for r in PILE_RECORDS],
        }
    )
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=2)
    docs, _ = read_all([path], text_field="content")
    assert [d.text for d in docs] == [r["text"] for r in PILE_RECORDS]
    assert [d.subset for d in docs] == ["Github", "Pile-CC", "Wikipedia (en)", None]
    with pytest.raises(BadInput, match=r"d\.parquet: no column 'text' \(columns: content, meta\)"):
        read_all([path])


def test_parquet_null_text_is_a_bad_record(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b"]}), path)
    with pytest.raises(BadInput, match=r"n\.parquet: row 2: column 'text' is null"):
        read_all([path])
    docs, stats = read_all([path], on_bad_record="skip")
    assert [d.text for d in docs] == ["a", "b"] and stats.bad_records == 1


def test_text_files_and_directories(tmp_path, stdlib_texts):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(stdlib_texts[0])
    (root / "sub" / "a.txt").write_text(stdlib_texts[1])
    (root / "a.txt").write_text(stdlib_texts[2])
    (root / "skip.md").write_text("not matched")
    docs, _ = read_all([root])
    assert [d.key for d in docs] == ["a.txt", "b.txt", "sub/a.txt"]  # sorted relative paths
    assert [d.text for d in docs] == [stdlib_texts[2], stdlib_texts[0], stdlib_texts[1]]
    docs, _ = read_all([root], glob="*.md")
    assert [d.text for d in docs] == ["not matched"]
    docs, _ = read_all([root / "b.txt"])
    assert [(d.text, d.key, d.source) for d in docs] == [
        (stdlib_texts[0], "b.txt", str(root / "b.txt"))
    ]
    with pytest.raises(BadInput, match=r"corpus: no files match '\*\*/\*\.py'.*--glob"):
        read_all([root], glob="**/*.py")
    # several patterns: every file any of them matches, once, in one sorted order
    docs, _ = read_all([root], glob=["sub/*.txt", "*.md", "**/a.txt"])
    assert [d.key for d in docs] == ["a.txt", "skip.md", "sub/a.txt"]
    with pytest.raises(BadInput, match=r"no files match \['\*\.py', 'x/\*'\]"):
        read_all([root], glob=["*.py", "x/*"])


def test_unknown_file_type_and_missing_file(tmp_path):
    path = write(tmp_path / "data.xml", b"<doc/>")
    with pytest.raises(BadInput, match=r"data\.xml: unknown file type; supported: \.jsonl"):
        read_all([path])
    with pytest.raises(BadInput, match=r"nope\.jsonl: no such file"):
        read_all([tmp_path / "nope.jsonl"])
    with pytest.raises(BadInput, match=r"pre-tokenized file cannot be mixed"):
        read_all([write(tmp_path / "x.bin", b"\0\0")])


def test_local_dataset_through_load_dataset(tmp_path):
    """`hf://` runs the real datasets.load_dataset (streaming) on a local directory and a file."""
    d = tmp_path / "ds"
    d.mkdir()
    write(d / "part.jsonl", jsonl_bytes(PILE_RECORDS))
    docs, _ = read_all([f"hf://{d}"])
    assert [d_.text for d_ in docs] == [r["text"] for r in PILE_RECORDS]
    assert [d_.subset for d_ in docs] == ["Github", "Pile-CC", "Wikipedia (en)", None]
    assert docs[0].key == "ds:1"
    pq.write_table(pa.table({"body": ["x y", "z"]}), tmp_path / "v.parquet")
    docs, _ = read_all([f"hf://{tmp_path / 'v.parquet'}@validation"], text_field="body")
    assert [d_.text for d_ in docs] == ["x y", "z"]
    with pytest.raises(BadInput, match=r"record 1: no field 'text'"):
        read_all([f"hf://{tmp_path / 'v.parquet'}"])


def test_hub_specs_parse_owner_name_config_and_split():
    assert parse_hf_spec("hf://monology/pile-uncopyrighted") == (
        "monology/pile-uncopyrighted",
        None,
        "train",
    )
    assert parse_hf_spec("hf://monology/pile-uncopyrighted@validation") == (
        "monology/pile-uncopyrighted",
        None,
        "validation",
    )
    assert parse_hf_spec("hf://Salesforce/wikitext/wikitext-103-raw-v1@test") == (
        "Salesforce/wikitext",
        "wikitext-103-raw-v1",
        "test",
    )


def test_split_keeps_complementary_parts(tmp_path, stdlib_texts):
    root = tmp_path / "c"
    root.mkdir()
    for i, t in enumerate(stdlib_texts):
        (root / f"{i:03d}.txt").write_text(t)
    val, _ = read_all([root], split_fraction=0.3, split_part="val")
    train, stats = read_all([root], split_fraction=0.3, split_part="train")
    assert stats.other_split_part == len(val)
    assert sorted(d.key for d in val + train) == sorted(
        f"{i:03d}.txt" for i in range(len(stdlib_texts))
    )
    assert all(split_part_of(d.key, 0.3) == "val" for d in val)
    again, _ = read_all([root], split_fraction=0.3, split_part="val")
    assert [d.key for d in again] == [d.key for d in val]


def test_split_fraction_is_about_right():
    keys = [f"dir/file_{i}.py" for i in range(20_000)]
    share = sum(split_part_of(k, 0.1) == "val" for k in keys) / len(keys)
    assert 0.09 < share < 0.11
    assert all(split_part_of(k, 0.0) == "train" for k in keys[:100])
    assert all(split_part_of(k, 1.0) == "val" for k in keys[:100])


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=40), st.floats(0, 1), st.floats(0, 1))
def test_split_is_monotone_in_the_fraction(key, a, b):
    lo, hi = min(a, b), max(a, b)
    if split_part_of(key, lo) == "val":
        assert split_part_of(key, hi) == "val"


def test_max_docs_stops_early(tmp_path):
    path = write(tmp_path / "m.jsonl", jsonl_bytes([{"text": str(i)} for i in range(10)]))
    docs, _ = read_all([path, path], max_docs=3)
    assert [d.text for d in docs] == ["0", "1", "2"]
    docs, _ = read_all([path, path], max_docs=13)
    assert len(docs) == 13


def test_directory_of_jsonl_shards_is_read_record_by_record(tmp_path):
    root = tmp_path / "pile"
    (root / "train").mkdir(parents=True)
    cctx = zstandard.ZstdCompressor()
    write(root / "train" / "01.jsonl.zst", cctx.compress(jsonl_bytes(PILE_RECORDS[2:])))
    write(root / "train" / "00.jsonl.zst", cctx.compress(jsonl_bytes(PILE_RECORDS[:2])))
    docs, _ = read_all([root], glob="**/*.jsonl.zst")
    assert [d.text for d in docs] == [r["text"] for r in PILE_RECORDS]
    assert [d.subset for d in docs] == ["Github", "Pile-CC", "Wikipedia (en)", None]
    assert [d.key for d in docs] == ["train/00.jsonl.zst:1", "train/00.jsonl.zst:2"] + [
        "train/01.jsonl.zst:1",
        "train/01.jsonl.zst:2",
    ]


def test_corrupt_compressed_files(tmp_path):
    good = gzip.compress(jsonl_bytes(PILE_RECORDS))
    bad_gz = write(tmp_path / "bad.jsonl.gz", good[:12] + bytes(b ^ 0x5A for b in good[12:]))
    with pytest.raises(
        BadInput, match=r"bad\.jsonl\.gz: compressed stream is truncated or corrupt"
    ):
        read_all([bad_gz])
    not_zstd = write(tmp_path / "plain.jsonl.zst", jsonl_bytes(PILE_RECORDS))
    with pytest.raises(
        BadInput, match=r"plain\.jsonl\.zst: corrupt zstd data near compressed byte"
    ):
        read_all([not_zstd])
