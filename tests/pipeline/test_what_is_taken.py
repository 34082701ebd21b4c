"""What the project takes is what it checked: an hf: folder's own Python never runs unless the
evaluation asks for it (and transformers never asks on a terminal), and a training run resumes
only from state files the trainer wrote, refusing any other in one line, running none of it.
(The prebuilt models' files: tests/pipeline/test_prebuilt.py.)"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from ar_slicing.machinery.io import read_json
from tests import REPO
from tests.reliability import arslice_argv, kill_when, tiny_run  # noqa: F401  (a fixture)
from tests.tiny_models import save_neox

# ---- a model folder with code of its own -----------------------------------------------------------

# What transformers imports for `auto_map`: a GPT-NeoX under other names, and a line that leaves
# a mark when the file is run.
CUSTOM_CODE = """\
from pathlib import Path

from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

Path({marker!r}).write_text("ran")


class MarkedConfig(GPTNeoXConfig):
    model_type = "marked_neox"


class MarkedForCausalLM(GPTNeoXForCausalLM):
    config_class = MarkedConfig
"""


def folder_with_code(root: Path, tokenizer: Path, vocab: int) -> tuple[Path, Path]:
    """A transformers folder whose config.json names `marked.py` in `auto_map` (the model type
    is its own, so only that code can load it), and the file that code writes when it runs."""
    model = save_neox(root / "marked", vocab, tokenizer=tokenizer, max_position_embeddings=128)
    marker = root / "the-code-ran"
    (model / "marked.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "marked_neox"
    config["architectures"] = ["MarkedForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "marked.MarkedConfig",
        "AutoModelForCausalLM": "marked.MarkedForCausalLM",
    }
    (model / "config.json").write_text(json.dumps(config))
    return model, marker


def arslice(*argv, home: Path, stdin: str | None = None, timeout: float = 300):
    """`arslice ARGV` in a subprocess (its Hugging Face cache under `home`); `stdin`: what
    waits on its standard input, as a person would type it at a prompt (none: no input)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(home)}
    return subprocess.run(
        arslice_argv(*argv),
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def eval_args(model: Path, tags: Path, out: Path, *more: str) -> list:
    return [
        "eval", "--model", f"hf:{model}", "--tags", tags, "--out", out, "--device", "cpu",
        "--dtype", "fp32", "--batch-size", "16", *more,
    ]  # fmt: skip


def test_a_folders_own_code_never_runs_unless_asked(tiny_run, tmp_path, bpe_tokenizer_path):  # noqa: F811
    """Before, transformers asked "run the custom code? [y/N]" and a "y" on stdin ran the
    folder's Python. Now: refused in one line naming the option, without a prompt even with
    "y" waiting on stdin, and nothing of the folder runs; with --trust-remote-code it runs,
    and the plan records that it did."""
    vocab = read_json(tiny_run["run"] / "tokens" / "val" / "meta.json")["tokenizer"]["vocab_size"]
    model, marker = folder_with_code(tmp_path, bpe_tokenizer_path, vocab)
    tags, out = tiny_run["run"] / "tags", tmp_path / "losses"
    home = tmp_path / "hf-home"
    # "y" waiting on stdin, as a person would type it at transformers' prompt (which waits 15 s)
    refused = arslice(*eval_args(model, tags, out), home=home, stdin="y\ny\n", timeout=60)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code" in lines[0], refused.stderr
    assert "auto_map" in lines[0] and str(model) in lines[0]
    assert "[y/N]" not in refused.stdout + refused.stderr
    assert not marker.exists() and not out.exists()
    assert not (tmp_path / "hf-home" / "modules").exists()  # the code was not even copied

    trusted = arslice(*eval_args(model, tags, out, "--trust-remote-code"), home=home)
    assert trusted.returncode == 0, trusted.stderr
    assert marker.read_text() == "ran"
    assert read_json(out / "meta.json")["plan"]["settings"]["trust_remote_code"] is True


def test_transformers_is_told_not_to_run_a_tokenizers_code(tmp_path, bpe_tokenizer_path):
    """A tokenizer folder whose tokenizer_config.json names code of its own (`arslice tokenize
    --tokenizer DIR`, `[tokenizer] pretrained = DIR`): refused in one line, without a prompt
    even with "y" waiting on stdin; before, transformers asked and the "y" ran the code."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_file=str(bpe_tokenizer_path)).save_pretrained(folder)
    (folder / "tokenizer.json").unlink()  # so transformers must build it, with the code named
    marker = tmp_path / "the-code-ran"
    (folder / "marked.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast as MarkedTokenizer\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "marked.MarkedTokenizer"]}
    config["tokenizer_class"] = "MarkedTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(Path(json.__file__), source / "json_init.py")
    argv = ["tokenize", "--source", source, "--glob", "*.py", "--tokenizer", folder]
    done = arslice(
        *argv, "--out", tmp_path / "store", home=tmp_path / "hf", stdin="y\n", timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and str(folder) in done.stderr
    assert "[y/N]" not in done.stdout + done.stderr
    assert not marker.exists() and not (tmp_path / "store").exists()


# ---- the resumable state of a training run ------------------------------------------------------


class _RunsCode:
    """A pickle that runs a shell command when it is loaded without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def train_args(tiny_run, out: Path, *more) -> list:  # noqa: F811
    """`arslice train` of a tiny model on the tiny run's store, checkpointing every 2 steps."""
    run = tiny_run["run"]
    return [
        "train", "--arch", "attention", "--tokens", run / "tokens" / "train",
        "--d-model", "16", "--n-layers", "1", "--mixer-options", "num_heads=2",
        "--seq-len", "32", "--batch-size", "4", "--steps", "400", "--warmup-steps", "5",
        "--eval-every", "0", "--checkpoint-every", "2", "--no-progress", "--out", out, *more,
    ]  # fmt: skip


def saved_step(out: Path) -> int:
    """The step of the latest checkpoint the stage's ledger records (0: none yet)."""
    from ar_slicing.machinery.ledger import Ledger

    if not out.exists():
        return 0
    return max((e["facts"].get("step", 0) for e in Ledger(out).parts.values()), default=0)


@pytest.fixture(scope="module")
def killed(tiny_run, tmp_path_factory) -> Path:  # noqa: F811
    """A training run SIGKILLed after its first periodic checkpoint: what a rerun resumes."""
    out = tmp_path_factory.mktemp("killed") / "model"
    ready = lambda: saved_step(out) > 0  # noqa: E731
    was_killed, err = kill_when(train_args(tiny_run, out), ready, timeout=600)
    assert was_killed and saved_step(out) > 0, err
    return out


@pytest.mark.parametrize("damage", ["code", "truncated", "garbage", "weights"])
def test_a_state_file_the_trainer_did_not_write_is_refused_in_one_line(
    damage,
    killed,
    tiny_run,  # noqa: F811
    tmp_path,
):
    """Before, an optimizer.pt replaced by a pickle stopped the resume with an UnpicklingError
    traceback (no code ran: weights only). Now every such file is one line naming it and the
    way out, and none of its code runs."""
    out = tmp_path / "model"
    shutil.copytree(killed, out)
    state = out / ".train-state" / f"step-{saved_step(out):08d}"
    marker = tmp_path / "the-code-ran"
    target = state / ("model.safetensors" if damage == "weights" else "optimizer.pt")
    size = target.stat().st_size  # (a file of another size is a file the trainer did not write)
    if damage == "code":  # as big as the file it replaces, as a pickle may be made
        code = pickle.dumps(_RunsCode(marker))
        target.write_bytes(code + b"\x00" * (size - len(code)))
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:200])
    elif damage == "garbage":
        target.write_bytes(b"\x00not a checkpoint" * (size // 17) + b"\x00" * (size % 17))
    else:
        data = bytearray(target.read_bytes())
        data[8:16] = b"{{{{{{{{"  # the JSON header
        target.write_bytes(bytes(data))
    done = arslice(*train_args(tiny_run, out), home=tmp_path / "hf")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(target) in lines[0] and "--overwrite" in lines[0]
    assert "Traceback" not in done.stderr and not marker.exists()
    assert not (out / "meta.json").exists()
    # the way out it names works
    again = arslice(*train_args(tiny_run, out, "--overwrite", "--steps", "4"), home=tmp_path / "hf")
    assert again.returncode == 0, again.stderr
    assert read_json(out / "meta.json")["counts"]["resumed_from_step"] == 0
