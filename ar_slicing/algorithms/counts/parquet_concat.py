"""Concatenate Parquet files of one schema into one file without decoding them.

A Parquet file is `PAR1`, column chunks, a footer (Thrift-encoded `FileMetaData`), the footer's
length and `PAR1`. Pages hold no absolute file positions, so the chunks of files written with
the same schema can be copied one after another unchanged; only the footer is rebuilt: every
row group of every part, with its file offsets shifted by where its bytes now start. The count
stage uses this so that its reduce tasks encode their ranges in parallel and the driver only
copies bytes (pyarrow can write and read row groups, but not move encoded ones between files).

    concat = ParquetConcat(out_file)       # an open binary file, positioned at 0
    for part in parts:                     # in order
        concat.append(part)
    concat.finish(drop_metadata={"key"})   # the footer; returns the rows written

The Thrift compact protocol codec below reads and writes any struct generically (unknown
fields are kept as they are), so fields added by newer writers survive the round trip.
Encrypted files are refused.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

MAGIC = b"PAR1"

# Thrift compact protocol type ids
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
_UUID = 13

# field ids of the parquet.thrift structs touched here
_FMD_NUM_ROWS, _FMD_ROW_GROUPS, _FMD_KEY_VALUE = 3, 4, 5
_FMD_ENCRYPTION = 8
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_OFFSET, _CC_META = 2, 3
_CC_OFFSETS = (4, 6)  # offset_index_offset, column_index_offset
_CMD_OFFSETS = (9, 10, 11, 14)  # data_page, index_page, dictionary_page, bloom_filter offsets


class ParquetFormatError(ValueError):
    """A file that is not a (supported) Parquet file, or parts that do not fit together."""


# ---- Thrift compact protocol ------------------------------------------------------------------
# A struct is a dict {field id: (type, value)} in the order read; a list is (element type, [...]);
# a map is (key type, value type, [(k, v), ...]); bools in fields are their type (_TRUE/_FALSE)
# with value None, bools in containers their raw byte.


class _Reader:
    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def byte(self) -> int:
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def raw(self, n: int) -> bytes:
        out = self.buf[self.pos : self.pos + n]
        if len(out) != n:
            raise ParquetFormatError("truncated Parquet footer")
        self.pos += n
        return out

    def value(self, t: int):
        if t in (_TRUE, _FALSE):  # only inside containers: one byte
            return self.byte()
        if t == _BYTE:
            return self.byte()
        if t in (_I16, _I32, _I64):
            return self.zigzag()
        if t == _DOUBLE:
            return self.raw(8)
        if t == _BINARY:
            return self.raw(self.varint())
        if t == _UUID:
            return self.raw(16)
        if t in (_LIST, _SET):
            head = self.byte()
            size, et = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return (et, [self.value(et) for _ in range(size)])
        if t == _MAP:
            size = self.varint()
            if not size:
                return (0, 0, [])
            kv = self.byte()
            kt, vt = kv >> 4, kv & 0x0F
            return (kt, vt, [(self.value(kt), self.value(vt)) for _ in range(size)])
        if t == _STRUCT:
            return self.struct()
        raise ParquetFormatError(f"unknown Thrift type {t} in Parquet footer")

    def struct(self) -> dict:
        fields = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            t = head & 0x0F
            delta = head >> 4
            fid = last + delta if delta else self.zigzag()
            fields[fid] = (t, None) if t in (_TRUE, _FALSE) else (t, self.value(t))
            last = fid


class _Writer:
    def __init__(self):
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while n > 0x7F:
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7
        self.out.append(n)

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, t: int, v) -> None:
        if t in (_TRUE, _FALSE, _BYTE):
            self.out.append(v)
        elif t in (_I16, _I32, _I64):
            self.zigzag(v)
        elif t in (_DOUBLE, _UUID):
            self.out += v
        elif t == _BINARY:
            self.varint(len(v))
            self.out += v
        elif t in (_LIST, _SET):
            et, items = v
            if len(items) < 15:
                self.out.append(len(items) << 4 | et)
            else:
                self.out.append(0xF0 | et)
                self.varint(len(items))
            for item in items:
                self.value(et, item)
        elif t == _MAP:
            kt, vt, items = v
            self.varint(len(items))
            if items:
                self.out.append(kt << 4 | vt)
                for k, x in items:
                    self.value(kt, k)
                    self.value(vt, x)
        elif t == _STRUCT:
            self.struct(v)
        else:
            raise ParquetFormatError(f"unknown Thrift type {t}")

    def struct(self, fields: dict) -> None:
        last = 0
        for fid, (t, v) in fields.items():
            if 0 < fid - last <= 15:
                self.out.append((fid - last) << 4 | t)
            else:
                self.out.append(t)
                self.zigzag(fid)
            if t not in (_TRUE, _FALSE):
                self.value(t, v)
            last = fid
        self.out.append(0)


def decode_struct(buf: bytes) -> dict:
    return _Reader(buf).struct()


def encode_struct(fields: dict) -> bytes:
    w = _Writer()
    w.struct(fields)
    return bytes(w.out)


# ---- footers ----------------------------------------------------------------------------------


def read_footer(path: str | Path) -> tuple[dict, int]:
    """(FileMetaData as a Thrift struct, byte position where the footer starts) of one file."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise ParquetFormatError(f"{path}: too short to be a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        (length,) = struct.unpack("<I", tail[:4])
        if tail[4:] != MAGIC or length > size - 12:
            raise ParquetFormatError(f"{path}: not a Parquet file (or an encrypted one)")
        start = size - 8 - length
        f.seek(start)
        footer = decode_struct(f.read(length))
        f.seek(0)
        if f.read(4) != MAGIC:
            raise ParquetFormatError(f"{path}: not a Parquet file")
    if _FMD_ENCRYPTION in footer:
        raise ParquetFormatError(f"{path}: encrypted Parquet files cannot be concatenated")
    return footer, start


