"""Hub names with no hub: one check (a single probe, no retries), one message naming a local
directory instead, nothing written; a name already in the local cache still loads.

"No network" is simulated honestly: `HF_HUB_OFFLINE=1`, or `HF_ENDPOINT` pointing at a local
port nothing listens on (the connection is refused at once), with an empty `HF_HOME` so nothing
is cached. The processes a test starts record every connection they attempt, and the tests
assert those, not wall times (how long a refusal takes is the machine's business).
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery import hub
from tests import REPO, UPSTREAM
from tests.queries.test_queries import tiny_run  # noqa: F401  (a fixture)

UNROUTABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused
MESSAGE = "the Hugging Face hub is not reachable"


# A sitecustomize module for the processes a test starts: Python imports it at start-up, so every
# connection such a process attempts is refused and recorded, one JSON line per attempt, in the
# file named by $CONNECTIONS_LOG.
RECORD_CONNECTIONS = """\
import json, os, socket
def _refuse(sock, address, *args):
    with open(os.environ["CONNECTIONS_LOG"], "a") as log:
        log.write(json.dumps(list(address) if isinstance(address, tuple) else str(address)) + "\\n")
    raise ConnectionRefusedError(111, "Connection refused (by the test)")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
"""


def offline_env(tmp_path: Path, **extra: str) -> dict:
    """No hub: an empty HF_HOME, `extra` (HF_HUB_OFFLINE or an HF_ENDPOINT), and every connection
    recorded (see `connections`)."""
    recorder = tmp_path / "record-connections"
    recorder.mkdir(exist_ok=True)
    (recorder / "sitecustomize.py").write_text(RECORD_CONNECTIONS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        PYTHONPATH=f"{recorder}{os.pathsep}{REPO}",
        CONNECTIONS_LOG=str(tmp_path / "connections.jsonl"),
        **extra,
    )
    return env


def connections(env: dict) -> list:
    """The (host, port) of every connection the processes started with `env` attempted, and
    forget them."""
    import json

    log = Path(env["CONNECTIONS_LOG"])
    found = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return found


def the_probe(env: dict) -> list:
    """What a process that finds the hub unreachable may attempt: one connection to the endpoint
    (the probe), none when HF_HUB_OFFLINE says so."""
    if env.get("HF_HUB_OFFLINE"):
        return []
    host, port = env["HF_ENDPOINT"].removeprefix("http://").split(":")
    return [[host, int(port)]]


def arslice(args: list[str], env: dict, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_clear_failure(out: subprocess.CompletedProcess, env: dict, *names: str):
    """Refused at once: the probe, no retries, and one message naming every hub name."""
    assert out.returncode == 2, out.stderr
    assert connections(env) == the_probe(env)
    assert out.stderr.count(MESSAGE) == 1, out.stderr
    assert "--local-dir DIR" in out.stderr and "Traceback" not in out.stderr
    for name in names:
        assert name in out.stderr, (name, out.stderr)


# ---- deciding whether the hub is there ------------------------------------------------------------


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(hub, "_probed", {})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


def test_offline_by_setting(fresh_probe):
    fresh_probe.setenv("HF_HUB_OFFLINE", "1")
    assert hub.unreachable() == "HF_HUB_OFFLINE=1"
    assert hub.files_only() == {"local_files_only": True}


def test_a_refused_connection_is_offline_at_once(fresh_probe):
    fresh_probe.setenv("HF_ENDPOINT", UNROUTABLE)
    attempts = []
    connect = socket.socket.connect

    def recorded(sock, address):
        attempts.append(address)
        return connect(sock, address)  # (the real refusal)

    fresh_probe.setattr(socket.socket, "connect", recorded)
    why = hub.unreachable()
    assert why.startswith(f"{UNROUTABLE} did not answer") and "refused" in why.lower()
    assert hub.unreachable() == why  # decided once ...
    assert attempts == [("127.0.0.1", 9)]  # ... by one connection


def test_an_endpoint_that_answers_is_online(fresh_probe):
    """Any HTTP answer counts, an error status included (a local server answering 404)."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fresh_probe.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub.unreachable() is None
        assert hub.files_only() == {}
        hub.require([("model hf:x/y", "x/y", "model")])  # the hub is there: nothing refused
    finally:
        server.shutdown()


