"""Bad input through `arslice`, as a user meets it: each case asserts the message (naming the file or
value), exit status 2 without a traceback, and that nothing was half-written under a final name.

Cases tested closer to the code elsewhere: readers (ar_slicing/test_readers: truncated .zst/.gz,
bad JSON lines), Megatron/raw imports (ar_slicing/test_megatron), store sizes
(ar_slicing/test_foundation), tokenizer mismatches (ar_slicing/test_counts, ar_slicing/test_tags,
pipeline/test_eval), model/tags checks (pipeline/test_eval), checkpoints and pickles
(models/test_checkpoints), losses of another tokenizer (queries/test_queries).
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard

from ar_slicing.data.store import write_token_store
from tests import UPSTREAM
from tests.reliability import (  # noqa: F401  (tiny_run is a fixture)
    WINDOW,
    cli,
    copy_sources,
    final_files,
    run_subprocess,
    save_tiny_native,
    tiny_run,
    tmpfs,
)


def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = cli(*argv)
    captured = capsys.readouterr()
    return rc, captured.err


def assert_refused(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


def assert_nothing_half_written(out) -> None:
    """No completion marker, no temporary file left, and every final-named file whole."""
    assert not (out / "meta.json").exists()
    if not out.exists():
        return
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    for rel, path in final_files(out).items():
        if rel.endswith(".parquet"):
            pq.read_metadata(path)  # a torn write has no footer
        else:
            assert rel in ("tokenizer.json",), f"unexpected final file {rel}"


@pytest.fixture
def run_copy(tiny_run, tmp_path):  # noqa: F811
    dest = tmp_path / "run"
    shutil.copytree(tiny_run["run"], dest)
    return dest


# ---- corrupt sources ---------------------------------------------------------------------------


def test_corrupt_zst_source(tmp_path, capsys, bpe_tokenizer_path, stdlib_texts):
    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in stdlib_texts[:10])
    blob = bytearray(zstandard.ZstdCompressor().compress(data))
    middle = len(blob) // 2
    blob[middle : middle + 64] = bytes(64)  # damaged inside the frame, not just cut short
    src = tmp_path / "val.jsonl.zst"
    src.write_bytes(bytes(blob))
    out = tmp_path / "store"
    rc, err = run_cli(capsys, "tokenize", "--source", src, "--tokenizer", bpe_tokenizer_path,
                      "--workers", "1", "--out", out)  # fmt: skip
    assert_refused(rc, err, "val.jsonl.zst")
    assert_nothing_half_written(out)


def write_megatron(prefix, sequences, code=8):
    """prefix.bin/.idx in the Megatron MMIDIDX layout (uint16 tokens: dtype code 8)."""
    from ar_slicing.data.megatron import MAGIC

    sizes = np.array([len(s) for s in sequences], "<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * 2]).astype("<i8")
    np.concatenate([np.asarray(s, "<u2") for s in sequences]).tofile(prefix.with_suffix(".bin"))
    header = MAGIC + struct.pack("<QBQQ", 1, code, len(sequences), len(sequences) + 1)
    doc_idx = np.arange(len(sequences) + 1, dtype="<i8")
    prefix.with_suffix(".idx").write_bytes(
        header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes()
    )
    return prefix.with_suffix(".bin")


@pytest.mark.parametrize(
    "damage,words",
    [
        ("magic", ["m.idx", "wrong magic"]),
        ("dtype", ["m.idx", "dtype code 6", "not an integer token type"]),
    ],
)
def test_idx_with_wrong_magic_or_dtype(tmp_path, capsys, damage, words):
    bin_path = write_megatron(tmp_path / "m", [[5, 6, 7], [8, 9]])
    idx = tmp_path / "m.idx"
    raw = bytearray(idx.read_bytes())
    if damage == "magic":
        raw[:4] = b"NOPE"
    else:
        raw[17] = 6  # float32: not a token type
    idx.write_bytes(bytes(raw))
    out = tmp_path / "store"
    rc, err = run_cli(capsys, "tokenize", "--source", bin_path, "--vocab-size", "50304",
                      "--eos-id", "0", "--out", out)  # fmt: skip
    assert_refused(rc, err, *words)
    assert_nothing_half_written(out)


# ---- damaged or mismatched artefacts -----------------------------------------------------------


def test_truncated_tokens_bin(run_copy, capsys):
    path = run_copy / "tokens/train/tokens.bin"
    path.write_bytes(path.read_bytes()[:-3])
    out = run_copy / "counts-again"
    rc, err = run_cli(capsys, "count", "--tokens", run_copy / "tokens/train", "--out", out)
    assert_refused(rc, err, "tokens.bin", "truncated", "--overwrite")
    assert_nothing_half_written(out)
    out = run_copy / "tags-again"
    rc, err = run_cli(capsys, "tag", "--tokens", run_copy / "tokens/train", "--counts",
                      run_copy / "counts", "--out", out)  # fmt: skip
    assert_refused(rc, err, "tokens.bin")
    assert_nothing_half_written(out)


def test_counts_and_store_of_different_tokenizers(run_copy, tmp_path, capsys):
    other = write_token_store(
        tmp_path / "other",
        [[1, 2, 3, 1, 2, 3]],
        tokenizer_info={"name": "other", "fingerprint": "a" * 64, "vocab_size": 1024, "eos_id": 0},
    )
    rc_a, err = run_cli(capsys, "count", "--tokens", other.path, "--out", tmp_path / "c")
    assert rc_a == 0
    out = run_copy / "tags-mixed"
    rc, err = run_cli(capsys, "tag", "--tokens", run_copy / "tokens/val", "--counts",
                      tmp_path / "c", "--out", out)  # fmt: skip
    assert_refused(rc, err, "tokenizer mismatch", "aaaaaaaaaaaa")
    assert_nothing_half_written(out)


def test_tags_from_another_run(run_copy, tmp_path, capsys, bpe_tokenizer_path, tiny_run):  # noqa: F811
    """eval pointed at this run's tags but another run's validation store (same tokenizer)."""
    src = copy_sources(tmp_path / "src", 2, skip=40)
    other = tmp_path / "other-val"
    assert cli("tokenize", "--source", src, "--glob", "*.py", "--tokenizer", bpe_tokenizer_path,
               "--workers", "1", "--out", other) == 0  # fmt: skip
    capsys.readouterr()
    out = run_copy / "losses/other"
    rc, err = run_cli(capsys, "eval", "--model", f"native:{tiny_run['model']}", "--tags",
                      run_copy / "tags", "--tokens", other, "--device", "cpu", "--out", out)  # fmt: skip
    assert_refused(rc, err, str(other))
    assert_nothing_half_written(out)


def test_model_vocabulary_smaller_than_the_largest_token_id(
    run_copy, tmp_path, capsys, bpe_tokenizer_path
):
    model = save_tiny_native(tmp_path / "small-vocab", bpe_tokenizer_path, vocab=256)
    out = run_copy / "losses/small"
    rc, err = run_cli(capsys, "eval", "--model", f"native:{model}", "--tags", run_copy / "tags",
                      "--device", "cpu", "--skip-tokenizer-check", "--out", out)  # fmt: skip
    assert_refused(rc, err, "256")
    assert "vocab" in err.lower()
    assert_nothing_half_written(out)


def test_window_longer_than_the_models_context(run_copy, tmp_path, capsys, bpe_tokenizer_path):
    model = save_tiny_native(tmp_path / "short", bpe_tokenizer_path, l_max=WINDOW // 2)
    out = run_copy / "losses/short"
    rc, err = run_cli(capsys, "eval", "--model", f"native:{model}", "--tags", run_copy / "tags",
                      "--device", "cpu", "--out", out)  # fmt: skip
    assert_refused(rc, err, str(WINDOW), str(WINDOW // 2))
    assert_nothing_half_written(out)


# ---- unreadable files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target,stage,words",
    [
        ("tokens/val/docs.parquet", "tag", ["docs.parquet", "not a file"]),
        ("tokens/val/tokens.bin", "tag", ["tokens.bin"]),
        ("counts/bigrams.parquet", "tag", ["bigrams.parquet", "is a directory"]),
        ("tokens/train/tokens.bin", "count", ["tokens.bin"]),
    ],
)
def test_directory_where_a_file_is_expected(run_copy, capsys, target, stage, words):
    """Tests run as root, where chmod 000 does not deny reads: a directory in a file's place is
    an unreadable file that root cannot read either."""
    path = run_copy / target
    path.unlink()
    path.mkdir()
    (path / "x").write_text("not data")
    out = run_copy / f"{stage}-again"
    if stage == "tag":
        argv = ["tag", "--tokens", run_copy / "tokens/val", "--counts", run_copy / "counts",
                "--window", WINDOW, "--out", out]  # fmt: skip
    else:
        argv = ["count", "--tokens", run_copy / "tokens/train", "--out", out]
    rc, err = run_cli(capsys, *argv)
    assert_refused(rc, err, *words)
    assert_nothing_half_written(out)


def test_file_without_read_permission(run_copy, capsys):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not deny reads (see the directory cases)")
    path = run_copy / "counts/bigrams.parquet"
    path.chmod(0)
    out = run_copy / "tags-again"
    rc, err = run_cli(capsys, "tag", "--tokens", run_copy / "tokens/val", "--counts",
                      run_copy / "counts", "--out", out)  # fmt: skip
    assert_refused(rc, err, "bigrams.parquet")
    assert_nothing_half_written(out)


# ---- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 32 KiB tmpfs (root may mount one here), grown by `grow()` to let the rerun finish
    (`grow("300k")`: to that size)."""
    mount = tmp_path / "disk"
    with tmpfs(mount, "32k") as remount:
        yield mount, lambda size="64m": remount(f"size={size}")


