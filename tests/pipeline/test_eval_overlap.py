"""The eval stage's overlap of work on a CPU: loss parts written by a background thread while the
next chunk computes (the same bytes as writing each in turn; a failed write a clean error that
leaves no part of its file), a batch kept in flight, linear weights held in the autocast dtype
(the same losses), and the fused kernels' paths in meta.json (models/kernels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import read_json
from pipeline.eval import (
    BatchRunner,
    EvalConfig,
    fixed_sequences,
    make_forward,
    open_tags,
    run_eval,
)
from pipeline.eval.output import ChunkEvaluator
from tests.models.test_kernels import MODEL_OPS, interpreted
from tests.pipeline.test_eval import config, corpus, models_dir, read_losses  # noqa: F401

torch = pytest.importorskip("torch")


def evaluator(corpus, spec: str, out: Path) -> tuple[ChunkEvaluator, list]:  # noqa: F811
    """A CPU fp32 evaluator of `spec` into `out`, and the tasks of 3 chunks of 3 windows."""
    tags = open_tags(corpus["tags"])
    assert tags.n_windows >= 9
    cfg = EvalConfig(model=spec, tags=str(corpus["tags"]), out=str(out), device="cpu")
    tasks = [(c, ((3 * c, 3 * c + 3),)) for c in range(3)]
    return ChunkEvaluator(cfg, "cpu", "fp32", batch_size=2, tags=tags), tasks


def test_parts_written_while_the_next_chunk_computes_equal_parts_written_in_turn(
    corpus,  # noqa: F811
    models_dir,  # noqa: F811
    tmp_path,
):
    ev, tasks = evaluator(corpus, models_dir["neox"], tmp_path / "overlapped")
    done = [(task[0], result["rows"]) for task, result in ev.run_all(tasks)]
    ev_turn, _ = evaluator(corpus, models_dir["neox"], tmp_path / "in-turn")
    rows = [ev_turn(task)["rows"] for task in tasks]
    assert done == list(zip(range(3), rows)) and min(rows) > 0
    names = sorted(p.name for p in (tmp_path / "overlapped").iterdir())
    assert names == [f"losses-0000{c}.parquet" for c in range(3)]
    for name in names:
        assert (tmp_path / "overlapped" / name).read_bytes() == (
            tmp_path / "in-turn" / name
        ).read_bytes()
    # and the stage, which writes this way, gives the bytes of a plain in-turn write
    run_eval(config(corpus, models_dir["neox"], tmp_path / "stage", chunk_windows=3))
    for name in names:
        assert (tmp_path / "stage" / name).read_bytes() == (
            tmp_path / "in-turn" / name
        ).read_bytes()


def test_a_failed_write_is_a_clean_error_after_the_parts_before_it(
    corpus,  # noqa: F811
    models_dir,  # noqa: F811
    tmp_path,
):
    out = tmp_path / "out"
    ev, tasks = evaluator(corpus, models_dir["neox"], out)
    (out / "losses-00001.parquet").mkdir(parents=True)  # the rename onto it will fail
    done = []
    with pytest.raises(ArSliceError) as err:
        for task, _ in ev.run_all(tasks):
            done.append(task[0])
    message = str(err.value)
    assert message.startswith(f"could not write the loss part {out / 'losses-00001.parquet'} (")
    assert "\n" not in message and "a rerun resumes at it" in message
    assert done == [0]  # chunk 0 was handed over (recorded) before the error surfaced
    assert sorted(p.name for p in out.iterdir()) == ["losses-00000.parquet", "losses-00001.parquet"]
    assert not any((out / "losses-00001.parquet").iterdir())  # no temporary left behind


def test_a_batch_in_flight_survives_an_out_of_memory_retry(corpus, models_dir):  # noqa: F811
    """An out-of-memory on the batch queued behind one in flight: the one in flight is kept,
    the new one retried smaller, and every loss lands where the plain loop puts it."""
    from models import load_model

    tags = open_tags(corpus["tags"])
    forward = make_forward(load_model(models_dir["neox"]), "cpu", "fp32")
    calls = []

    def second_call_runs_out(inputs, targets):
        calls.append(len(inputs))
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(inputs, targets)

    seqs = fixed_sequences(tags, 0, tags.n_windows)
    got = np.full(int(tags.n_targets.sum()), np.nan, dtype=np.float32)
    runner = BatchRunner(second_call_runs_out, batch_size=4)
    runner.run(seqs, got)
    assert len(seqs) == 10 and calls == [4, 4, 2, 2, 2] and runner.backoffs == 1
    ref = np.full_like(got, np.nan)
    BatchRunner(forward, batch_size=1).run(seqs, ref)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["neox", "mamba"])
def test_linear_weights_held_in_the_autocast_dtype_give_the_same_losses(
    kind,
    models_dir,  # noqa: F811
):
    from torch import nn

    from models import load_model
    from models.nll import chunked_nll
    from models.precision import hold_linear_weights

    loaded = load_model(models_dir[kind])
    ids = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(0))

    def nll():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            hidden, weight, bias = loaded.hidden_and_head(ids[:, :-1])
            return chunked_nll(hidden, weight, bias, ids[:, 1:])

    before = nll()
    held = hold_linear_weights(loaded.model, "bf16")
    after = nll()
    assert held > 0 and torch.equal(before, after)
    for module in loaded.model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not isinstance(module, nn.Linear) or name != "weight":
                assert p.dtype == torch.float32, module  # biases, norms, embeddings, decays
    if kind == "mamba":  # the head tied to the embedding stays as the embedding reads it
        assert loaded.model.lm_head.weight.dtype == torch.float32


def test_meta_records_the_kernel_paths_and_the_weights_dtype(
    corpus,  # noqa: F811
    models_dir,  # noqa: F811
    tmp_path,
):
    run_eval(config(corpus, models_dir["mamba"], tmp_path / "auto"))
    meta = read_json(tmp_path / "auto" / "meta.json")
    assert meta["kernels"] == {"causal_conv1d": "pytorch", "selective_scan": "pytorch"}
    assert meta["kernels_requested"] == "auto" and meta["weights_dtype"] == "fp32"
    run_eval(config(corpus, models_dir["mamba2"], tmp_path / "mamba2"))
    meta = read_json(tmp_path / "mamba2" / "meta.json")
    assert meta["kernels"] == {"causal_conv1d": "pytorch", "ssd": "pytorch"}
    run_eval(config(corpus, models_dir["neox"], tmp_path / "neox"))
    assert read_json(tmp_path / "neox" / "meta.json")["kernels"] == {}  # no fused op in it
    with pytest.raises(ArSliceError, match="--kernels field: the causal_conv1d kernel cannot run"):
        run_eval(config(corpus, models_dir["mamba"], tmp_path / "field", kernels="field"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mamba", "rwkv", "mamba2"])
def test_stage_with_triton_kernels_on_the_interpreter_equals_the_pytorch_path(
    kind,
    corpus,  # noqa: F811
    models_dir,  # noqa: F811
    tmp_path,
):
    spec, out = models_dir[kind], tmp_path / "triton"
    interpreted("eval", spec, str(corpus["tags"]), str(out), "triton", timeout=1200)
    run_eval(config(corpus, spec, tmp_path / "pytorch", kernels="pytorch"))
    got = read_losses(out).column("nll").to_numpy()
    want = read_losses(tmp_path / "pytorch").column("nll").to_numpy()
    assert want.std() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    meta = read_json(out / "meta.json")
    ops = MODEL_OPS[kind]
    assert meta["kernels"] == dict.fromkeys(ops, "triton") and meta["kernels_requested"] == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mamba", "rwkv", "mamba2"])
def test_cuda_stage_with_fused_kernels_equals_the_cpu_pytorch_path(
    kind,
    corpus,  # noqa: F811
    models_dir,  # noqa: F811
    tmp_path,
):
    from dataclasses import replace

    spec = models_dir[kind]
    run_eval(config(corpus, spec, tmp_path / "cpu"))
    run_eval(replace(config(corpus, spec, tmp_path / "fp32"), device="cuda"))
    run_eval(replace(config(corpus, spec, tmp_path / "bf16"), device="cuda", dtype="bf16"))
    cpu = read_losses(tmp_path / "cpu").column("nll").to_numpy()
    fp32 = read_losses(tmp_path / "fp32").column("nll").to_numpy()
    bf16 = read_losses(tmp_path / "bf16").column("nll").to_numpy()
    np.testing.assert_allclose(fp32, cpu, rtol=0, atol=1e-4)
    assert np.abs(bf16 - cpu).mean() < 0.05 and np.abs(bf16 - cpu).max() < 0.5
    meta = read_json(tmp_path / "bf16" / "meta.json")
    assert set(meta["kernels"].values()) <= {"triton", "field"} and meta["kernels"]
    assert meta["weights_dtype"] == "bf16" and meta["warmup_s"] > 0