def test_require_names_every_missing_name_in_one_message(fresh_probe, tmp_path):
    fresh_probe.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ArSliceError) as e:
        hub.require(
            [
                ("tokenizer 'gpt2' ([tokenizer] pretrained)", "gpt2", "model"),
                (
                    "dataset hf://monology/pile-uncopyrighted",
                    "monology/pile-uncopyrighted",
                    "dataset",
                ),
            ]
        )
    text = str(e.value)
    assert text.startswith(f"{MESSAGE} (HF_HUB_OFFLINE=1)")
    assert "tokenizer 'gpt2'" in text and "hf://monology/pile-uncopyrighted" in text
    assert "\n" not in text


def test_local_paths_are_not_hub_names(tmp_path):
    (tmp_path / "gpt2").mkdir()
    assert hub.is_hub_name("gpt2") and hub.is_hub_name("EleutherAI/pythia-160m")
    assert not hub.is_hub_name(str(tmp_path / "gpt2"))
    assert not hub.is_hub_name("./gpt2") and not hub.is_hub_name("runs/x/tokenizer.json")


# ---- each command that takes a hub name ------------------------------------------------------------


def test_eval_of_a_hub_model_fails_at_the_probe(tiny_run, tmp_path):  # noqa: F811
    env = offline_env(tmp_path, HF_ENDPOINT=UNROUTABLE)
    out = arslice(
        ["eval", "--model", "hf:EleutherAI/pythia-70m", "--tags", str(tiny_run / "tags"),
         "--out", str(tmp_path / "losses")],
        env,
    )  # fmt: skip
    assert_one_clear_failure(out, env, "hf:EleutherAI/pythia-70m", "Connection refused")
    assert not (tmp_path / "losses").exists()


