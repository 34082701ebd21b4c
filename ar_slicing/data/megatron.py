"""Pre-tokenized imports: Megatron / GPT-NeoX `.bin` + `.idx` (the Pythia pre-tokenized Pile) and raw
uint16/uint32 token files, read without re-tokenizing.

`.idx` layout (little-endian; Megatron-LM `indexed_dataset.py`, GPT-NeoX `mmap_dataset.py`):

    magic        9 bytes  b"MMIDIDX\\x00\\x00"
    version      u64      1
    dtype code   u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6, 7 are floats)
    n_sequences  u64      N
    n_doc_index  u64      D
    sizes        int32[N] tokens per sequence
    pointers     int64[N] byte offset of each sequence in the .bin
    doc_idx      int64[D] sequence index where each document starts; doc_idx[-1] == N

The `.bin` holds the sequences back to back. Pythia's data already carries its EOD tokens (in
2049-token rows, one row per "document"), so an import keeps the stream exactly as it is: the
store's documents are the idx's documents and nothing is appended (`eos_appended: false`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ar_slicing.errors import BadInput

MAGIC = b"MMIDIDX\x00\x00"
SUPPORTED_VERSION = 1
# Megatron's integer dtype codes; 6 and 7 are float32/float64, never token ids.
DTYPE_CODES = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    8: np.dtype("<u2"),
}
RAW_FORMATS = {"raw-uint16": np.dtype("<u2"), "raw-uint32": np.dtype("<u4")}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n_sequences, n_doc_index


@dataclass(frozen=True)
class MegatronIndex:
    path: Path
    dtype: np.dtype
    sizes: np.ndarray  # int32[N]
    pointers: np.ndarray  # int64[N]
    doc_idx: np.ndarray  # int64[D]

    @property
    def n_sequences(self) -> int:
        return int(self.sizes.size)

    @property
    def n_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())


def idx_path_for(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".idx")


def bin_path_for(path: str | Path) -> Path:
    """The `.bin` a source names: `X.bin` itself, or the `X.bin` beside `X.idx`."""
    path = Path(path)
    return path.with_suffix(".bin") if path.suffix == ".idx" else path


def read_index(path: str | Path) -> MegatronIndex:
    """Parse and check a Megatron `.idx` file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from None
    if len(data) < _HEADER.size:
        raise BadInput(
            f"{path}: {len(data)} bytes, too short for a Megatron index header ({_HEADER.size})"
        )
    magic, version, code, n_seq, n_doc = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadInput(
            f"{path}: wrong magic {magic!r} at byte 0 (expected {MAGIC!r}); not a Megatron/GPT-NeoX "
            "mmap index. For a headerless token file pass --source-format raw-uint16|raw-uint32"
        )
    if version != SUPPORTED_VERSION:
        raise BadInput(
            f"{path}: index version {version} at byte 9; only version {SUPPORTED_VERSION} is known"
        )
    if code not in DTYPE_CODES:
        raise BadInput(
            f"{path}: dtype code {code} at byte 17 is not an integer token type (known: "
            + ", ".join(f"{c}={d.name}" for c, d in DTYPE_CODES.items())
            + "); the file is corrupt or not a token index"
        )
    need = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if len(data) != need:
        raise BadInput(
            f"{path}: {len(data)} bytes but the header ({n_seq} sequences, {n_doc} doc-index "
            f"entries) needs exactly {need}; the index is truncated or corrupt"
        )
    off = _HEADER.size
    sizes = np.frombuffer(data, "<i4", n_seq, off)
    off += 4 * n_seq
    pointers = np.frombuffer(data, "<i8", n_seq, off)
    off += 8 * n_seq
    doc_idx = np.frombuffer(data, "<i8", n_doc, off)
    if (sizes < 0).any():
        raise BadInput(f"{path}: negative sequence size at sequence {int(np.argmax(sizes < 0))}")
    if n_doc and (doc_idx[0] != 0 or doc_idx[-1] != n_seq or (np.diff(doc_idx) < 0).any()):
        raise BadInput(
            f"{path}: doc_idx must rise from 0 to the sequence count {n_seq} "
            f"(starts {int(doc_idx[0])}, ends {int(doc_idx[-1])})"
        )
    return MegatronIndex(path, DTYPE_CODES[code], sizes, pointers, doc_idx)


