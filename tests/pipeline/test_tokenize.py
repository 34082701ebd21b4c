"""The tokenize stage end to end on real text (standard-library sources and a Pile-style .jsonl.zst)
with a real BPE tokenizer trained by `tokenizers`; and `arslice train-tokenizer`."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ar_slicing.data.store import TokenStore
from ar_slicing.data.tokenizer import fingerprint
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import stable_meta
from ar_slicing.machinery.layout import STORE_WORK_DIR as PARTS_DIR
from ar_slicing.machinery.ledger import Ledger
from pipeline.cli import main as cli_main
from pipeline.tokenize import TokenizeConfig, run_tokenize
from pipeline.train_tokenizer import TrainTokenizerConfig, run_train_tokenizer
from tests import REPO
from tests.conftest import stdlib_files
from tests.reliability import as_killed

SUBSETS = ["Github", "Pile-CC", "ArXiv"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of 12 stdlib .py files and a .jsonl.zst of 10 more with Pile-style meta."""
    root = tmp_path_factory.mktemp("corpus")
    files = stdlib_files(22, max_bytes=20_000)
    src = root / "lib"
    src.mkdir()
    for p in files[:12]:
        (src / p.name).write_bytes(p.read_bytes())
    records = [
        {"text": p.read_text(encoding="utf-8"), "meta": {"pile_set_name": SUBSETS[i % 3]}}
        for i, p in enumerate(files[12:])
    ]
    records.insert(3, {"text": "", "meta": {"pile_set_name": "Github"}})  # empty: counted, skipped
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    zst = root / "val.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(data))
    texts = [p.read_text(encoding="utf-8") for p in sorted(src.iterdir())] + [
        r["text"] for r in records if r["text"]
    ]
    subsets = [None] * 12 + [r["meta"]["pile_set_name"] for r in records if r["text"]]
    return {"sources": [str(src), str(zst)], "texts": texts, "subsets": subsets, "zst": zst}


def tokenize(out, corpus, tokenizer, **kw):
    cfg = TokenizeConfig(
        source=corpus["sources"], tokenizer=str(tokenizer), out=str(out), glob="*.py", **kw
    )
    return run_tokenize(cfg)


def test_store_decodes_back_to_the_documents(tmp_path, corpus, bpe_tokenizer_path, bpe_tokenizer):
    summary = tokenize(tmp_path / "s", corpus, bpe_tokenizer_path, workers=1, shard_docs=5)
    store = TokenStore.open(tmp_path / "s")
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    assert store.eos_id == eos and store.eos_appended
    assert store.dtype == np.dtype("<u2")  # vocabulary 1024 fits in 16 bits
    assert store.fingerprint == fingerprint(bpe_tokenizer)
    assert store.n_docs == len(corpus["texts"]) == summary["n_docs"]
    assert store.meta["counts"]["empty"] == 1
    docs = store.docs.to_pydict()
    assert docs["subset"] == corpus["subsets"]
    assert docs["doc_id"] == list(range(store.n_docs))
    # offsets: each document starts right after the previous one's EOS
    n = np.array(docs["n_tokens"], dtype=np.int64)
    assert docs["offset"] == np.concatenate([[0], np.cumsum(n + 1)[:-1]]).tolist()
    assert store.n_tokens == int((n + 1).sum())
    tokens = store.tokens
    assert (tokens[np.array(docs["offset"]) + n] == eos).all()
    assert int((tokens == eos).sum()) == store.n_docs  # no EOS anywhere else
    # each document is exactly the tokenizer's own encoding, and decodes back to its text
    decoder = store.load_tokenizer()
    for (doc_id, ids), text in zip(store.iter_documents(), corpus["texts"]):
        assert docs["doc_id"][doc_id] == doc_id
        assert ids.tolist() == bpe_tokenizer.encode(text, add_special_tokens=False).ids
        assert decoder.decode(ids.tolist()) == text
    assert docs["source"][0].endswith(".py") and docs["source"][-1] == str(corpus["zst"])