def test_tokenize_with_a_hub_tokenizer_or_dataset_fails_at_the_probe(
    tmp_path, monkeypatch, capsys, bpe_tokenizer_path
):
    from pipeline.cli import main

    monkeypatch.setattr(hub, "_probed", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    attempts = []
    monkeypatch.setattr(socket.socket, "connect", lambda sock, address: attempts.append(address))
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    dataset = "hf://monology/pile-uncopyrighted@validation"
    for argv, name in (
        (["--source", str(text), "--tokenizer", "gpt2"], "tokenizer 'gpt2'"),
        (["--source", dataset, "--tokenizer", str(bpe_tokenizer_path)], f"dataset {dataset}"),
    ):
        assert main(["tokenize", *argv, "--out", str(tmp_path / "store")]) == 2
        assert attempts == []  # HF_HUB_OFFLINE: not even the probe
        err = capsys.readouterr().err
        assert err.count(MESSAGE) == 1 and name in err and "Traceback" not in err, err
    assert not (tmp_path / "store").exists()


def test_tokenize_reads_a_hub_dataset_only_with_a_hub(tmp_path, monkeypatch, capsys):
    from ar_slicing.data.readers import ReadStats, iter_documents

    monkeypatch.setattr(hub, "_probed", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ArSliceError, match="dataset hf://monology/pile-uncopyrighted@validation"):
        list(iter_documents(["hf://monology/pile-uncopyrighted@validation"], stats=ReadStats()))


def test_make_all_on_the_pile_config_offline_fails_at_the_probe_and_writes_nothing(tmp_path):
    """pipeline/configs/pile-gpt2.toml with its /data paths pointed at local files: every
    hub name in it (the GPT-2 tokenizer, two hf: models) is named at once, before any stage."""
    import zstandard

    data = tmp_path / "data"
    (data / "pile" / "train").mkdir(parents=True)
    record = b'{"text": "def f():\\n    return 1\\n", "meta": {"pile_set_name": "Github"}}\n'
    for name in ("pile/train/00.jsonl.zst", "pile/val.jsonl.zst"):
        (data / name).write_bytes(zstandard.ZstdCompressor().compress(record))
    (data / "ckpt" / "hyena-153m").mkdir(parents=True)
    (data / "ckpt" / "hyena-153m" / "model.pt").write_bytes(b"a checkpoint file")
    text = (REPO / "pipeline" / "configs" / "pile-gpt2.toml").read_text()
    assert "/data/" in text and 'run_dir = "runs/pile-gpt2"' in text
    config = tmp_path / "pile-gpt2.toml"
    run_dir = tmp_path / "runs" / "pile-gpt2"
    config.write_text(
        text.replace("/data/", f"{data}/").replace('"runs/pile-gpt2"', f'"{run_dir}"')
    )
    for env in (
        offline_env(tmp_path, HF_ENDPOINT=UNROUTABLE),
        offline_env(tmp_path, HF_HUB_OFFLINE="1"),
    ):
        out = subprocess.run(
            ["make", "all", f"CONFIG={config}", f"ARSLICE={sys.executable} -m pipeline.cli"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0
        assert connections(env) == the_probe(env)  # one check before any stage, no retries
        assert out.stderr.count(MESSAGE) == 1, out.stderr
        for name in ("tokenizer 'gpt2'", "hf:EleutherAI/gpt-neo-125m", "model hf:gpt2"):
            assert name in out.stderr, (name, out.stderr)
        assert not (run_dir / "config.toml").exists()
        assert not run_dir.exists()  # nothing written: the check comes before every stage


def test_a_model_in_the_local_cache_still_loads_offline(tmp_path, bpe_tokenizer):
    """A hub id already in the cache loads from it: the hub is probed once (the one connection
    the process attempts) and never asked again, so there are no retries."""
    import transformers

    cache = tmp_path / "hf-home" / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--tiny--gpt" / "snapshots" / revision
    cfg = transformers.GPT2Config(vocab_size=1024, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(snapshot)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer).save_pretrained(snapshot)
    (cache / "models--tiny--gpt" / "refs").mkdir()
    (cache / "models--tiny--gpt" / "refs" / "main").write_text(revision)
    script = (
        "from models.checkpoints.registry import load_model\n"
        "m = load_model('hf:tiny/gpt')\n"
        "print(m.architecture, m.n_params, m.tokenizer_fingerprint is not None)\n"
    )
    env = offline_env(tmp_path, HF_ENDPOINT=UNROUTABLE)
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "gpt2",
        str(sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())),
        "True",
    ]
    assert connections(env) == the_probe(env)  # the probe only: no retries
    assert "Retrying" not in out.stderr  # ... nor their warnings


# ---- revisions: ID@REVISION, resolved to a commit -------------------------------------------------


def hub_cache(cache: Path, bpe_tokenizer) -> dict[str, str]:
    """A hub cache laid out as huggingface_hub lays it: `models--tiny--gpt/refs/{main,step1}`
    naming `snapshots/<commit>/`, two GPT-2s with different weights (Pythia's training steps are
    such revisions), and `models--tiny--based` holding a based: checkpoint at `refs/main`."""
    import hashlib
    import shutil

    import torch
    import transformers

    repo = cache / "models--tiny--gpt"
    (repo / "refs").mkdir(parents=True)
    commits = {}
    for seed, ref in enumerate(("step1", "main")):
        commit = hashlib.sha1(ref.encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        torch.manual_seed(seed)
        cfg = transformers.GPT2Config(
            vocab_size=1024, n_positions=64, n_embd=32, n_layer=1, n_head=2
        )
        transformers.GPT2LMHeadModel(cfg).save_pretrained(snapshot)
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=bpe_tokenizer, eos_token="<|endoftext|>"
        ).save_pretrained(snapshot)
        (repo / "refs" / ref).write_text(commit)
        commits[ref] = commit
    based = cache / "models--tiny--based"
    commits["based"] = hashlib.sha1(b"based").hexdigest()
    fixture = UPSTREAM / "based" / "transformer-pp"
    shutil.copytree(fixture, based / "snapshots" / commits["based"])
    (based / "refs").mkdir()
    (based / "refs" / "main").write_text(commits["based"])
    return commits


def cache_env(tmp_path: Path) -> dict:
    env = offline_env(tmp_path, HF_HUB_OFFLINE="1")
    env["HF_HUB_CACHE"] = str(tmp_path / "cache")
    return env


def test_a_revision_is_read_at_the_commit_it_resolves_to(tmp_path, bpe_tokenizer):
    """hf:ID@REVISION (branch or commit) loads that snapshot; the commit is what is recorded;
    an unknown revision is one clear line naming the revisions the cache has."""
    import json

    commits = hub_cache(tmp_path / "cache", bpe_tokenizer)
    script = (
        "import json\n"
        "from ar_slicing.errors import ArSliceError\n"
        "from models.checkpoints.registry import ModelSpec, load_model\n"
        "out = {}\n"
        f"for spec in ('hf:tiny/gpt', 'hf:tiny/gpt@step1', 'hf:tiny/gpt@{commits['step1']}',"
        " 'based:tiny/based'):\n"
        "    m = load_model(spec)\n"
        "    w = next(m.model.parameters())\n"
        "    out[spec] = [m.hub_commit, float(w.double().sum()), ModelSpec.parse(spec).identity(),"
        " m.tokenizer_fingerprint is not None]\n"
        "for spec in ('hf:tiny/gpt@step9', 'hf:./nowhere@main', 'safari:tiny/gpt@a@b'):\n"
        "    try:\n"
        "        load_model(spec)\n"
        "    except ArSliceError as e:\n"
        "        out[spec] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=cache_env(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    main, step1 = got["hf:tiny/gpt"], got["hf:tiny/gpt@step1"]
    assert main[0] == commits["main"] and step1[0] == commits["step1"]
    assert main[1] != step1[1]  # another snapshot's weights
    assert got[f"hf:tiny/gpt@{commits['step1']}"][:2] == step1[:2]  # a commit names itself
    assert step1[2] == {"hub": "tiny/gpt", "revision": "step1", "commit": commits["step1"]}
    assert main[2] == {"hub": "tiny/gpt", "revision": None, "commit": commits["main"]}
    assert main[3] and step1[3]  # the tokenizer found at that commit
    assert got["based:tiny/based"][0] == commits["based"]
    assert "revision 'step9' of tiny/gpt is not in the local cache" in got["hf:tiny/gpt@step9"]
    assert "it has main, step1" in got["hf:tiny/gpt@step9"]
    assert "hf:./nowhere@main" in got["hf:./nowhere@main"]  # a path, not a hub id
    assert "expected a hub id and one revision" in got["safari:tiny/gpt@a@b"]


def test_a_hub_model_that_changed_under_its_name_is_a_changed_input(
    tiny_run,  # noqa: F811
    tmp_path,
    bpe_tokenizer,
):
    """The eval stage records the resolved commit in meta.json and in its plan: once the branch
    points elsewhere, a rerun refuses and names both commits instead of skipping."""
    import json

    commits = hub_cache(tmp_path / "cache", bpe_tokenizer)
    env = cache_env(tmp_path)
    args = ["eval", "--model", "hf:tiny/gpt", "--tags", str(tiny_run / "tags"),
            "--out", str(tmp_path / "losses"), "--device", "cpu", "--dtype", "fp32"]  # fmt: skip
    first = arslice(args, env)
    assert first.returncode == 0, first.stderr
    meta = json.loads((tmp_path / "losses" / "meta.json").read_text())
    assert meta["hub_commit"] == commits["main"]
    again = arslice(args, env)
    assert again.returncode == 0 and "skipped" in again.stdout, again.stderr
    refs = tmp_path / "cache" / "models--tiny--gpt" / "refs" / "main"
    refs.write_text(commits["step1"])  # the hub's main moved on
    moved = arslice(args, env)
    assert moved.returncode == 2, moved.stderr
    assert commits["main"] in moved.stderr and commits["step1"] in moved.stderr
    assert "commit" in moved.stderr and "Traceback" not in moved.stderr


def test_a_hub_models_checkpoints_are_its_revisions_offline(tiny_run, tmp_path, bpe_tokenizer):  # noqa: F811
    """`[eval.models.<name>] checkpoints = ["step1"]` evaluates hf:ID@step1 from the local cache,
    without a hub: each revision resolved to its commit, placed by step x tokens_per_step; a
    revision the cache lacks is named before anything runs."""
    import json

    commits = hub_cache(tmp_path / "cache", bpe_tokenizer)
    env = cache_env(tmp_path)
    run = tiny_run
    config = tmp_path / "hub.toml"

    def write(revisions: list[str]) -> None:
        config.write_text(
            f'run_dir = "{run}"\n[eval]\ndevice = "cpu"\ndtype = "fp32"\n'
            "checkpoint_windows = 1\ntokens_per_step = 1000\n"
            f'[eval.models.tiny]\nmodel = "hf:tiny/gpt"\ncheckpoints = {json.dumps(revisions)}\n'
        )

    write(["step1"])
    dry = arslice(["run", "--config", str(config), "--stage", "eval", "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert "# [eval] tiny@step1" in dry.stdout and '"model": "hf:tiny/gpt@step1"' in dry.stdout
    done = arslice(["run", "--config", str(config), "--stage", "eval"], env)
    assert done.returncode == 0, done.stderr
    assert connections(env) == []  # HF_HUB_OFFLINE: not even the probe
    meta = json.loads((run / "losses" / "tiny@step1" / "meta.json").read_text())
    assert (meta["hub_commit"], meta["checkpoint_of"], meta["step"], meta["tokens_seen"]) == (
        commits["step1"], "tiny", 1, 1000,
    )  # fmt: skip
    assert meta["plan"]["inputs"]["model"]["commit"] == commits["step1"]
    assert meta["plan"]["settings"]["checkpoint"] == {"of": "tiny", "step": 1, "tokens_seen": 1000}
    assert (meta["window_subset"], meta["windows_evaluated"]) == (1, 1)
    main = json.loads((run / "losses" / "tiny" / "meta.json").read_text())
    assert main["hub_commit"] == commits["main"] and main["windows_evaluated"] == 2

    write(["step1", "step9"])  # a revision the cache does not hold: refused before any stage
    missing = arslice(["run", "--config", str(config), "--stage", "eval"], env)
    assert missing.returncode == 2 and MESSAGE in missing.stderr, missing.stderr
    assert "model hf:tiny/gpt@step9 ([eval.models.tiny] tiny@step9)" in missing.stderr
    assert "tiny/gpt@step1 " not in missing.stderr  # (cached: not named)
    assert not (run / "losses" / "tiny@step9").exists()


def test_the_pythia_emergence_config_is_checked_offline_as_far_as_it_can_be(tmp_path):
    """pipeline/configs/pile-pythia-emergence.toml without a hub or the Pile: `--dry-run` names
    every problem at once (the data it lacks, and each model and revision the hub would give)
    and writes nothing."""
    text = (REPO / "pipeline" / "configs" / "pile-pythia-emergence.toml").read_text()
    run_dir = tmp_path / "runs" / "emergence"
    config = tmp_path / "emergence.toml"
    config.write_text(text.replace('"runs/pile-pythia-emergence"', f'"{run_dir}"'))
    env = offline_env(tmp_path, HF_HUB_OFFLINE="1")
    out = arslice(["run", "--config", str(config), "--dry-run"], env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert connections(env) == []
    assert "3 problems, found before anything ran" in out.stderr
    assert "source /data/pile/val.jsonl.zst: no such file or directory" in out.stderr
    assert out.stderr.count(MESSAGE) == 1
    for size in ("160m", "410m"):
        assert f"model hf:EleutherAI/pythia-{size} ([eval.models.pythia-{size}])" in out.stderr
        for step in (0, 512, 143000):
            revision = f"hf:EleutherAI/pythia-{size}@step{step}"
            assert f"model {revision} ([eval.models.pythia-{size}] " in out.stderr, revision
            # named once, though the probe stage reads it too
            assert out.stderr.count(f"{revision} (") == 1, revision
    for seed in range(1, 10):
        revision = f"hf:EleutherAI/pythia-160m-seed{seed}@step1000"
        assert f"model {revision} ([eval.models.pythia-160m-seed{seed}] " in out.stderr
    assert "(11 repositories, 121 names)" in out.stderr  # 1 + 10 + 1 + 10 + 9 x 11
    assert not run_dir.exists()


@pytest.mark.parametrize(("spec", "case"), [("safari", "safari-no-modulate"), ("h3", "h3-hybrid")])
def test_every_format_reads_a_cached_checkpoint_without_asking_the_hub_again(tmp_path, spec, case):
    """The formats that fetch a repo's files (safari:, h3:, based:) share one fetch with one
    offline policy: a repo in the cache loads with the probe as the only connection."""
    import shutil

    repo = tmp_path / "hf-home" / "hub" / f"models--tiny--{spec}"
    revision = "89abcdef0123456789abcdef0123456789abcdef"
    shutil.copytree(UPSTREAM / case, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    script = (
        "from models.checkpoints.registry import load_model\n"
        f"m = load_model('{spec}:tiny/{spec}')\n"
        "print(m.n_params)\n"
    )
    env = offline_env(tmp_path, HF_ENDPOINT=UNROUTABLE)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 0
    assert connections(env) == the_probe(env)  # the probe only: no retries
    assert "Retrying" not in out.stderr
