"""`arslice train`: batch order, schedule, and real training runs on standard-library text."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.data.store import write_token_store
from ar_slicing.data.tokenizer import describe
from ar_slicing.errors import ArSliceError, BadInput, TokenizerMismatch
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import train_state
from pipeline.train import (
    STATE_DIR,
    BatchOrder,
    TrainConfig,
    learning_rate,
    parse_model_options,
    train,
    validation_rows,
)
from tests import REPO

# ---- batch order --------------------------------------------------------------------------------


@given(
    n_tokens=st.integers(2, 400),
    seq_len=st.integers(1, 40),
    batch_size=st.integers(1, 9),
    seed=st.integers(0, 3),
)
@settings(max_examples=150, deadline=None)
def test_each_epoch_visits_every_row_once(n_tokens, seq_len, batch_size, seed):
    order = BatchOrder(n_tokens, seq_len, batch_size, seed)
    n_rows = order.n_rows
    if n_rows == 0:
        return
    epochs = 3
    steps = -(-epochs * n_rows // batch_size)
    seen = np.concatenate([order.rows(s) for s in range(steps)])[: epochs * n_rows]
    for e in range(epochs):
        assert sorted(seen[e * n_rows : (e + 1) * n_rows]) == list(range(n_rows))
    # every row fits in the stream: its last token (the last target) exists
    assert (n_rows - 1) * seq_len + seq_len + 1 <= n_tokens


def test_rows_cover_each_target_once_per_epoch():
    """Consecutive rows share one token, so every stream token but the first is a target once."""
    n_tokens, seq_len = 101, 10
    order = BatchOrder(n_tokens, seq_len, batch_size=5, seed=7)
    stream = np.arange(n_tokens)
    batches = [order.batch(stream, s) for s in range(order.n_rows // 5)]
    targets = np.concatenate([b[:, 1:].ravel() for b in batches])
    assert sorted(targets) == list(range(1, n_tokens))
    for b in batches:  # rows are contiguous slices of the stream
        assert (np.diff(b, axis=1) == 1).all()


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = BatchOrder(10_000, 32, 4, seed=1)
    b = BatchOrder(10_000, 32, 4, seed=1)
    assert np.array_equal(a.rows(123), b.rows(123))
    assert a.digest(50) == b.digest(50)
    assert a.digest(50) != BatchOrder(10_000, 32, 4, seed=2).digest(50)
    assert a.digest(50) != a.digest(51)


# ---- schedule -----------------------------------------------------------------------------------


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(
        arch="attention", tokens="x", out="y", lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1
    )
    lrs = [learning_rate(s, cfg) for s in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)  # the last warmup step reaches the peak
    assert all(x < y for x, y in zip(lrs[:10], lrs[1:10]))
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    # halfway through the decay the cosine is at the midpoint of peak and floor
    assert learning_rate(60, cfg) == pytest.approx(1e-4 + 0.5 * 0.9e-3)
    assert learning_rate(cfg.steps, cfg) == pytest.approx(1e-4)


def test_validation_rows_are_spread_and_inside_the_stream():
    starts = validation_rows(n_tokens=1001, seq_len=10, n_rows=5)
    assert list(starts) == [0, 250, 500, 740, 990]
    assert validation_rows(5, 10, 3).size == 0
    assert list(validation_rows(31, 10, 100)) == [0, 10, 20]


def test_parse_model_options():
    assert parse_model_options(["num_heads=4", "kernel_size=[3, 5]", "mode=chunked"]) == {
        "num_heads": 4,
        "kernel_size": [3, 5],
        "mode": "chunked",
    }
    with pytest.raises(ArSliceError, match="KEY=VALUE"):
        parse_model_options(["num_heads"])


# ---- real training runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory, stdlib_texts, bpe_tokenizer, bpe_tokenizer_path):
    """Training and validation stores of real stdlib text, encoded by the real BPE fixture."""
    root = tmp_path_factory.mktemp("train-stores")
    info = describe(bpe_tokenizer, "stdlib-bpe")
    docs = [bpe_tokenizer.encode(t).ids for t in stdlib_texts]
    tokenizer_json = Path(bpe_tokenizer_path).read_text()
    train_store = write_token_store(
        root / "train", docs[:30], tokenizer_info=info, tokenizer_json=tokenizer_json
    )
    val_store = write_token_store(
        root / "val", docs[30:], tokenizer_info=info, tokenizer_json=tokenizer_json
    )
    return train_store, val_store


def tiny_config(stores, out, **overrides) -> TrainConfig:
    train_store, val_store = stores
    values = dict(
        arch="attention",
        tokens=str(train_store.path),
        val_tokens=str(val_store.path),
        out=str(out),
        d_model=32,
        n_layers=2,
        mixer_options=["num_heads=2"],
        seq_len=64,
        batch_size=8,
        steps=40,
        lr=1e-2,
        warmup_steps=5,
        eval_every=20,
        eval_batches=2,
        checkpoint_every=0,
        progress=False,
    )
    values.update(overrides)
    return TrainConfig(**values)


def test_training_learns_and_the_checkpoint_reproduces_the_validation_loss(stores, tmp_path):
    import torch

    from models.checkpoints.registry import load_model
    from pipeline.train import sequence_loss

    cfg = tiny_config(stores, tmp_path / "attention")
    meta = train(cfg)
    out = Path(cfg.out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "meta.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert read_json(out / "meta.json") == meta
    # safetensors creates its file 0600; every output gets the mode the others have
    assert {(out / n).stat().st_mode for n in ("model.safetensors", "config.json")} == {
        (out / "meta.json").stat().st_mode
    }
    vocab = stores[0].vocab_size
    # from a uniform guess (ln V) to clearly better on held-out text, and still improving
    assert meta["history"][0]["val_loss"] < math.log(vocab) - 0.5
    assert meta["final_val_loss"] < meta["history"][0]["val_loss"]
    assert meta["tokens_seen"] == 40 * 8 * 64
    assert meta["arch"] == "attention" and meta["fingerprint"] == stores[0].fingerprint
    assert (out / "tokenizer.json").read_text() == (stores[0].path / "tokenizer.json").read_text()

    loaded = load_model(f"native:{out}")
    assert loaded.n_params == meta["n_params"]
    # the saved weights give exactly the validation loss the trainer reported at the end
    val = stores[1]
    rows = np.stack(
        [
            np.asarray(val.tokens[s : s + 65], dtype=np.int64)
            for s in validation_rows(val.n_tokens, 64, 16)
        ]
    )
    import contextlib

    with torch.no_grad():
        losses = [
            sequence_loss(
                loaded.model, torch.from_numpy(rows[i : i + 8]), contextlib.nullcontext
            ).item()
            for i in (0, 8)
        ]
    assert np.mean(losses) == pytest.approx(meta["final_val_loss"], abs=1e-5)


def test_transformer_pp_trains_and_is_evaluated_as_the_attention_reference(stores, tmp_path):
    """`--arch transformer_pp`: attention with rotary on every channel of each head instead of
    learned positions, a SwiGLU MLP, RMSNorm and no biases. `arslice eval` reads the saved model
    back (on windows longer than its training rows: rotary has no positional limit) and the
    report takes it as the attention reference by its architecture alone."""
    import pyarrow.parquet as pq
    import torch

    from ar_slicing.analysis.results import default_reference
    from models import load_model
    from pipeline.cli import main as cli_main
    from pipeline.count import CountConfig, run_count
    from pipeline.tag import TagConfig, run_tag

    out = tmp_path / "tpp"
    meta = train(tiny_config(stores, out, arch="transformer_pp"))  # d_model 32, two heads
    vocab = stores[0].vocab_size
    assert meta["arch"] == "transformer_pp"
    assert meta["final_val_loss"] < meta["history"][0]["val_loss"] < math.log(vocab) - 0.5
    config = meta["model_config"]
    assert (config["sequence_mixer"], config["state_mixer"], config["norm"]) == (
        "attention",
        "swiglu",
        "rmsnorm",
    )
    assert config["max_position_embeddings"] == 0
    assert config["sequence_mixer_kwargs"]["rotary_emb_dim"] == 16  # 32 channels / 2 heads
    assert config["state_mixer_kwargs"]["hidden"] == 128  # int(8 * 32 / 3) rounded up to 128

    loaded = load_model(f"native:{out}")
    names = [name for name, _ in loaded.model.named_parameters()]
    assert not [n for n in names if n.endswith("bias") or "position" in n], names
    # tied embedding, per block Wqkv + out_proj (4 D^2), SwiGLU (3 D H), two RMSNorms, final norm
    d, hidden = 32, 128
    assert (
        loaded.n_params
        == meta["n_params"]
        == vocab * d + 2 * (4 * d * d + 3 * d * hidden + 2 * d) + d
    )

    val = stores[1]
    run_count(CountConfig(tokens=[str(stores[0].path)], out=str(tmp_path / "counts"), workers=1))
    window = 128  # twice the training rows
    run_tag(
        TagConfig(
            tokens=str(val.path),
            counts=str(tmp_path / "counts"),
            out=str(tmp_path / "tags"),
            window=window,
            workers=1,
        )
    )
    losses_dir = tmp_path / "losses" / "tpp"
    args = ["eval", "--model", f"native:{out}", "--tags", str(tmp_path / "tags")]
    assert cli_main([*args, "--out", str(losses_dir), "--device", "cpu", "--dtype", "fp32"]) == 0
    losses = pq.read_table(sorted(losses_dir.glob("losses-*.parquet"))[0]).to_pandas()
    first = losses[losses.window_id == 0].sort_values("pos")
    ids = torch.from_numpy(np.asarray(val.tokens[: window + 1], dtype=np.int64))[None]
    with torch.no_grad():
        own = loaded.model(ids[:, :-1], ids[:, 1:], loss_reduction="none")[0]
    np.testing.assert_allclose(first.nll.to_numpy(), own.numpy(), rtol=0, atol=1e-4)

    eval_meta = read_json(losses_dir / "meta.json")
    assert eval_meta["architecture"] == "attention"
    # a name that says nothing: the architecture in its meta makes it the reference
    models = [("a-conv", "a-conv", "base_conv"), ("tpp", "tpp", eval_meta["architecture"])]
    assert default_reference(models) == "tpp"


MINIMAL = dict(d_model=16, n_layers=1, seq_len=32, batch_size=4, eval_every=0, eval_batches=1)


def test_reruns_are_deterministic_and_archs_share_the_batch_order(stores, tmp_path):
    from safetensors.torch import load_file

    a = train(tiny_config(stores, tmp_path / "a", steps=6, **MINIMAL))
    b = train(tiny_config(stores, tmp_path / "b", steps=6, **MINIMAL))
    wa, wb = (
        load_file(str(tmp_path / "a" / "model.safetensors")),
        load_file(str(tmp_path / "b" / "model.safetensors")),
    )
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert a["final_val_loss"] == b["final_val_loss"]

    conv = train(
        tiny_config(
            stores, tmp_path / "conv", arch="base_conv", mixer_options=[], steps=6, **MINIMAL
        )
    )
    assert conv["batch_order_digest"] == a["batch_order_digest"]
    assert conv["arch"] == "base_conv"
    other_seed = train(tiny_config(stores, tmp_path / "seed1", steps=6, seed=1, **MINIMAL))
    assert other_seed["batch_order_digest"] != a["batch_order_digest"]


def test_threads_are_the_runs_own_and_given_back(stores, tmp_path):
    """`--threads N` applies to the run; the caller keeps its own count (a later run in the same
    process, e.g. `arslice run` training models in turn, must not inherit it)."""
    import torch

    before = torch.get_num_threads()
    train(tiny_config(stores, tmp_path / "m", steps=2, threads=before + 1, **MINIMAL))
    assert torch.get_num_threads() == before


def test_complete_output_is_skipped_and_overwrite_retrains(stores, tmp_path):
    cfg = tiny_config(stores, tmp_path / "m", steps=3, **MINIMAL)
    first = train(cfg)
    mtime = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    assert train(cfg) == first
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == mtime
    again = train(tiny_config(stores, tmp_path / "m", steps=3, overwrite=True, **MINIMAL))
    assert again["batch_order_digest"] == first["batch_order_digest"]
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns != mtime


def saved_step(out: Path) -> int:
    """The step of the latest checkpoint the stage's ledger records (0: none yet)."""
    from ar_slicing.machinery.ledger import Ledger

    return max((e["facts"]["step"] for e in Ledger(out).parts.values()), default=0)