def check_bin(index: MegatronIndex, bin_path: Path) -> None:
    """Every sequence of `index` lies inside `bin_path`."""
    if not bin_path.is_file():
        raise BadInput(f"{bin_path}: no such file (the data file beside {index.path})")
    size = bin_path.stat().st_size
    item = index.dtype.itemsize
    ends = index.pointers + index.sizes.astype(np.int64) * item
    if index.n_sequences and (index.pointers < 0).any():
        raise BadInput(
            f"{index.path}: negative pointer at sequence {int(np.argmax(index.pointers < 0))}"
        )
    if index.n_sequences and ends.max() > size:
        bad = int(np.argmax(ends > size))
        raise BadInput(
            f"{bin_path}: {size} bytes, but sequence {bad} of {index.path} ends at byte "
            f"{int(ends[bad])}; the .bin is truncated or belongs to another index"
        )


def megatron_documents(index: MegatronIndex) -> tuple[np.ndarray, np.ndarray]:
    """(offset, n_tokens) of each document in the imported stream (sequences in index order)."""
    seq_starts = np.concatenate([[0], np.cumsum(index.sizes.astype(np.int64))])
    doc_idx = index.doc_idx if index.doc_idx.size else np.array([0, index.n_sequences], np.int64)
    offsets = seq_starts[doc_idx[:-1]]
    lengths = seq_starts[doc_idx[1:]] - offsets
    return offsets, lengths


def read_chunks(path: Path, offset: int, dtype, n: int, chunk_tokens: int):
    """`n` values of `dtype` from byte `offset` of `path`, in chunks of `chunk_tokens`. Read, not
    memory-mapped: the pages of a mapping walked through stay resident, counted against the
    process, until the mapping is closed (the whole file, for a multi-GB import)."""
    with open(path, "rb") as f:
        f.seek(offset)
        for a in range(0, n, chunk_tokens):
            yield np.fromfile(f, dtype=dtype, count=min(chunk_tokens, n - a))


def iter_megatron_chunks(index: MegatronIndex, bin_path: Path, chunk_tokens: int = 1 << 24):
    """The stream's tokens (sequences in index order) in chunks of about `chunk_tokens`."""
    item = index.dtype.itemsize
    sizes = index.sizes.astype(np.int64)
    contiguous = bool(
        index.n_sequences == 0
        or np.array_equal(index.pointers[1:], index.pointers[:-1] + sizes[:-1] * item)
    )
    if contiguous:  # the common case: one straight read of the region the index covers
        start = int(index.pointers[0]) if index.n_sequences else 0
        yield from read_chunks(bin_path, start, index.dtype, int(sizes.sum()), chunk_tokens)
        return
    data = np.memmap(bin_path, dtype=np.uint8, mode="r")
    pending, pending_n = [], 0
    for p, n in zip(index.pointers.tolist(), sizes.tolist()):
        pending.append(np.frombuffer(data[p : p + n * item], dtype=index.dtype))
        pending_n += n
        if pending_n >= chunk_tokens:
            yield np.concatenate(pending)
            pending, pending_n = [], 0
    if pending:
        yield np.concatenate(pending)


def raw_dtype(path: Path, source_format: str) -> np.dtype:
    if source_format not in RAW_FORMATS:
        raise BadInput(
            f"--source-format {source_format!r}: expected one of {', '.join(RAW_FORMATS)} or megatron"
        )
    dtype = RAW_FORMATS[source_format]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise BadInput(
            f"{path}: {size} bytes is not a whole number of {dtype.name} tokens; "
            "is --source-format right?"
        )
    return dtype


def raw_documents(tokens: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(offset, n_tokens) of the documents of a raw stream: each ends with (and includes) an EOS;
    tokens after the last EOS form a final document."""
    ends = np.flatnonzero(tokens == eos_id).astype(np.int64) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    keep = ends > starts
    return starts[keep], (ends - starts)[keep]