@pytest.mark.parametrize(
    "stage",
    [
        "tokenize",
        pytest.param("count", marks=pytest.mark.slow),
        pytest.param("tag", marks=pytest.mark.slow),
    ],
)
def test_full_disk_then_rerun(tiny_run, small_disk, stage):  # noqa: F811
    """The stage runs out of space: a clear error, nothing half-written; after space is freed the
    same command finishes with the files an unhindered run writes."""
    mount, grow = small_disk
    run = tiny_run["run"]
    out = mount / stage
    tok = run / "tokens/train/tokenizer.json"
    argv, reference = {
        "tokenize": (["tokenize", "--source", tiny_run["src_train"], "--glob", "*.py",
                      "--tokenizer", tok, "--workers", "1"], run / "tokens/train"),
        "count": (["count", "--tokens", run / "tokens/train", "--workers", "1"], run / "counts"),
        "tag": (["tag", "--tokens", run / "tokens/val", "--counts", run / "counts",
                 "--window", WINDOW, "--workers", "1", "--threshold", "4"], run / "tags"),
    }[stage]  # fmt: skip
    done = run_subprocess(*argv, "--out", out)
    assert_refused(done.returncode, done.stderr, "disk is full", "rerun the same command")
    assert_nothing_half_written(out)

    grow()
    done = run_subprocess(*argv, "--out", out)
    assert done.returncode == 0, done.stderr
    ref = final_files(reference)
    got = final_files(out)
    assert set(got) == set(ref)
    for rel in got:
        if rel != "meta.json":
            assert got[rel].read_bytes() == ref[rel].read_bytes(), rel