def test_killed_run_leaves_no_checkpoint_and_resumes_to_the_same_weights(stores, tmp_path):
    """SIGKILL a real `arslice train` after its first periodic checkpoint, then rerun it."""
    from safetensors.torch import load_file

    train_store, val_store = stores
    args = [
        sys.executable, "-m", "pipeline.cli", "train", "--arch", "attention",
        "--tokens", str(train_store.path), "--val-tokens", str(val_store.path),
        "--d-model", "16", "--n-layers", "1", "--mixer-options", "num_heads=2",
        "--seq-len", "32", "--batch-size", "4", "--steps", "40", "--warmup-steps", "5", "--lr", "1e-2",
        "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "3", "--no-progress",
    ]  # fmt: skip
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [*args, "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while not saved_step(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert saved_step(out), (
        proc.stderr.read().decode() if proc.poll() is not None else "no checkpoint in 120 s"
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists() and not (out / "model.safetensors").exists()
    resumed_from = saved_step(out)  # the last checkpoint it recorded before it was killed
    assert 0 < resumed_from < 40
    state = train_state(out, resumed_from) / "state.json"
    assert read_json(state)["step"] == resumed_from

    # finish it in-process, and compare with an uninterrupted run of the same settings
    shared = dict(steps=40, checkpoint_every=3, **MINIMAL)
    resumed = train(tiny_config(stores, out, **shared))
    assert resumed["counts"]["resumed_from_step"] >= resumed_from
    assert not (out / STATE_DIR).exists()
    straight = train(tiny_config(stores, tmp_path / "straight", **shared))
    w1, w2 = (
        load_file(str(out / "model.safetensors")),
        load_file(str(tmp_path / "straight" / "model.safetensors")),
    )
    assert all(np.array_equal(w1[k].numpy(), w2[k].numpy()) for k in w1)
    assert resumed["batch_order_digest"] == straight["batch_order_digest"]


def test_a_stale_state_with_other_settings_is_refused(stores, tmp_path):
    from pipeline.train import load_state
    from tests.reliability import as_killed

    out = tmp_path / "m"
    train(tiny_config(stores, out, steps=4))
    as_killed(out)  # what a kill leaves: the plan and ledger of the unfinished run
    lr = tiny_config(stores, out).lr
    with pytest.raises(
        ArSliceError, match=f"unfinished run(?s:.*)settings.lr: {lr} -> 1.0(?s:.*)--overwrite"
    ):
        train(tiny_config(stores, out, steps=4, lr=1.0))
    # a complete model is not "complete" for other settings either
    done = tmp_path / "done"
    train(tiny_config(stores, done, steps=4))
    with pytest.raises(ArSliceError, match="complete output(?s:.*)settings.steps: 4 -> 5"):
        train(tiny_config(stores, done, steps=5))
    assert load_state(tmp_path / "none", None, None, "cpu") is None


# ---- clear errors -------------------------------------------------------------------------------


def test_errors_name_the_problem(stores, tmp_path, make_store):
    tiny = make_store([[1, 2, 3]], vocab_size=1024, fingerprint=stores[0].fingerprint)
    with pytest.raises(BadInput, match="fewer than one training row"):
        train(tiny_config(stores, tmp_path / "a", tokens=str(tiny.path)))
    other = make_store([[1, 2, 3] * 50], vocab_size=1024, fingerprint="0" * 64)
    with pytest.raises(TokenizerMismatch, match="validation store"):
        train(tiny_config(stores, tmp_path / "b", val_tokens=str(other.path)))
    with pytest.raises(ArSliceError, match="unknown ModelConfig field.*no_such_field"):
        train(tiny_config(stores, tmp_path / "c", model_options=["no_such_field=1"]))
    with pytest.raises(ArSliceError, match="--arch attention"):
        train(tiny_config(stores, tmp_path / "d", mixer_options=["num_heads=5"]))
    with pytest.raises(ArSliceError) as err:  # a typo would otherwise build a default filter
        train(tiny_config(stores, tmp_path / "e", arch="hyena", mixer_options=["filter_ordr=8"]))
    assert "sequence mixer 'hyena': unknown option 'filter_ordr'; it accepts filter_order" in str(
        err.value
    )
    assert not (tmp_path / "e" / "meta.json").exists()


def test_cli_prints_errors_without_traceback(stores, tmp_path, capsys):
    from pipeline.cli import main

    rc = main(
        [
            "train",
            "--arch",
            "attention",
            "--tokens",
            str(tmp_path / "missing"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err


@pytest.mark.gpu
def test_cuda_training_uses_bf16_autocast_and_saves_fp32_weights(stores, tmp_path):
    from safetensors.torch import load_file

    meta = train(tiny_config(stores, tmp_path / "cuda", device="cuda", steps=20, eval_every=10))
    assert meta["device"] == "cuda"
    assert meta["final_val_loss"] < math.log(stores[0].vocab_size) - 0.5
    weights = load_file(str(tmp_path / "cuda" / "model.safetensors"))
    assert all(str(w.dtype) == "torch.float32" for w in weights.values())
