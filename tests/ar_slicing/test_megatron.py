"""Pre-tokenized imports: Megatron/GPT-NeoX .bin + .idx files written here byte by byte per the format
(header MMIDIDX, version, dtype code, counts, sizes, pointers, doc_idx), and raw uint16/uint32 files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ar_slicing.data.megatron import MAGIC, read_index
from ar_slicing.data.store import TokenStore
from ar_slicing.errors import ArSliceError, BadInput
from pipeline.tokenize import TokenizeConfig, run_tokenize

CODES = {np.dtype("<u2"): 8, np.dtype("<i4"): 4}


def write_megatron(prefix: Path, sequences, doc_idx, dtype="<u2", gap: int = 0, code=None):
    """Write prefix.bin / prefix.idx; `gap` zero bytes between sequences make pointers non-contiguous."""
    dtype = np.dtype(dtype)
    blob, pointers, pos = [], [], 0
    for seq in sequences:
        data = np.asarray(seq, dtype=dtype).tobytes()
        pointers.append(pos)
        blob.append(data + b"\0" * gap)
        pos += len(data) + gap
    prefix.with_suffix(".bin").write_bytes(b"".join(blob))
    sizes = np.array([len(s) for s in sequences], dtype="<i4")
    header = (
        MAGIC + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype] if code is None else code)
    )
    header += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(doc_idx))
    body = (
        sizes.tobytes() + np.array(pointers, "<i8").tobytes() + np.array(doc_idx, "<i8").tobytes()
    )
    prefix.with_suffix(".idx").write_bytes(header + body)
    return prefix.with_suffix(".bin")


def import_store(tmp_path, sources, name="store", **kw):
    kw.setdefault("vocab_size", 50304)
    kw.setdefault("eos_id", 0)
    cfg = TokenizeConfig(source=[str(s) for s in sources], out=str(tmp_path / name), **kw)
    run_tokenize(cfg)
    return TokenStore.open(tmp_path / name)


def test_pythia_style_rows_import_exactly(tmp_path):
    """Pythia's pre-tokenized Pile: uint16, one 2049-token row per index document, EODs inside."""
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 50277, size=(3, 2049)).astype(np.uint16)
    rows[0, 700] = rows[1, 5] = rows[2, 2048] = 0  # EOD tokens where documents ended in the packing
    bin_path = write_megatron(tmp_path / "pile_deduped", list(rows), doc_idx=[0, 1, 2, 3])
    store = import_store(tmp_path, [bin_path])
    assert store.tokens.tolist() == rows.reshape(-1).tolist()  # nothing added, nothing moved
    assert not store.eos_appended and store.eos_id == 0 and store.vocab_size == 50304
    assert store.dtype == np.dtype("<u2")
    docs = store.docs.to_pydict()
    assert docs["offset"] == [0, 2049, 4098] and docs["n_tokens"] == [2049] * 3
    assert docs["source"] == [str(bin_path)] * 3
    assert store.meta["inputs"]["sources"][0]["format"] == "megatron"
    # the same import settings give the same fingerprint, so such stores can be combined
    again = import_store(tmp_path, [tmp_path / "pile_deduped.idx"], name="again")
    assert again.fingerprint == store.fingerprint
    assert (tmp_path / "again" / "tokens.bin").read_bytes() == (
        tmp_path / "store" / "tokens.bin"
    ).read_bytes()


def test_documents_of_several_sequences_with_a_real_tokenizer(
    tmp_path, bpe_tokenizer_path, bpe_tokenizer, stdlib_texts
):
    """int32 data (dtype code 4); documents span 1 or 2 sequences; imported into uint16 ids."""
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    docs = [bpe_tokenizer.encode(t).ids + [eos] for t in stdlib_texts[:3]]
    # split doc 0 and doc 2 into two sequences each
    seqs = [docs[0][:100], docs[0][100:], docs[1], docs[2][:7], docs[2][7:]]
    bin_path = write_megatron(tmp_path / "x", seqs, doc_idx=[0, 2, 3, 5], dtype="<i4")
    store = import_store(
        tmp_path, [bin_path], tokenizer=str(bpe_tokenizer_path), vocab_size=None, eos_id=None
    )
    assert store.dtype == np.dtype("<u2")  # the store's dtype follows the vocabulary, not the file
    assert store.tokens.tolist() == [t for d in docs for t in d]
    lengths = [len(d) for d in docs]
    assert store.docs.column("n_tokens").to_pylist() == lengths
    assert store.docs.column("offset").to_pylist() == [0, lengths[0], lengths[0] + lengths[1]]
    tok = store.load_tokenizer()
    for (_, ids), text in zip(store.iter_documents(), stdlib_texts[:3]):
        assert tok.decode(ids.tolist()) == text  # the trailing EOS is a special token: not decoded
    assert store.fingerprint == TokenStore.open(tmp_path / "store").fingerprint