def test_full_disk_while_report_builds_results_duckdb(tiny_run, small_disk):  # noqa: F811
    """DuckDB runs out of space building results.duckdb: exit 2 with the disk-full message and
    no temporary left (DuckDB's write-ahead log of it included); the temporaries of a report
    killed earlier are swept by the next one."""
    mount, grow = small_disk
    grow("1m")
    run = mount / "run"
    for stage in ("tags", "losses"):
        shutil.copytree(tiny_run["run"] / stage, run / stage)
    used_kib = (
        (os.statvfs(mount).f_blocks - os.statvfs(mount).f_bfree)
        * os.statvfs(mount).f_frsize
        // 1024
    )
    grow(f"{used_kib + 64}k")  # room for the report's small files, not for a DuckDB block
    argv = ["report", "--run", run, "--bootstrap", "0", "--passages", "0"]
    done = run_subprocess(*argv)
    assert_refused(
        done.returncode, done.stderr, "disk is full", "results.duckdb", "rerun the same command"
    )
    assert sorted(p.name for p in run.iterdir()) == ["losses", "tags"]

    grow()
    orphans = [run / ".results.duckdb.4194305.tmp", run / ".results.duckdb.4194305.tmp.wal"]
    for orphan in orphans:  # (no process has that id: it is above Linux's largest pid)
        orphan.write_bytes(b"left by a killed report")
    (run / ".results.duckdb.4194305.tmp.tmp").mkdir()  # DuckDB's spill folder of it
    done = run_subprocess(*argv)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in run.iterdir()) == ["losses", "report", "results.duckdb", "tags"]


# ---- damaged parts ------------------------------------------------------------------------------


