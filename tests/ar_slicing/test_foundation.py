"""The shared plumbing: atomic outputs, completion markers, the token store and the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from ar_slicing.data.store import TokenStore, dtype_for_vocab
from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.machinery.io import (
    atomic_path,
    build_meta,
    stable_meta,
)
from pipeline.config import add_config_arguments, config_from_mapping, config_from_namespace
from tests import REPO


def test_atomic_path_leaves_nothing_when_the_block_fails(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_replaces_the_old_file_only_on_success(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"
    assert target.read_bytes() == b"new"


def test_atomic_writes_give_every_file_the_mode_open_gives(tmp_path, monkeypatch):
    """A library that creates its file 0600 (safetensors does) still leaves a 0644 output
    under umask 022, through atomic_path and atomic_dir alike."""
    import os

    from ar_slicing.machinery import io

    monkeypatch.setattr(io, "_FILE_MODE", None)  # read the umask set here
    old = os.umask(0o022)
    try:
        (tmp_path / "plain.txt").write_text("x")
        with atomic_path(tmp_path / "one.bin") as tmp:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))
        with io.atomic_dir(tmp_path / "dir") as d:
            os.close(os.open(d / "weights.bin", os.O_WRONLY | os.O_CREAT, 0o600))
    finally:
        os.umask(old)
    files = ("plain.txt", "one.bin", "dir/weights.bin")
    assert {(tmp_path / f).stat().st_mode & 0o777 for f in files} == {0o644}


def test_malformed_json_names_the_file_line_and_column(tmp_path):
    from ar_slicing.machinery.io import read_json

    path = tmp_path / "meta.json"
    path.write_text('{\n  "stage": "tag",\n  "name": "unterminated')
    with pytest.raises(BadInput) as e:
        read_json(path)
    assert str(e.value) == (
        f"{path}: not valid JSON (Unterminated string starting at line 3, column 11); "
        "delete it and rerun the stage"
    )


def test_stable_meta_drops_only_timings():
    a = build_meta("x", config={"k": 1}, inputs={"i": 2}, counts={"n": 3}, wall_time_s=1.0)
    b = build_meta("x", config={"k": 1}, inputs={"i": 2}, counts={"n": 3}, wall_time_s=9.0)
    b["created_at"] = "later"
    assert stable_meta(a) == stable_meta(b)
    assert stable_meta(a)["counts"] == {"n": 3}


def test_token_store_layout_and_reader(make_store):
    docs = [[5, 6, 7], [], [8, 9]]
    store = make_store(docs, vocab_size=100, eos_id=0, subsets=["a", None, "b"])
    assert store.dtype == np.dtype("<u2")
    assert store.tokens.tolist() == [5, 6, 7, 0, 0, 8, 9, 0]
    assert store.doc_offsets.tolist() == [0, 4, 5]
    assert store.docs.column("n_tokens").to_pylist() == [3, 0, 2]
    assert store.docs.column("subset").to_pylist() == ["a", None, "b"]
    # Every stream index, EOS included, belongs to the document before it.
    assert store.doc_index_of(np.arange(8)).tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    assert [d.tolist() for _, d in store.iter_documents()] == docs


def test_token_store_uses_uint32_past_65536_ids(make_store):
    assert dtype_for_vocab(65536) == np.dtype("<u2")
    assert dtype_for_vocab(65537) == np.dtype("<u4")
    store = make_store([[70000, 1]], vocab_size=80000, eos_id=2)
    assert store.dtype == np.dtype("<u4")
    assert store.tokens.tolist() == [70000, 1, 2]


def test_truncated_tokens_bin_is_refused_with_its_name(make_store):
    store = make_store([[1, 2, 3, 4]], vocab_size=10)
    path = store.path / "tokens.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(BadInput, match=r"tokens\.bin.*truncated"):
        TokenStore.open(store.path)


def test_incomplete_store_is_refused(tmp_path):
    (tmp_path / "s").mkdir()
    with pytest.raises(BadInput, match="incomplete"):
        TokenStore.open(tmp_path / "s")


@dataclass(frozen=True)
class _Cfg:
    tokens: str = field(metadata={"help": "a store"})
    sources: list[str] = field(default_factory=list, metadata={"help": "inputs"})
    window: int = field(default=2048, metadata={"help": "window"})
    mode: str = field(default="a", metadata={"help": "mode", "choices": ["a", "b"]})
    reset: bool = field(default=False, metadata={"help": "switch"})
    limit: int | None = field(default=None, metadata={"help": "optional"})


def test_flags_are_generated_from_the_config_dataclass():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Cfg)
    ns = parser.parse_args(
        ["--tokens", "t", "--sources", "x", "y", "--window", "8", "--reset", "--limit", "3"]
    )
    cfg = config_from_namespace(_Cfg, ns)
    assert cfg == _Cfg(tokens="t", sources=["x", "y"], window=8, mode="a", reset=True, limit=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--window", "8"])  # --tokens is required
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "t", "--mode", "c"])


def test_config_from_mapping_names_unknown_keys():
    assert config_from_mapping(_Cfg, {"tokens": "t", "window": 4}).window == 4
    with pytest.raises(ArSliceError, match="windw"):
        config_from_mapping(_Cfg, {"tokens": "t", "windw": 4}, context="[tag]")
    # one string where a list is expected is a list of one (`glob = "*.py"`)
    assert config_from_mapping(_Cfg, {"tokens": "t", "sources": "x"}).sources == ["x"]
    assert config_from_mapping(_Cfg, {"tokens": "t", "sources": ["x", "y"]}).sources == ["x", "y"]


def test_cli_help_lists_every_command_and_dry_run_prints_config():
    from pipeline.runner.registry import commands

    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for name, command in commands().items():
        assert f"  {name} " in out.stdout and command.summary in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_every_config_field_has_help_text():
    from pipeline.runner.registry import commands

    for name, command in commands().items():
        for f in dataclasses.fields(command.config_cls):
            assert f.metadata.get("help"), f"arslice {name}: field {f.name} has no help text"
        assert command.examples.strip(), f"arslice {name}: --help shows no examples"


def test_dry_run_prints_the_resolved_config_and_does_nothing(tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "counts"
    (tmp_path / "store").mkdir()  # (a dry run checks that its inputs exist, and reads nothing)
    assert main(["count", "--tokens", str(tmp_path / "store"), "--out", str(out), "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    (config,) = printed.values()
    assert config["tokens"] == [str(tmp_path / "store")] and config["out"] == str(out)
    assert not out.exists()


def test_a_store_of_no_documents_is_empty_not_an_error(make_store):
    store = make_store([], vocab_size=10)
    assert store.n_tokens == 0 and store.n_docs == 0
    assert store.tokens.tolist() == [] and store.doc_offsets.tolist() == []


def test_only_the_cli_prints():
    """Stages say their summaries (`pipeline.config.say`) so that from Python nothing is
    printed; `print` is left to the CLI itself and the --dry-run output it asks for."""
    import ast

    allowed = {("pipeline/cli.py", None), ("pipeline/config.py", "print_config")}
    allowed.add(("pipeline/runner/run.py", "dry_run"))
    found = []
    for package in ("ar_slicing", "models", "pipeline"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            tree = ast.parse(path.read_text())
            for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
                for node in ast.walk(func):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Name)
                        and node.func.id == "print"
                        and (rel, None) not in allowed
                        and (rel, func.name) not in allowed
                    ):
                        found.append(f"{rel}:{node.lineno} in {func.name}")
    assert sorted(set(found)) == []