def _shifted(fields: dict, ids, delta: int) -> dict:
    """A copy of a struct with the i64 offsets among `ids` moved by `delta` (0 = unset: kept)."""
    out = dict(fields)
    for fid in ids:
        if fid in out and out[fid][1]:
            t, v = out[fid]
            out[fid] = (t, v + delta)
    return out


def _shift_row_group(rg: dict, delta: int, ordinal: int) -> dict:
    rg = _shifted(rg, (_RG_FILE_OFFSET,), delta)
    et, columns = rg[_RG_COLUMNS][1]
    moved = []
    for cc in columns:
        cc = _shifted(cc, (_CC_FILE_OFFSET, *_CC_OFFSETS), delta)
        if _CC_META in cc:
            cc[_CC_META] = (_STRUCT, _shifted(cc[_CC_META][1], _CMD_OFFSETS, delta))
        moved.append(cc)
    rg[_RG_COLUMNS] = (_LIST, (et, moved))
    if _RG_ORDINAL in rg:
        rg[_RG_ORDINAL] = (_I16, ordinal)
    return rg


def key_value_metadata(footer: dict) -> dict[bytes, bytes | None]:
    """The file's key/value metadata (KeyValue structs: 1 key, 2 value)."""
    if _FMD_KEY_VALUE not in footer:
        return {}
    return {kv[1][1]: kv.get(2, (None, None))[1] for kv in footer[_FMD_KEY_VALUE][1][1]}


def num_rows(footer: dict) -> int:
    return footer[_FMD_NUM_ROWS][1]


# ---- concatenation ----------------------------------------------------------------------------


def _copy_range(src, dst, offset: int, count: int) -> None:
    """Copy src[offset:offset+count] to dst's current position (in the kernel where it can)."""
    dst.flush()
    done = 0
    sendfile = getattr(os, "sendfile", None)  # not on Windows
    try:
        while sendfile is not None and done < count:
            n = sendfile(dst.fileno(), src.fileno(), offset + done, count - done)
            if n == 0:
                break
            done += n
    except OSError:
        pass  # not supported between these files (macOS: sockets only): copy in user space
    if done:
        dst.seek(0, os.SEEK_END)
    src.seek(offset + done)
    while done < count:
        chunk = src.read(min(1 << 24, count - done))
        if not chunk:
            raise ParquetFormatError(f"{src.name}: shorter than its footer says")
        dst.write(chunk)
        done += len(chunk)


class ParquetConcat:
    """Builds one Parquet file from parts appended in order (see the module docstring)."""

    def __init__(self, out):
        self.out = out
        self.out.write(MAGIC)
        self.pos = len(MAGIC)
        self.first: dict | None = None
        self.schema = None
        self.row_groups: list[dict] = []
        self.rows = 0

    def append(self, path: str | Path) -> dict:
        """Copy one part's row groups; returns its footer (for its key/value metadata)."""
        footer, footer_start = read_footer(path)
        schema = footer[2]
        if self.first is None:
            self.first, self.schema = footer, schema
        elif schema != self.schema:
            raise ParquetFormatError(f"{path}: its schema differs from the first part's")
        data = footer_start - len(MAGIC)
        with open(path, "rb") as src:
            _copy_range(src, self.out, len(MAGIC), data)
        delta = self.pos - len(MAGIC)
        if _FMD_ROW_GROUPS in footer:
            for rg in footer[_FMD_ROW_GROUPS][1][1]:
                self.row_groups.append(_shift_row_group(rg, delta, len(self.row_groups)))
        self.rows += num_rows(footer)
        self.pos += data
        return footer

    def finish(self, drop_metadata=()) -> int:
        """Write the footer (the first part's, with every row group, minus the `drop_metadata`
        keys). Returns the number of rows."""
        if self.first is None:
            raise ParquetFormatError("no Parquet parts to concatenate")
        footer = dict(self.first)
        footer[_FMD_NUM_ROWS] = (_I64, self.rows)
        footer[_FMD_ROW_GROUPS] = (_LIST, (_STRUCT, self.row_groups))
        if _FMD_KEY_VALUE in footer:
            et, kvs = footer[_FMD_KEY_VALUE][1]
            keep = [kv for kv in kvs if kv[1][1] not in {k.encode() for k in drop_metadata}]
            if keep:
                footer[_FMD_KEY_VALUE] = (_LIST, (et, keep))
            else:
                del footer[_FMD_KEY_VALUE]
        # fields must be written in ascending id order for readers that expect it
        body = encode_struct(dict(sorted(footer.items())))
        self.out.write(body)
        self.out.write(struct.pack("<I", len(body)))
        self.out.write(MAGIC)
        return self.rows