def test_same_bytes_with_one_and_two_workers(tmp_path, corpus, bpe_tokenizer_path):
    tokenize(tmp_path / "w1", corpus, bpe_tokenizer_path, workers=1, shard_docs=3)
    tokenize(tmp_path / "w2", corpus, bpe_tokenizer_path, workers=2, shard_docs=3)
    for name in ("tokens.bin", "docs.parquet", "tokenizer.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    m1, m2 = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("w1", "w2"))
    m1["config"].pop("workers"), m2["config"].pop("workers")
    for m in (m1, m2):
        m["config"].pop("out")
    assert stable_meta(m1) == stable_meta(m2)
    assert not (tmp_path / "w2" / PARTS_DIR).exists()


def test_complete_store_is_skipped_unless_overwrite(tmp_path, corpus, bpe_tokenizer_path, capsys):
    tokenize(tmp_path / "s", corpus, bpe_tokenizer_path, workers=1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    assert tokenize(tmp_path / "s", corpus, bpe_tokenizer_path, workers=1)["skipped"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    # another setting on the complete store is refused, naming it
    with pytest.raises(ArSliceError, match="settings.max_docs: null -> 4"):
        tokenize(tmp_path / "s", corpus, bpe_tokenizer_path, workers=1, max_docs=4)
    again = tokenize(
        tmp_path / "s", corpus, bpe_tokenizer_path, workers=1, overwrite=True, max_docs=4
    )
    assert not again["skipped"] and TokenStore.open(tmp_path / "s").n_docs == 4


def _done_parts(out: Path) -> list[Path]:
    parts = out / PARTS_DIR
    return sorted(parts.rglob("*.docs.parquet")) if parts.exists() else []


def test_killed_run_resumes_to_the_same_bytes(tmp_path, bpe_tokenizer_path):
    """SIGKILL a real `arslice tokenize` mid-run; the rerun redoes only unfinished shards."""
    src = tmp_path / "lib"
    src.mkdir()
    files = stdlib_files(30, max_bytes=30_000)
    assert len(files) == 30
    for p in files:
        (src / p.name).write_bytes(p.read_bytes())
    args = ["--source", str(src), "--glob", "*.py", "--tokenizer", str(bpe_tokenizer_path)]
    args += ["--workers", "1", "--shard-docs", "1"]
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "tokenize", *args, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while len(_done_parts(out)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the shards finished when it was killed: those its ledger records (a part's files may
    # already be there, not yet recorded, when the kill comes; that part is redone)
    ledger = Ledger(out)
    done = sum(ledger.done(name) is not None for name in ledger.parts)
    assert 1 <= done < len(files), "the run should have been killed part-way"
    # nothing under a final name until the run completes
    assert not any((out / n).exists() for n in ("meta.json", "tokens.bin", "docs.parquet"))
    # what a kill during the final assembly would leave: a temporary file, never renamed
    stale = out / ".tokens.bin.99999.tmp"
    stale.write_bytes(b"half-written")

    cfg = TokenizeConfig(
        source=[str(src)],
        glob="*.py",
        tokenizer=str(bpe_tokenizer_path),
        out=str(out),
        workers=1,
        shard_docs=1,
    )
    summary = run_tokenize(cfg)
    assert summary["shards_resumed"] >= done  # finished shards were not encoded again
    assert summary["n_docs"] == len(files)
    assert not stale.exists() and not (out / PARTS_DIR).exists()
    fresh = run_tokenize(replace(cfg, out=str(tmp_path / "fresh")))
    assert fresh["shards_resumed"] == 0
    for name in ("tokens.bin", "docs.parquet"):
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()


def test_parts_of_another_configuration_are_not_reused(tmp_path, corpus, bpe_tokenizer_path):
    out = tmp_path / "s"
    tokenize(out, corpus, bpe_tokenizer_path, workers=1, shard_docs=2)
    # What a kill right before assembly leaves: the run's plan and its ledger.
    as_killed(out)
    for name in ("tokens.bin", "docs.parquet"):
        (out / name).unlink()
    stale = tmp_path / "stale_parts"
    tokenize(stale, corpus, bpe_tokenizer_path, workers=1, shard_docs=2, max_docs=6)
    # a different max_docs must not pick up parts made for the full corpus: refused, naming it
    with pytest.raises(ArSliceError, match="unfinished run(?s:.*)settings.max_docs: null -> 6"):
        tokenize(out, corpus, bpe_tokenizer_path, workers=1, shard_docs=2, max_docs=6)
    summary = tokenize(
        out, corpus, bpe_tokenizer_path, workers=1, shard_docs=2, max_docs=6, overwrite=True
    )
    assert summary["n_docs"] == 6
    assert (out / "tokens.bin").read_bytes() == (stale / "tokens.bin").read_bytes()


def test_bad_record_stops_the_cli_with_a_clear_error(tmp_path, bpe_tokenizer_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text(
        '{"text": "good"}\n{"text": "good"}\n{"txt": "wrong field"}\n{"text": "after"}\n'
    )
    out = tmp_path / "s"
    argv = [
        "tokenize",
        "--source",
        str(src),
        "--tokenizer",
        str(bpe_tokenizer_path),
        "--out",
        str(out),
    ]
    assert cli_main(argv + ["--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3" in err and "no field 'text'" in err and "Traceback" not in err
    assert not any((out / n).exists() for n in ("meta.json", "tokens.bin", "docs.parquet"))

    assert cli_main(argv + ["--workers", "1", "--on-bad-record", "skip"]) == 0
    store = TokenStore.open(out)
    assert store.n_docs == 3
    assert store.meta["counts"]["bad_records"] == 1 and store.meta["skipped"]["bad_records"] == 1
    assert "bad.jsonl:3" in store.meta["bad_record_examples"][0]


def test_invalid_utf8_counted_in_meta(tmp_path, bpe_tokenizer_path):
    src = tmp_path / "u.jsonl"
    src.write_bytes(b'{"text": "caf\xe9"}\n{"text": ""}\n{"text": "ok"}\n')
    run_tokenize(
        TokenizeConfig(
            source=[str(src)], tokenizer=str(bpe_tokenizer_path), out=str(tmp_path / "s"), workers=1
        )
    )
    store = TokenStore.open(tmp_path / "s")
    assert store.meta["counts"]["invalid_utf8"] == 1 and store.meta["counts"]["empty"] == 1
    texts = [store.load_tokenizer().decode(ids.tolist()) for _, ids in store.iter_documents()]
    assert texts == ["caf\ufffd", "ok"]


def test_cli_dry_run_and_help(tmp_path, bpe_tokenizer_path):
    def arslice(*args, check=True):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "pipeline.cli", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=check)

    src = tmp_path / "x.jsonl"
    src.write_text('{"text": "a document"}\n')
    printed = json.loads(
        arslice(
            "tokenize",
            "--source",
            src,
            "--tokenizer",
            bpe_tokenizer_path,
            "--out",
            "o",
            "--dry-run",
        ).stdout
    )
    assert printed["TokenizeConfig"]["source"] == [str(src)]
    # --dry-run checks what it prints: a missing source, or an empty one, is an error
    for bad, why in ((str(tmp_path / "missing.jsonl"), "no such file"), ("", "an empty path")):
        done = arslice(
            "tokenize", "--source", bad, "--tokenizer", "t", "--out", "o", "--dry-run", check=False
        )
        assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr
    arslice = functools.partial(lambda f, *a: f(*a).stdout, arslice)
    assert "--on-bad-record {error,skip}" in arslice("tokenize", "--help")
    assert "--vocab-size VOCAB_SIZE" in arslice("train-tokenizer", "--help")


def test_train_tokenizer_is_deterministic_and_usable(tmp_path, corpus):
    lib = corpus["sources"][0]
    kw = dict(source=[lib], glob="*.py", vocab_size=600, split_fraction=0.25, split_part="train")
    a = run_train_tokenizer(TrainTokenizerConfig(out=str(tmp_path / "a.json"), **kw))
    b = run_train_tokenizer(TrainTokenizerConfig(out=str(tmp_path / "b.json"), **kw))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a["fingerprint"] == b["fingerprint"] and a["vocab_size"] == 600 and a["eos_id"] == 0
    assert a["documents"] < 12  # the val part was left out
    assert run_train_tokenizer(TrainTokenizerConfig(out=str(tmp_path / "a.json"), **kw))["skipped"]
    # the trained tokenizer drives the tokenize stage and round-trips text
    tokenize(tmp_path / "s", corpus, tmp_path / "a.json", workers=1)
    store = TokenStore.open(tmp_path / "s")
    tok = store.load_tokenizer()
    first = next(store.iter_documents())[1]
    assert tok.decode(first.tolist()) == corpus["texts"][0]
    assert pq.read_table(tmp_path / "s" / "docs.parquet").num_rows == len(corpus["texts"])


def test_overwrite_with_another_tokenizer_uses_the_new_one(tmp_path, corpus, bpe_tokenizer_path):
    from pipeline.train_tokenizer import train_bpe

    small = train_bpe(corpus["texts"][:3], vocab_size=300)
    small_path = tmp_path / "small.json"
    small.save(str(small_path))
    tokenize(tmp_path / "s", corpus, bpe_tokenizer_path, workers=1, max_docs=2)
    tokenize(tmp_path / "s", corpus, small_path, workers=1, max_docs=2, overwrite=True)
    store = TokenStore.open(tmp_path / "s")
    assert store.fingerprint == fingerprint(small)
    first = next(store.iter_documents())[1].tolist()
    assert first == small.encode(corpus["texts"][0], add_special_tokens=False).ids


def test_rerun_with_skip_after_a_bad_record_resumes(tmp_path, bpe_tokenizer_path, stdlib_texts):
    lines = [json.dumps({"text": t}) for t in stdlib_texts[:4]] + ["{broken"]
    lines += [json.dumps({"text": t}) for t in stdlib_texts[4:6]]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = TokenizeConfig(
        source=[str(src)],
        tokenizer=str(bpe_tokenizer_path),
        out=str(tmp_path / "s"),
        workers=1,
        shard_docs=1,
    )
    with pytest.raises(BadInput, match=r"c\.jsonl:5 \(byte \d+\): not valid JSON"):
        run_tokenize(cfg)
    summary = run_tokenize(replace(cfg, on_bad_record="skip"))
    assert summary["shards_resumed"] == 4 and summary["n_docs"] == 6 and summary["bad_records"] == 1
    assert _decoded(TokenStore.open(tmp_path / "s")) == stdlib_texts[:6]


def _decoded(store):
    tok = store.load_tokenizer()
    return [tok.decode(ids.tolist()) for _, ids in store.iter_documents()]


def _naive_stream(tokenizer, texts, eos):
    """The reference: encode each document alone, EOS after each."""
    out = []
    for text in texts:
        out += tokenizer.encode(text, add_special_tokens=False).ids + [eos]
    return out


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(
        st.tuples(st.integers(0, 39), st.integers(0, 3000), st.integers(0, 400)), max_size=25
    ),
    shard_docs=st.integers(1, 7),
    shard_mb=st.sampled_from([0.0005, 0.002, 1.0]),
)
def test_any_sharding_gives_the_naive_stream(
    tmp_path_factory, stdlib_texts, bpe_tokenizer_path, bpe_tokenizer, picks, shard_docs, shard_mb
):
    """Random documents (slices of real sources, some empty) and random shard sizes."""
    texts = [stdlib_texts[i][a : a + n] for i, a, n in picks]
    tmp = tmp_path_factory.mktemp("prop")
    src = tmp / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = TokenizeConfig(
        source=[str(src)],
        tokenizer=str(bpe_tokenizer_path),
        out=str(tmp / "s"),
        workers=1,
        shard_docs=shard_docs,
        shard_mb=shard_mb,
    )
    kept = [t for t in texts if t]
    if not kept:  # a source without a document is an error, and leaves no store behind
        with pytest.raises(BadInput, match="no documents in"):
            run_tokenize(cfg)
        assert not (tmp / "s").exists()
        return
    run_tokenize(cfg)
    store = TokenStore.open(tmp / "s")
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    assert store.tokens.tolist() == _naive_stream(bpe_tokenizer, kept, eos)
    assert store.n_docs == len(kept) and store.meta["counts"]["empty"] == len(texts) - len(kept)


@pytest.mark.slow
def test_standard_library_top_level_with_two_workers(tmp_path, bpe_tokenizer_path, bpe_tokenizer):
    """Every top-level .py file of the standard library (~4.7 MB), two workers, against the naive
    reference."""
    from tests.conftest import STDLIB

    cfg = TokenizeConfig(
        source=[str(STDLIB)],
        glob="*.py",
        tokenizer=str(bpe_tokenizer_path),
        out=str(tmp_path / "s"),
        workers=2,
    )
    summary = run_tokenize(cfg)
    store = TokenStore.open(tmp_path / "s")
    files = sorted(
        (p.relative_to(STDLIB).as_posix(), p) for p in STDLIB.glob("*.py") if p.is_file()
    )
    texts = [p.read_bytes().decode("utf-8", "replace") for _, p in files]
    kept = [t for t in texts if t]
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    assert summary["shards"] > 2
    assert store.tokens.tolist() == _naive_stream(bpe_tokenizer, kept, eos)
    assert store.docs.column("source").to_pylist() == [
        str(p) for (_, p), t in zip(files, texts) if t
    ]


def test_literal_eos_in_text_is_counted(tmp_path, bpe_tokenizer_path):
    src = tmp_path / "e.jsonl"
    src.write_text(
        json.dumps({"text": "a <|endoftext|> b"}) + "\n" + json.dumps({"text": "c"}) + "\n"
    )
    cfg = TokenizeConfig(
        source=[str(src)], tokenizer=str(bpe_tokenizer_path), out=str(tmp_path / "s"), workers=1
    )
    assert run_tokenize(cfg)["eos_in_text"] == 1
    store = TokenStore.open(tmp_path / "s")
    assert store.meta["counts"]["eos_in_text"] == 1
    assert int((store.tokens == store.eos_id).sum()) == store.n_docs + 1