def test_non_contiguous_sequences_and_two_sources(tmp_path):
    a = write_megatron(tmp_path / "a", [[5, 6, 0], [7, 0]], doc_idx=[0, 1, 2], gap=6)
    b = write_megatron(tmp_path / "b", [[9, 9, 9, 0]], doc_idx=[0, 1])
    store = import_store(tmp_path, [a, b], vocab_size=100)
    assert store.tokens.tolist() == [5, 6, 0, 7, 0, 9, 9, 9, 0]
    assert store.docs.column("offset").to_pylist() == [0, 3, 5]
    assert store.docs.column("source").to_pylist() == [str(a), str(a), str(b)]


def test_empty_index_documents_are_counted_and_skipped(tmp_path):
    path = write_megatron(tmp_path / "e", [[1, 2, 0], [3, 0]], doc_idx=[0, 1, 1, 2])
    store = import_store(tmp_path, [path], vocab_size=10)
    assert store.n_docs == 2 and store.meta["counts"]["empty"] == 1
    assert store.docs.column("offset").to_pylist() == [0, 3]


@pytest.mark.parametrize(("fmt", "dtype"), [("raw-uint16", "<u2"), ("raw-uint32", "<u4")])
def test_raw_token_files(tmp_path, fmt, dtype):
    stream = np.array([4, 5, 2, 6, 2, 2, 7, 8], dtype=dtype)  # EOS = 2; the tail has no EOS
    path = tmp_path / "train.bin"
    stream.tofile(path)
    vocab = 70_000 if dtype == "<u4" else 10
    store = import_store(tmp_path, [path], source_format=fmt, vocab_size=vocab, eos_id=2)
    assert store.tokens.tolist() == stream.tolist()
    assert store.dtype == (np.dtype("<u4") if vocab > 65536 else np.dtype("<u2"))
    assert store.docs.column("offset").to_pylist() == [0, 3, 5, 6]
    assert store.docs.column("n_tokens").to_pylist() == [3, 2, 1, 2]


def test_raw_file_of_odd_size_is_refused(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(BadInput, match=r"odd\.bin: 3 bytes is not a whole number of uint16 tokens"):
        import_store(tmp_path, [path], source_format="raw-uint16", vocab_size=10)


def test_bin_without_idx_asks_for_the_format(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(4, dtype="<u2").tofile(path)
    with pytest.raises(BadInput, match=r"t\.bin: no t\.idx beside it.*--source-format raw-uint16"):
        import_store(tmp_path, [path])


def test_wrong_magic(tmp_path):
    write_megatron(tmp_path / "m", [[1, 2]], doc_idx=[0, 1])
    idx = tmp_path / "m.idx"
    idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:])
    with pytest.raises(BadInput, match=r"m\.idx: wrong magic b'NOTANIDX\\x00' at byte 0"):
        read_index(idx)
    with pytest.raises(BadInput, match="wrong magic"):
        import_store(tmp_path, [tmp_path / "m.bin"])


@pytest.mark.parametrize("code", [6, 7, 9, 0])
def test_wrong_dtype_code(tmp_path, code):
    write_megatron(tmp_path / "d", [[1, 2]], doc_idx=[0, 1], code=code)
    with pytest.raises(
        BadInput, match=rf"d\.idx: dtype code {code} at byte 17 is not an integer token type"
    ):
        import_store(tmp_path, [tmp_path / "d.bin"])


def test_truncated_idx_and_bin(tmp_path):
    write_megatron(tmp_path / "t", [[1, 2, 3], [4, 5]], doc_idx=[0, 2])
    idx = tmp_path / "t.idx"
    full = idx.read_bytes()
    idx.write_bytes(full[:-4])
    with pytest.raises(
        BadInput,
        match=r"t\.idx: \d+ bytes but the header \(2 sequences, 2 doc-index entries\) needs exactly",
    ):
        read_index(idx)
    idx.write_bytes(full)
    binp = tmp_path / "t.bin"
    binp.write_bytes(binp.read_bytes()[:-2])
    with pytest.raises(BadInput, match=r"t\.bin: 8 bytes, but sequence 1 .* ends at byte 10"):
        import_store(tmp_path, [binp], vocab_size=10)


def test_token_outside_vocabulary(tmp_path):
    path = write_megatron(tmp_path / "v", [[1, 2, 300, 0]], doc_idx=[0, 1])
    with pytest.raises(
        BadInput, match=r"v\.bin: token 300 at token index 2 is outside the vocabulary 0\.\.99"
    ):
        import_store(tmp_path, [path], vocab_size=100)
    assert not (tmp_path / "store" / "tokens.bin").exists()  # nothing half-written left behind


def test_import_needs_a_vocabulary(tmp_path):
    path = write_megatron(tmp_path / "n", [[1, 0]], doc_idx=[0, 1])
    with pytest.raises(ArSliceError, match="needs --tokenizer, or both --vocab-size and --eos-id"):
        import_store(tmp_path, [path], vocab_size=None, eos_id=None)


def test_text_and_pretokenized_sources_do_not_mix(tmp_path):
    path = write_megatron(tmp_path / "n", [[1, 0]], doc_idx=[0, 1])
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ArSliceError, match="cannot mix text sources and pre-tokenized files"):
        import_store(tmp_path, [path, tmp_path / "a.txt"])
