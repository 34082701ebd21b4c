"""Checks of token stores and bigram counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ar_slicing.machinery.layout import (
    BIGRAMS_NAME,
    DOCS_NAME,
    TOKENIZER_NAME,
    TOKENS_NAME,
    meta_path,
)
from pipeline.verify.checks import BATCH_ROWS, Checks


def verify_store(path: Path, checks: Checks, scan_tokens: bool) -> dict | None:
    """Check one token store; returns its meta (None when it could not be read)."""
    import pyarrow.parquet as pq

    from ar_slicing.data.tokenizer import fingerprint, load_tokenizer
    from ar_slicing.machinery.io import read_json

    meta = read_json(meta_path(path))
    n_tokens, dtype = int(meta["n_tokens"]), np.dtype(meta["dtype"]).newbyteorder("<")
    bin_path = path / TOKENS_NAME
    size = bin_path.stat().st_size if bin_path.is_file() else None
    if not checks.check(
        size == n_tokens * dtype.itemsize,
        f"{bin_path}: {n_tokens:,} tokens of {dtype.name}",
        f"file has {size} bytes, meta.json says {n_tokens * dtype.itemsize}",
    ):
        return meta
    try:
        docs = pq.read_table(path / DOCS_NAME, columns=["offset", "n_tokens"])
    except Exception as e:  # pyarrow raises several types for unreadable files
        checks.fail(f"{path / DOCS_NAME}: unreadable ({e})")
        return meta
    offsets = docs.column("offset").to_numpy().astype(np.int64)
    lengths = docs.column("n_tokens").to_numpy().astype(np.int64)
    checks.check(
        docs.num_rows == int(meta["n_docs"]),
        f"{path / DOCS_NAME}: {docs.num_rows:,} documents",
        f"meta.json says {meta['n_docs']}",
    )
    if meta.get("eos_appended", True) and docs.num_rows:
        # Each document is followed by one EOS: the next one starts right after it.
        ends = offsets + lengths + 1
        tiled = offsets[0] == 0 and np.array_equal(offsets[1:], ends[:-1]) and ends[-1] == n_tokens
        checks.check(
            bool(tiled),
            f"{path / DOCS_NAME}: documents and their EOS tile the stream",
            "offsets + n_tokens + 1 do not follow each other up to n_tokens",
        )
    info = meta.get("tokenizer", {})
    if scan_tokens and n_tokens:
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
        top = max(int(tokens[i : i + BATCH_ROWS].max()) for i in range(0, n_tokens, BATCH_ROWS))
        checks.check(
            top < int(info.get("vocab_size", 0)),
            f"{bin_path}: largest id {top} below vocabulary {info.get('vocab_size')}",
            "token ids outside the tokenizer's vocabulary",
        )
    tok_path = path / TOKENIZER_NAME
    if tok_path.is_file():
        actual = fingerprint(load_tokenizer(tok_path))
        checks.check(
            actual == info.get("fingerprint"),
            f"{tok_path}: fingerprint matches meta.json",
            f"file has {actual[:12]}…, meta.json {str(info.get('fingerprint'))[:12]}…",
        )
    return meta


# ---- counts ------------------------------------------------------------------------------------


def verify_counts(path: Path, checks: Checks) -> dict:
    import pyarrow.parquet as pq

    from ar_slicing.machinery.io import read_json

    meta = read_json(meta_path(path))
    bigrams = path / BIGRAMS_NAME
    try:
        pf = pq.ParquetFile(bigrams)
    except Exception as e:
        checks.fail(f"{bigrams}: unreadable ({e})")
        return meta
    total = rows = 0
    last = -1
    ordered = positive = True
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=["prev", "next", "count"]):
        prev = batch.column(0).to_numpy().astype(np.int64)
        nxt = batch.column(1).to_numpy().astype(np.int64)
        count = batch.column(2).to_numpy()
        key = (prev << 32) | nxt  # ids are below 2**32: one int64 orders (prev, next)
        if key.size:
            ordered &= bool(key[0] > last) and bool(np.all(key[1:] > key[:-1]))
            last = int(key[-1])
        positive &= bool(np.all(count > 0))
        total += int(count.sum())
        rows += key.size
    checks.check(ordered, f"{bigrams}: (prev, next) sorted and unique", "keys not increasing")
    checks.check(positive, f"{bigrams}: every count positive", "zero or negative counts")
    checks.check(
        total == int(meta["total_pairs"]),
        f"{bigrams}: counts sum to total_pairs {int(meta['total_pairs']):,}",
        f"they sum to {total:,}",
    )
    checks.check(
        rows == int(meta["distinct_bigrams"]),
        f"{bigrams}: {rows:,} rows = distinct_bigrams",
        f"meta.json says {meta['distinct_bigrams']}",
    )
    return meta