def truncate(path) -> None:
    """Cut a file in half, as a copy or a write cut short leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "part", ["tags/tags-00000.parquet", "losses/attention/losses-00003.parquet"]
)
def test_truncated_part(run_copy, tiny_run, capsys, part):  # noqa: F811
    """Every reader of the parts names the damaged one and the command that rewrites it."""
    from ar_slicing import open_run
    from ar_slicing.errors import ArSliceError

    path = run_copy / part
    truncate(path)
    redo = "arslice tag" if part.startswith("tags") else "arslice eval"
    words = (str(path), "not a whole Parquet file", "magic bytes", redo, "--overwrite")
    commands = [
        ["report", "--run", run_copy, "--bootstrap", "0", "--passages", "0"],
        ["query", "slice_perplexity", "--run", run_copy],
    ]
    if part.startswith("tags"):
        commands.append(["eval", "--model", f"native:{tiny_run['model']}", "--tags",
                         run_copy / "tags", "--out", run_copy / "losses/again", "--device", "cpu"])  # fmt: skip
    for argv in commands:
        rc, err = run_cli(capsys, *argv)
        assert_refused(rc, err, *words)
        assert len(err.strip().splitlines()) == 1, err
    with pytest.raises(ArSliceError) as raised:
        open_run(run_copy)
    for w in words:
        assert w in str(raised.value)
    assert not (run_copy / "results.duckdb").exists() and not (run_copy / "losses/again").exists()


def test_the_cheap_whole_part_check_agrees_with_reading_the_footer(tiny_run, tmp_path):  # noqa: F811
    """`require_whole` (8 bytes at each end, run on every query) refuses exactly the cuts of a
    real part whose footer pyarrow cannot read."""
    from ar_slicing.errors import BadInput
    from ar_slicing.machinery.parts import part_footer, require_whole

    data = (tiny_run["run"] / "tags/tags-00000.parquet").read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")
    cuts = {0, 3, 4, 11, 12, len(data) - footer - 8, len(data) // 2, len(data) - 9, len(data) - 1}
    cut_dir = tmp_path
    for n in sorted(cuts):
        part = cut_dir / f"tags-{n:05d}.parquet"
        part.write_bytes(data[:n])
        with pytest.raises(BadInput, match="not a whole Parquet file"):
            part_footer(part)
        with pytest.raises(BadInput, match="not a whole Parquet file"):
            require_whole([part])
    # a whole file passes both, and a corrupt middle is left to the readers
    whole = cut_dir / "tags-99999.parquet"
    whole.write_bytes(data)
    require_whole([whole])
    assert part_footer(whole).num_rows > 0


# ---- checkpoints carrying code -----------------------------------------------------------------


class Payload:
    """Unpickling this runs `touch MARKER`: what a weights-only loader must refuse."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_checkpoint_carrying_code(run_copy, tmp_path, capsys):
    import shutil

    import torch

    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "ckpt" / "model.pt"
    shutil.copytree(UPSTREAM / "zoology-mha", ckpt.parent)
    state = torch.load(ckpt, weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, ckpt)
    out = run_copy / "losses/pickled"
    rc, err = run_cli(capsys, "eval", "--model", f"zoology:{ckpt}", "--tags", run_copy / "tags",
                      "--device", "cpu", "--skip-tokenizer-check", "--out", out)  # fmt: skip
    assert_refused(rc, err, "model.pt", "refused")
    assert not marker.exists(), "the checkpoint's code ran"
    assert_nothing_half_written(out)


def test_hf_directory_with_a_pickled_bin_carrying_code(
    run_copy, tmp_path, capsys, bpe_tokenizer_path
):
    """A transformers directory whose pytorch_model.bin (a pickle) carries code."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    marker = tmp_path / "code-ran"
    model_dir = tmp_path / "hf"
    config = GPTNeoXConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=128)  # fmt: skip
    model = GPTNeoXForCausalLM(config)
    model.config.save_pretrained(model_dir)
    state = dict(model.state_dict())
    state["extra"] = Payload(marker)
    torch.save(state, model_dir / "pytorch_model.bin")
    shutil.copy(bpe_tokenizer_path, model_dir / "tokenizer.json")
    out = run_copy / "losses/hf-pickled"
    rc, err = run_cli(capsys, "eval", "--model", f"hf:{model_dir}", "--tags", run_copy / "tags",
                      "--device", "cpu", "--out", out)  # fmt: skip
    assert rc != 0
    assert not marker.exists(), "the checkpoint's code ran"
    assert_nothing_half_written(out)
    assert rc == 2 and "Traceback" not in err, err
