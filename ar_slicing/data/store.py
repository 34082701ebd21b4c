"""The token store: one flat token stream on disk plus a document table.

Layout of a store directory (see docs/design.md):
  tokens.bin     little-endian uint16 when the vocabulary fits in 2**16 (half the disk and page
                 cache of uint32, as nanoGPT's prepare.py does), else uint32. Documents in order,
                 each followed by the EOS id, so the file is the stream a packed-training model sees.
  docs.parquet   doc_id int64, offset int64, n_tokens int32, source string, subset string (nullable)
                 `offset` is the stream index of the document's first token; `n_tokens` excludes
                 the EOS appended after it (imported stores keep their stream as it is and set
                 `eos_appended: false` in meta.json).
  tokenizer.json the tokenizer, so later stages can decode and check it (absent for raw imports
                 made without one)
  meta.json      written last; `tokenizer` {name, fingerprint, vocab_size, eos_id}, `dtype`,
                 `n_tokens`, `n_docs`, `eos_appended`, plus the common stage fields.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import (
    atomic_path,
    build_meta,
    is_complete,
    read_json,
    sha256_file,
    write_meta,
    write_parquet_atomic,
)
from ar_slicing.machinery.layout import (
    DOCS_NAME,
    TOKENIZER_NAME,
    TOKENS_NAME,
    meta_path,
    require_dir,
)


def docs_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("doc_id", pa.int64()),
            ("offset", pa.int64()),
            ("n_tokens", pa.int32()),
            ("source", pa.string()),
            ("subset", pa.string()),
        ]
    )


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass
class TokenStore:
    """Read-only view of a complete token store (memory-mapped; opening it reads no tokens)."""

    path: Path

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        path = Path(path)
        require_dir(path, "token store")
        if not is_complete(path):
            raise BadInput(
                f"token store {path}: incomplete (no meta.json); rerun `arslice tokenize` to finish it"
            )
        store = cls(path)
        expected = store.n_tokens * store.dtype.itemsize
        actual = (path / TOKENS_NAME).stat().st_size if (path / TOKENS_NAME).is_file() else -1
        if actual != expected:
            raise BadInput(
                f"token store {path}: {TOKENS_NAME} has {actual} bytes but meta.json says "
                f"{store.n_tokens} tokens of {store.dtype} ({expected} bytes); the file is truncated "
                "or replaced — re-create the store with `arslice tokenize --overwrite`"
            )
        return store

    @cached_property
    def meta(self) -> dict:
        return read_json(meta_path(self.path))

    @property
    def tokenizer_info(self) -> dict:
        return self.meta["tokenizer"]

    @property
    def fingerprint(self) -> str:
        return self.tokenizer_info["fingerprint"]

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer_info["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_info["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"]).newbyteorder("<")

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.meta["n_docs"])

    @property
    def eos_appended(self) -> bool:
        return bool(self.meta.get("eos_appended", True))

    @cached_property
    def tokens_sha256(self) -> str:
        """sha256 of tokens.bin: what identifies the stream itself (restricted counts name it)."""
        return sha256_file(self.path / TOKENS_NAME)

    @cached_property
    def tokens(self) -> np.ndarray:
        """The whole stream as a read-only memmap."""
        if self.n_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(
            self.path / TOKENS_NAME, dtype=self.dtype, mode="r", shape=(self.n_tokens,)
        )

    @cached_property
    def docs(self):
        """docs.parquet as a pyarrow Table."""
        import pyarrow.parquet as pq

        if not (self.path / DOCS_NAME).is_file():  # a directory would be read as an empty dataset
            raise BadInput(
                f"token store {self.path}: {DOCS_NAME} is missing or not a file; re-create the "
                "store with `arslice tokenize --overwrite`"
            )
        try:
            return pq.read_table(self.path / DOCS_NAME)
        except Exception as e:
            raise BadInput(f"token store {self.path}: cannot read {DOCS_NAME} ({e})") from None

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        return self.docs.column("offset").to_numpy().astype(np.int64, copy=False)

    @cached_property
    def doc_ids(self) -> np.ndarray:
        return self.docs.column("doc_id").to_numpy().astype(np.int64, copy=False)

    def slice(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.tokens[start:stop])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens start..stop-1 read from the file into a new array: unlike `slice`, nothing of
        the file stays mapped into this process (a pass over a large store does not pile up
        its pages in the process's memory)."""
        start, stop = max(start, 0), min(stop, self.n_tokens)
        if stop <= start:
            return np.zeros(0, self.dtype)
        size = self.dtype.itemsize
        return np.fromfile(
            self.path / TOKENS_NAME, self.dtype, count=stop - start, offset=start * size
        )

    def doc_index_of(self, stream_index: np.ndarray) -> np.ndarray:
        """Row in docs.parquet of the document each stream index belongs to (its EOS included)."""
        return np.searchsorted(self.doc_offsets, stream_index, side="right") - 1

    def iter_documents(self) -> Iterator[tuple[int, np.ndarray]]:
        """(doc_id, tokens without the appended EOS) for every document, in order."""
        n = self.docs.column("n_tokens").to_numpy()
        for doc_id, off, k in zip(self.doc_ids, self.doc_offsets, n):
            yield int(doc_id), np.asarray(self.tokens[off : off + k])

    def load_tokenizer(self):
        from ar_slicing.data.tokenizer import load_tokenizer

        path = self.path / TOKENIZER_NAME
        if not path.is_file():
            raise BadInput(f"token store {self.path}: has no {TOKENIZER_NAME} to decode with")
        return load_tokenizer(path)


