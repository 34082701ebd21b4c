"""Shared fixtures: real text (the Python standard library's own sources) and a real BPE tokenizer."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from models import cpu_kernels

# The session trains models in its own process (`pipeline.train.train`, `arslice run` from
# Python), so, like `arslice train`, it pins torch's CPU kernels before anything loads torch.
cpu_kernels.pin()


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module's tests (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(n: int, min_bytes: int = 2_000, max_bytes: int = 60_000) -> list[Path]:
    """`n` standard-library source files, chosen deterministically (sorted by path)."""
    files = sorted(p for p in STDLIB.glob("*.py") if min_bytes <= p.stat().st_size <= max_bytes)
    return files[:n]


def read_stdlib_texts() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(40)]


def train_bpe_tokenizer(texts: list[str], path: Path) -> Path:
    """A byte-level BPE tokenizer (vocabulary 1024, EOS id 0) trained by `tokenizers` on
    `texts`, saved to `path`."""
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
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def stdlib_texts() -> list[str]:
    return read_stdlib_texts()


@pytest.fixture(scope="session")
def bpe_tokenizer_path(tmp_path_factory, stdlib_texts) -> Path:
    """A byte-level BPE tokenizer (vocabulary 1024) trained here by `tokenizers` on stdlib text."""
    return train_bpe_tokenizer(
        stdlib_texts, tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    )


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
    from ar_slicing.data.store import write_token_store

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


# A pipeline config of every stage, small enough to run in seconds (two tiny trained models).
SMALL_PIPELINE = """
run_dir = "{root}/run"

[tokenizer]
source = ["{{stdlib}}"]
glob = "a*.py"
split_fraction = 0.3
split_part = "train"
vocab_size = 400

[tokenize]
source = ["{{stdlib}}"]
glob = "a*.py"
split_fraction = 0.3
workers = 1

[count]
workers = 1

[tag]
window = 32
threshold = 2
workers = 1

[train]
seq_len = 32
batch_size = 4
steps = 3
warmup_steps = 1
eval_every = 0
eval_batches = 1
d_model = 16
n_layers = 1
progress = false

[train.models.attention]
arch = "attention"

[train.models.base_conv]
arch = "base_conv"

[eval]
device = "cpu"
batch_size = "8"

[report]
reference = "attention"
bootstrap = 5
"""


def small_pipeline_config(root: Path, **overrides: str) -> str:
    """SMALL_PIPELINE with its run under `root/run`; `overrides` appends TOML lines per table,
    e.g. tag='threshold = 3' (a later key of a table wins over the one above it: TOML allows
    each key once, so the table's line is replaced)."""
    text = SMALL_PIPELINE.format(root=root)
    for table, line in overrides.items():
        key = line.split("=")[0].strip()
        head = f"[{table}]\n"
        start = text.index(head) + len(head)
        end = text.find("\n[", start)
        body = text[start : end if end >= 0 else None]
        kept = "".join(
            row + "\n" for row in body.splitlines() if row and row.split("=")[0].strip() != key
        )
        text = text[:start] + kept + line + "\n" + (text[end:] if end >= 0 else "")
    return text
