"""Shared fixtures: real text (the Python standard library's own sources) and a real BPE tokenizer."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(n: int, min_bytes: int = 2_000, max_bytes: int = 60_000) -> list[Path]:
    """`n` standard-library source files, chosen deterministically (sorted by path)."""
    files = sorted(p for p in STDLIB.glob("*.py") if min_bytes <= p.stat().st_size <= max_bytes)
    return files[:n]


@pytest.fixture(scope="session")
def stdlib_texts() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(40)]


@pytest.fixture(scope="session")
def bpe_tokenizer_path(tmp_path_factory, stdlib_texts) -> Path:
    """A byte-level BPE tokenizer (vocabulary 1024) trained here by `tokenizers` on stdlib text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts, trainer=trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_tokenizer_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bpe_tokenizer_path))


@pytest.fixture(params=["compiled", "numpy"])
def engine(request, monkeypatch):
    """Run a test with the numba kernels and again with the plain-numpy fallback."""
    if request.param == "numpy":
        monkeypatch.setenv("ARSLICE_NO_NUMBA", "1")
    else:
        monkeypatch.delenv("ARSLICE_NO_NUMBA", raising=False)
        pytest.importorskip("numba")
    return request.param


@pytest.fixture
def make_store(tmp_path):
    """make_store(documents, vocab_size=..., eos_id=..., fingerprint=..., subsets=...) -> TokenStore."""
    from ar_slicing.store import write_token_store

    counter = {"n": 0}

    def make(
        documents, *, vocab_size=1000, eos_id=0, fingerprint="f" * 64, subsets=None, name=None
    ):
        counter["n"] += 1
        out = tmp_path / (name or f"store{counter['n']}")
        info = {
            "name": "test",
            "fingerprint": fingerprint,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
        }
        return write_token_store(out, documents, tokenizer_info=info, subsets=subsets)

    return make