def write_token_store(
    out_dir: str | Path,
    documents: Sequence[Sequence[int]],
    *,
    tokenizer_info: dict,
    subsets: Sequence[str | None] | None = None,
    source: str = "memory",
    tokenizer_json: str | None = None,
    config: dict | None = None,
) -> TokenStore:
    """Write a complete store from in-memory documents (EOS appended after each).

    Used by tests and small imports; the tokenize stage streams larger corpora itself.
    `tokenizer_info` is {name, fingerprint, vocab_size, eos_id}.
    """
    import pyarrow as pa

    t0 = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(int(tokenizer_info["vocab_size"]))
    eos = int(tokenizer_info["eos_id"])
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    offsets = (np.cumsum(lengths + 1) - (lengths + 1)).astype(np.int64)  # start of each document
    parts = []
    for d in documents:
        parts.append(np.asarray(d, dtype=np.int64))
        parts.append(np.array([eos], dtype=np.int64))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if stream.size and (stream.min() < 0 or stream.max() >= np.iinfo(dtype).max + 1):
        raise BadInput(f"token ids out of range for {dtype} in documents written to {out_dir}")
    with atomic_path(out_dir / TOKENS_NAME) as tmp:
        stream.astype(dtype).tofile(tmp)
    table = pa.table(
        {
            "doc_id": pa.array(np.arange(len(documents), dtype=np.int64)),
            "offset": pa.array(offsets),
            "n_tokens": pa.array(lengths.astype(np.int32)),
            "source": pa.array([source] * len(documents), pa.string()),
            "subset": pa.array(
                list(subsets) if subsets is not None else [None] * len(documents), pa.string()
            ),
        },
        schema=docs_schema(),
    )
    write_parquet_atomic(out_dir / DOCS_NAME, table)
    if tokenizer_json is not None:
        with atomic_path(out_dir / TOKENIZER_NAME) as tmp:
            tmp.write_text(tokenizer_json)
    meta = build_meta(
        "tokenize",
        config=config or {},
        inputs={"source": source},
        counts={"documents": len(documents), "tokens": int(stream.size)},
        wall_time_s=time.time() - t0,
        tokenizer=tokenizer_info,
        dtype=dtype.name,
        n_tokens=int(stream.size),
        n_docs=len(documents),
        eos_appended=True,
    )
    write_meta(out_dir, meta)
    return TokenStore.open(out_dir)
