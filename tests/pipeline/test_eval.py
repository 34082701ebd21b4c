"""The eval stage: per-token losses against plain computations, alignment with the tags, resuming,
rolling windows against lm-eval's rolling loglikelihood, and every consistency check."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.algorithms.rolling import lm_eval_rolling_windows, rolling_windows, window_tokens
from ar_slicing.data.store import write_token_store
from ar_slicing.data.tokenizer import describe
from ar_slicing.errors import ArSliceError, BadInput, TokenizerMismatch
from ar_slicing.machinery.io import read_json
from ar_slicing.machinery.layout import LEDGER_NAME
from pipeline.cli import main as cli_main
from pipeline.config import printing_summaries
from pipeline.count import CountConfig, run_count
from pipeline.eval import (
    BatchRunner,
    EvalConfig,
    Sequence,
    cpu_has_native_bf16,
    resolve_dtype,
    run_eval,
)
from pipeline.tag import TagConfig, run_tag
from tests import UPSTREAM
from tests.tiny_models import save_native_lm, save_neox

torch = pytest.importorskip("torch")

L = 32  # window length of the test tags: documents below, at and above it
DOC_LENGTHS = [45, 5, 31, 0, 32, 100, 12, 64, 7]
VOCAB = 1024


# ---- fixtures: a real store and its tags, tiny real models --------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, bpe_tokenizer, stdlib_texts):
    """A validation store of real stdlib text (documents of DOC_LENGTHS tokens) and its tags, made
    by the count and tag stages (the store doubles as the training store)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [bpe_tokenizer.encode(t).ids[:n] for t, n in zip(stdlib_texts[5:], DOC_LENGTHS)]
    info = describe(bpe_tokenizer, "bpe")
    store = write_token_store(root / "val", docs, tokenizer_info=info)
    counts = CountConfig(tokens=[str(store.path)], out=str(root / "counts"), workers=1)
    run_count(counts)
    run_tag(
        TagConfig(
            tokens=str(store.path), counts=counts.out, out=str(root / "tags"), window=L, workers=1
        )
    )
    tags = root / "tags"
    return {"store": store, "tags": tags, "docs": docs, "eos": info["eos_id"], "root": root}


def _save_hf(model, path: Path, tokenizer_path: Path | None) -> Path:
    model.save_pretrained(path)
    if tokenizer_path is not None:
        shutil.copy(tokenizer_path, path / "tokenizer.json")
    return path


def make_neox(path: Path, tokenizer_path, *, vocab=VOCAB, max_positions=64) -> Path:
    return save_neox(
        path, vocab, tokenizer=tokenizer_path, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=max_positions,
        initializer_range=0.3,  # wide logits, so a misaligned target changes the NLL visibly
    )  # fmt: skip


def make_rwkv(path: Path, tokenizer_path) -> Path:
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(1)
    config = RwkvConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        attention_hidden_size=64,
        intermediate_size=128,
        context_length=16,  # shorter than the windows: a recurrent model has no positional limit
    )
    model = RwkvForCausalLM(config).eval()
    with torch.no_grad():  # transformers' init leaves the head tiny; spread the logits
        model.head.weight.normal_(0, 0.5)
    return _save_hf(model, path, tokenizer_path)


def make_mamba(path: Path, tokenizer_path) -> Path:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(3)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2)
    model = MambaForCausalLM(config).eval()
    with torch.no_grad():  # decays from slow to fast, and wide logits
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 2)
        model.backbone.embeddings.weight.normal_(0, 0.5)
    return _save_hf(model, path, tokenizer_path)


def make_mamba2(path: Path, tokenizer_path) -> Path:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(5)
    config = Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=2,
        num_hidden_layers=2, chunk_size=8,
    )  # fmt: skip
    model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():  # decays from slow to fast, and wide logits
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn_like(p) * 2)
        model.backbone.embeddings.weight.normal_(0, 0.5)
    return _save_hf(model, path, tokenizer_path)


def make_native(path: Path, tokenizer_path) -> Path:
    return save_native_lm(
        path, VOCAB, tokenizer=tokenizer_path, d_model=64, num_heads=4, l_max=64, seed=2, spread=0.5
    )


def make_based(
    path: Path, tokenizer_path, case: str = "based-main", prefix: str = "model."
) -> Path:
    """HazyResearch/based's published layout: an upstream-made fixture (based-main: model. prefix,
    metric entries and all; jrt: prefix-linear-attention's JRT-RNN), its vocabulary widened to
    the store's with new random rows."""
    shutil.copytree(UPSTREAM / "based" / case, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    emb = 0.5 * torch.randn(VOCAB, config["n_embd"], generator=torch.Generator().manual_seed(4))
    state[f"{prefix}transformer.embeddings.word_embeddings.weight"] = emb
    state[f"{prefix}lm_head.weight"] = emb
    torch.save(state, path / "pytorch_model.bin")
    shutil.copy(tokenizer_path, path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, bpe_tokenizer_path):
    root = tmp_path_factory.mktemp("models")
    return {
        "neox": f"hf:{make_neox(root / 'neox', bpe_tokenizer_path)}",
        "rwkv": f"hf:{make_rwkv(root / 'rwkv', bpe_tokenizer_path)}",
        "mamba": f"hf:{make_mamba(root / 'mamba', bpe_tokenizer_path)}",
        "mamba2": f"hf:{make_mamba2(root / 'mamba2', bpe_tokenizer_path)}",
        "native": f"native:{make_native(root / 'native', bpe_tokenizer_path)}",
        "jrt": f"based:{make_based(root / 'jrt', bpe_tokenizer_path, 'jrt', prefix='')}",
    }


def config(corpus, model, out, **kw) -> EvalConfig:
    kw.setdefault("batch_size", "3")
    kw.setdefault("chunk_windows", 4)
    kw.setdefault("dtype", "fp32")  # exact losses; `auto` may pick bf16 on this CPU
    return EvalConfig(model=model, tags=str(corpus["tags"]), out=str(out), device="cpu", **kw)


def read_losses(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("losses-*.parquet"))])


def read_tag_keys(tags: Path) -> pa.Table:
    return pa.concat_tables(
        [
            pq.read_table(p, columns=["window_id", "pos"])
            for p in sorted(tags.glob("tags-*.parquet"))
        ]
    )


# ---- plain references ---------------------------------------------------------------------------


def plain_logits_fn(spec: str):
    """ids (T,) -> logits (T, V) by the model's own full forward (no project code in the path)."""
    kind, path = spec.split(":", 1)
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return lambda ids: model(input_ids=torch.tensor([ids])).logits[0]
    if kind == "based":
        from models.checkpoints.based import load_based
        from models.mixers.prefix_linear_attention import prefix_enc_length

        model = load_based(path, spec)[0]
        enc = prefix_enc_length(model)
        if enc:  # JRT: a context shorter than the encoder is read alone (upstream's prefill)
            return lambda ids: torch.stack(
                [model(torch.tensor([ids[: t + 1]]))[0, -1] for t in range(min(enc - 1, len(ids)))]
                + list(model(torch.tensor([ids]))[0, enc - 1 :])
            )
    else:
        from models.checkpoints.native import load_native

        model = load_native(path).eval()
    return lambda ids: model(torch.tensor([ids]))[0]


def plain_nll(logits_fn, inputs, targets) -> np.ndarray:
    """Full forward, log_softmax over the whole vocabulary in fp32, gather."""
    with torch.no_grad():
        logp = torch.log_softmax(logits_fn(list(inputs)).float(), dim=-1)
        return -logp[torch.arange(len(targets)), torch.tensor(targets)].numpy()


def plain_fixed_losses(spec, store, window) -> np.ndarray:
    """NLL of every stream target, window by window, in tag-row order."""
    fn = plain_logits_fn(spec)
    s = np.asarray(store.tokens, dtype=np.int64)
    out = []
    for start in range(0, store.n_tokens - 1, window):
        span = s[start : min(start + window, store.n_tokens - 1) + 1]
        out.append(plain_nll(fn, span[:-1], span[1:]))
    return np.concatenate(out)


def lm_eval_rolling_pairs(tokens, prefix, max_len):
    """lm-eval's get_rolling_token_windows(context_len=1) + make_disjoint_window, transcribed."""
    if not tokens:
        return []
    pairs = []
    first = min(max_len, len(tokens))
    pairs.append(([prefix] + tokens[: first - 1], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        n_pred = min(len(tokens) - predicted, max_len)
        end = predicted + n_pred
        pairs.append((tokens[end - max_len - 1 : end - 1], tokens[end - n_pred : end]))
        predicted += n_pred
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in pairs]


def lm_eval_token_nlls(logits_fn, tokens, prefix, max_len) -> np.ndarray:
    """Per-token NLL as lm-eval's loglikelihood_rolling scores a document (HFLM._loglikelihood_tokens:
    the model reads (context + continuation)[-(max_len+1):][:-1], the last len(continuation) logits
    are scored)."""
    out = []
    for context, continuation in lm_eval_rolling_pairs(list(tokens), prefix, max_len):
        inp = (context + continuation)[-(max_len + 1) :][:-1]
        with torch.no_grad():
            logp = torch.log_softmax(logits_fn(inp).float(), dim=-1)[-len(continuation) :]
        out.append(-logp[torch.arange(len(continuation)), torch.tensor(continuation)].numpy())
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def assert_documents_equal_harness(nll, store, docs, logits_fn, prefix) -> None:
    """Every document's loss rows (row r is stream index r + 1) equal lm-eval's per-token NLL of
    loglikelihood_rolling after `prefix`, token by token and in total."""
    for d, doc in enumerate(docs):
        offset = int(store.doc_offsets[d])
        want = lm_eval_token_nlls(logits_fn, doc, prefix, L)
        rows = np.arange(offset, offset + len(doc)) - 1
        if d == 0:  # the stream's first token is no target: it has no row
            want, rows = want[1:], rows[1:]
        np.testing.assert_allclose(nll[rows], want, rtol=0, atol=2e-4)
        np.testing.assert_allclose(nll[rows].sum(), want.sum(), rtol=1e-5)


# ---- rolling windows ----------------------------------------------------------------------------


def test_rolling_windows_match_lm_eval_worked_example():
    # lm-eval's test_get_rolling_token_windows_v1 (34 tokens, max_seq_len 10, context_len 1).
    doc = list(range(34))
    got = [window_tokens(doc, -100, w) for w in lm_eval_rolling_windows(34, 10)]
    assert got == [
        ([-100, 0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
        (list(range(9, 19)), list(range(10, 20))),
        (list(range(19, 29)), list(range(20, 30))),
        (list(range(23, 33)), [30, 31, 32, 33]),
    ]
    # The trailing EOS (-1 here) gets its own window after a full last window ...
    eos_window = window_tokens(doc + [-1], -100, rolling_windows(34, 10)[-1])
    assert eos_window == (list(range(24, 34)), [-1])
    # ... and shares the window of a short document.
    assert window_tokens([7, 8, 9, -1], -100, rolling_windows(3, 10)[0]) == (
        [-100, 7, 8, 9],
        [7, 8, 9, -1],
    )
    assert rolling_windows(0, 10) == [(0, 1, 1)]  # an empty document: EOS predicted from EOS
    assert lm_eval_rolling_windows(0, 10) == []


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 80), max_len=st.integers(1, 20))
def test_rolling_windows_equal_lm_eval_pairs(n, max_len):
    doc = list(range(1000, 1000 + n))
    ours = [window_tokens(doc, -5, w) for w in lm_eval_rolling_windows(n, max_len)]
    theirs = [
        ((c + t)[-(max_len + 1) :][:-1], t) for c, t in lm_eval_rolling_pairs(doc, -5, max_len)
    ]
    assert ours == theirs
    # with the EOS: every token and the EOS predicted once, inputs never longer than max_len,
    # and each prediction's context is exactly the inputs before it
    extended = [-5, *doc, -1]
    predicted = []
    for a, b, k in rolling_windows(n, max_len):
        assert 1 <= b - a <= max_len and 1 <= k <= b - a
        predicted += list(range(b - k + 1, b + 1))
    assert predicted == list(range(1, n + 2))
    assert extended[-1] == window_tokens([*doc, -1], -5, rolling_windows(n, max_len)[-1])[1][-1]


# ---- per-token losses against plain computations ------------------------------------------------


@pytest.mark.parametrize(
    "kind, fast_path",
    [
        ("neox", True), ("rwkv", True), ("mamba", True), ("mamba", False), ("mamba2", True),
        ("mamba2", False), ("native", True), ("jrt", True),
    ],
)  # fmt: skip
def test_losses_equal_plain_forward(kind, fast_path, corpus, models_dir, tmp_path):
    spec = models_dir[kind]
    out = tmp_path / kind
    summary = run_eval(config(corpus, spec, out, fast_path=fast_path))
    losses = read_losses(out)
    keys = read_tag_keys(corpus["tags"])
    assert losses.num_rows == keys.num_rows == corpus["store"].n_tokens - 1
    assert losses.select(["window_id", "pos"]).equals(keys)  # one row per tag row, same order
    assert losses.schema.field("nll").type == pa.float32()
    want = plain_fixed_losses(spec, corpus["store"], L)
    got = losses.column("nll").to_numpy()
    assert want.std() > 0.5  # the models are far from uniform: a misaligned target would show
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
    meta = read_json(out / "meta.json")
    assert meta["tokens"] == losses.num_rows == summary["tokens"]
    assert meta["spec"] == spec and meta["windowing"] == "fixed" and meta["partial"] is False
    architectures = {
        "neox": "gpt_neox", "rwkv": "rwkv", "mamba": "mamba", "mamba2": "mamba2",
        "native": "attention", "jrt": "jrt",
    }  # fmt: skip
    assert meta["architecture"] == architectures[kind]
    assert meta["n_params"] > 0 and meta["dtype"] == "fp32" and meta["device"] == "cpu"
    assert meta["fingerprint"] == corpus["store"].fingerprint and meta["tokens_per_s"] > 0
    # JRT scores each prefix position from its own context, and says so
    assert ("prefix_scoring" in meta["loader_settings"]) == (kind == "jrt")


@pytest.mark.parametrize(
    "cpuinfo, native",
    [
        (
            "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n",
            True,
        ),
        ("flags\t\t: fpu sse avx2 amx_tile amx_bf16 amx_int8\n", True),
        ("flags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n", False),  # bf16 emulated only
        ("Features\t: fp asimd evtstrm aes sve bf16 i8mm\n", True),
        ("Features\t: fp asimd evtstrm aes\n", False),
        ("", False),
    ],
)
def test_cpu_bf16_detection(cpuinfo, native):
    assert cpu_has_native_bf16(cpuinfo) is native


def test_auto_dtype_follows_the_cpu(monkeypatch):
    import models.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == "bf16" and resolve_dtype("fp32", "cpu") == "fp32"
    # training stays fp32 on every CPU: trained weights must not depend on the CPU model
    assert resolve_dtype("auto", "cpu", training=True) == "fp32"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == "fp32" and resolve_dtype("bf16", "cpu") == "bf16"


def test_auto_dtype_on_a_gpu_without_bf16(monkeypatch):
    """One policy for eval and train: fp16 autocast for evaluation, fp32 for training."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") == "fp16"
    assert resolve_dtype("auto", "cuda:1", training=True) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda", training=True) == "bf16"


def test_bf16_on_cpu_stays_close_to_fp32(corpus, models_dir, tmp_path):
    """bf16 autocast (auto's choice on CPUs with native bf16) moves losses by rounding only."""
    spec = models_dir["neox"]
    run_eval(config(corpus, spec, tmp_path / "fp32"))
    run_eval(config(corpus, spec, tmp_path / "bf16", dtype="bf16"))
    assert read_json(tmp_path / "bf16" / "meta.json")["dtype"] == "bf16"
    fp32 = read_losses(tmp_path / "fp32").column("nll").to_numpy()
    bf16 = read_losses(tmp_path / "bf16").column("nll").to_numpy()
    diff = np.abs(bf16 - fp32)
    assert 0 < diff.max() < 0.1 and diff.mean() < 0.02


def test_batch_size_does_not_change_losses(corpus, models_dir, tmp_path):
    spec = models_dir["neox"]
    run_eval(config(corpus, spec, tmp_path / "b1", batch_size="1"))
    run_eval(config(corpus, spec, tmp_path / "b7", batch_size="7", chunk_windows=16))
    a = read_losses(tmp_path / "b1").column("nll").to_numpy()
    b = read_losses(tmp_path / "b7").column("nll").to_numpy()
    # Stated tolerance: fp32 matmuls of different batch shapes agree to 1e-5 in NLL.
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_interrupted_run_resumes_to_the_uninterrupted_result(corpus, models_dir, tmp_path):
    spec = models_dir["native"]
    whole = tmp_path / "whole"
    run_eval(config(corpus, spec, whole, chunk_windows=2))
    resumed = tmp_path / "resumed"
    run_eval(config(corpus, spec, resumed, chunk_windows=2, max_windows=5))
    meta = read_json(resumed / "meta.json")
    assert meta["partial"] is True and meta["windows_evaluated"] == 5
    assert read_losses(resumed).num_rows == 5 * L
    # the limited run ended inside chunk 2 (windows 4..5); the full run redoes that chunk only
    again = run_eval(config(corpus, spec, resumed, chunk_windows=2))
    meta = read_json(resumed / "meta.json")
    assert meta["partial"] is False and meta["counts"]["chunks_reused"] == 2
    assert again["tokens"] == corpus["store"].n_tokens - 1
    names = sorted(p.name for p in whole.glob("losses-*.parquet"))
    assert names == sorted(p.name for p in resumed.glob("losses-*.parquet"))
    for name in names:
        assert pq.read_table(whole / name).equals(
            pq.read_table(resumed / name), check_metadata=True
        )
    # a complete directory is skipped, and --overwrite redoes it
    assert run_eval(config(corpus, spec, resumed, chunk_windows=2))["skipped"] is True
    run_eval(config(corpus, spec, resumed, chunk_windows=2, overwrite=True))
    assert read_json(resumed / "meta.json")["counts"]["chunks_computed"] == len(names)


def test_resume_with_other_settings_is_refused(corpus, models_dir, tmp_path):
    out = tmp_path / "out"
    run_eval(config(corpus, models_dir["native"], out, max_windows=4))
    with pytest.raises(
        ArSliceError, match=r"other settings(?s:.*)settings.chunk_windows: 4 -> 2(?s:.*)--overwrite"
    ):
        run_eval(config(corpus, models_dir["native"], out, chunk_windows=2))
    with pytest.raises(ArSliceError, match="settings.spec: "):
        run_eval(config(corpus, models_dir["neox"], out, max_windows=2))
    # another dtype is another result: refused too, naming both values, never "complete"
    with pytest.raises(ArSliceError, match='settings.dtype: "fp32" -> "bf16"'):
        run_eval(config(corpus, models_dir["native"], out, max_windows=4, dtype="bf16"))
    # another windowing likewise; nothing of the finished output is touched by a refusal
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    with pytest.raises(ArSliceError, match='settings.windowing: "fixed" -> "rolling"'):
        run_eval(config(corpus, models_dir["native"], out, max_windows=4, windowing="rolling"))
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


@pytest.mark.slow
def test_killed_process_resumes(corpus, models_dir, tmp_path):
    """SIGKILL `arslice eval` once the ledger records its first chunk; rerunning finishes the same files.

    The tags are cut into windows of 4 tokens, one window per chunk, so the run writes dozens of
    chunks: the kill always lands mid-run, and a run that finished first fails the test."""
    from tests.reliability import kill_when

    tags = tmp_path / "tags-4"
    run_tag(
        TagConfig(
            tokens=str(corpus["store"].path),
            counts=str(corpus["root"] / "counts"),
            out=str(tags),
            window=4,
            workers=1,
        )
    )
    spec = models_dir["neox"]
    args = ["--model", spec, "--tags", tags, "--device", "cpu", "--batch-size", "1"]
    args += ["--chunk-windows", "1", "--dtype", "fp32"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert cli_main(["eval", *map(str, args), "--out", str(whole)]) == 0
    n_chunks = len(list(whole.glob("losses-*.parquet")))
    assert n_chunks >= 50
    ledger = killed / LEDGER_NAME  # a chunk counts as done once the ledger records it

    def recorded() -> bool:  # (a record, not the line saying which chunks it will write)
        return ledger.exists() and b'"part": ' in ledger.read_bytes()

    was_killed, stderr = kill_when(["eval", *args, "--out", killed], recorded)
    assert was_killed and not (killed / "meta.json").exists(), stderr
    assert 1 <= len(list(killed.glob("losses-*.parquet"))) < n_chunks
    assert cli_main(["eval", *map(str, args), "--out", str(killed)]) == 0
    assert read_json(killed / "meta.json")["counts"]["chunks_reused"] >= 1
    for p in sorted(whole.glob("losses-*.parquet")):
        assert pq.read_table(p).equals(pq.read_table(killed / p.name))


# ---- rolling windowing --------------------------------------------------------------------------


def test_rolling_losses_equal_lm_eval_rolling_loglikelihood(corpus, models_dir, tmp_path):
    spec = models_dir["neox"]
    out = tmp_path / "rolling"
    run_eval(config(corpus, spec, out, windowing="rolling", chunk_windows=3))
    losses = read_losses(out)
    assert losses.select(["window_id", "pos"]).equals(read_tag_keys(corpus["tags"]))
    nll = losses.column("nll").to_numpy()  # row r is stream index r + 1
    store, eos = corpus["store"], corpus["eos"]
    fn = plain_logits_fn(spec)
    assert_documents_equal_harness(nll, store, corpus["docs"], fn, eos)
    for d, doc in enumerate(corpus["docs"]):
        offset = int(store.doc_offsets[d])
        # the document's EOS: predicted from the at most L tokens of [EOS] + doc before it
        context = ([eos] + list(doc))[-L:]
        eos_nll = plain_nll(fn, context, [*context[1:], eos])[-1]
        assert nll[offset + len(doc) - 1] == pytest.approx(eos_nll, abs=2e-4)
    fixed = plain_fixed_losses(spec, store, L)
    assert (
        np.abs(fixed - nll).max() > 0.1
    )  # the two windowings differ: the test can tell them apart
    meta = read_json(out / "meta.json")
    assert meta["windowing"] == "rolling"


def test_safari_settings_are_printed_and_recorded_and_model_config_is_part_of_the_plan(
    tmp_path, make_store, capsys
):
    """A safari checkpoint with no config beside it, evaluated with its config given as
    --model-config: the settings used are printed and land in meta.json, and the config's
    identity is part of the plan."""
    fixture = UPSTREAM / "safari-no-modulate"
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, n).tolist() for n in (40, 7, 70)]
    store = make_store(docs, vocab_size=50, name="val")
    counts = CountConfig(tokens=[str(store.path)], out=str(tmp_path / "counts"), workers=1)
    run_count(counts)
    tags = tmp_path / "tags"
    run_tag(
        TagConfig(tokens=str(store.path), counts=counts.out, out=str(tags), window=L, workers=1)
    )
    corpus = {"tags": tags}
    spec, yaml_config = f"safari:{fixture / 'model.pt'}", fixture / "configs" / "hyena-tiny.yaml"
    with printing_summaries():  # (what arslice wraps a command in)
        run_eval(config(corpus, spec, tmp_path / "given", model_config=str(yaml_config)))
    assert "model settings" in capsys.readouterr().out
    meta = read_json(tmp_path / "given" / "meta.json")
    assert meta["loader_settings"]["modulate"] is False
    assert meta["loader_settings"]["config"].startswith(str(yaml_config))
    assert meta["model_config"]["path"] == str(yaml_config.resolve())
    run_eval(config(corpus, spec, tmp_path / "default"))
    assert read_json(tmp_path / "default" / "meta.json")["loader_settings"]["modulate"] is True
    given, default = (
        read_losses(tmp_path / d).column("nll").to_numpy() for d in ("given", "default")
    )
    assert np.abs(given - default).max() > 0.1  # modulation on or off: other losses
    with pytest.raises(ArSliceError, match="model_config"):
        run_eval(config(corpus, spec, tmp_path / "default", model_config=str(yaml_config)))


def harness_prefix_token_id(tokenizer, custom=None) -> int:
    """lm-evaluation-harness HFLM.prefix_token_id (lm_eval/models/huggingface.py), transcribed."""
    if custom is not None:
        return custom
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def bos_corpus(tmp_path_factory, bpe_tokenizer, stdlib_texts):
    """A store of a tokenizer with a BOS of its own (`<|im_start|>`, as SmolLM2's), its tags, and
    two model directories with that tokenizer: one declaring the BOS, one declaring only EOS."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bos")
    tok = Tokenizer.from_str(bpe_tokenizer.to_str())
    tok.add_special_tokens(["<|im_start|>"])
    docs = [tok.encode(t).ids[:n] for t, n in zip(stdlib_texts[20:], (45, 5, 31, 12))]
    store = write_token_store(root / "val", docs, tokenizer_info=describe(tok, "bos"))
    counts = CountConfig(tokens=[str(store.path)], out=str(root / "counts"), workers=1)
    run_count(counts)
    run_tag(TagConfig(tokens=str(store.path), counts=counts.out, out=str(root / "tags"), window=L))
    dirs = {}
    for kind, special in (
        ("bos", {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"}),
        ("eos_only", {"eos_token": "<|endoftext|>"}),
    ):
        model_dir = make_neox(root / kind, None, vocab=VOCAB + 1)
        PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(model_dir)
        dirs[kind] = model_dir
    return {"store": store, "tags": root / "tags", "docs": docs, "dirs": dirs}


@pytest.mark.parametrize("kind, custom", [("eos_only", None), ("bos", None), ("bos", 7)])
def test_rolling_prefix_is_the_harness_prefix_token(bos_corpus, tmp_path, kind, custom):
    """Per-document totals equal lm-eval's loglikelihood_rolling with its prefix_token_id: the
    model tokenizer's BOS when it declares one, else its EOS; --prefix-token overrides it."""
    from transformers import AutoTokenizer

    model_dir = bos_corpus["dirs"][kind]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prefix = harness_prefix_token_id(tokenizer, custom)
    assert (prefix == tokenizer.eos_token_id) == (kind == "eos_only" and custom is None)
    out = tmp_path / "rolling"
    run_eval(config(bos_corpus, f"hf:{model_dir}", out, windowing="rolling", prefix_token=custom))
    meta = read_json(out / "meta.json")
    assert meta["prefix_token"] == prefix
    assert ("BOS" in meta["prefix_token_source"]) == (kind == "bos" and custom is None)
    nll = read_losses(out).column("nll").to_numpy()  # row r is stream index r + 1
    fn = plain_logits_fn(f"hf:{model_dir}")
    assert_documents_equal_harness(nll, bos_corpus["store"], bos_corpus["docs"], fn, prefix)
    # and the prefix matters: another one moves the document's total
    doc = bos_corpus["docs"][1]
    elsewhere = 1 if prefix == tokenizer.eos_token_id else tokenizer.eos_token_id
    moved = (
        lm_eval_token_nlls(fn, doc, elsewhere, L).sum()
        - lm_eval_token_nlls(fn, doc, prefix, L).sum()
    )
    assert abs(moved) > 1e-2


def harness_tok_encode(tokenizer, string: str, add_bos_token=None) -> list[int]:
    """lm-evaluation-harness 0.4 `HFLM.tok_encode(string)` (lm_eval/models/huggingface.py, with
    utils._add_special_kwargs and has_bos_prefix), transcribed: the tokenizer's own default
    unless the model was given `add_bos_token`, and no special tokens when the text already
    starts with the prefix token's string."""
    kwargs = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
    if string.startswith(tokenizer.decode(harness_prefix_token_id(tokenizer))):
        kwargs["add_special_tokens"] = False
    return tokenizer.encode(string, **kwargs)


def adds_bos_model(bos_corpus, root: Path) -> Path:
    """The `bos` model of bos_corpus with a tokenizer whose encode adds its BOS itself (a
    TemplateProcessing post-processor, as Llama-3's tokenizer.json and Llama's
    `add_bos_token=True` build): the same vocabulary, so the same fingerprint."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(bos_corpus["dirs"]["bos"] / "tokenizer.json"))
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    model_dir = make_neox(root / "adds-bos", None, vocab=VOCAB + 1)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|endoftext|>"
    ).save_pretrained(model_dir)
    return model_dir


def test_harness_bos_reproduces_the_harness_default_for_a_tokenizer_that_adds_bos(
    bos_corpus, tmp_path
):
    """lm-eval windows tok_encode(doc) = [BOS] + doc after its BOS prefix: every document token
    reads two BOS. --harness-bos gives those per-token losses; plain rolling gives the harness's
    with add_bos_token=False; the two differ."""
    from transformers import AutoTokenizer

    model_dir = adds_bos_model(bos_corpus, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    bos = harness_prefix_token_id(tokenizer)
    assert bos == tokenizer.bos_token_id != tokenizer.eos_token_id
    store, docs, spec = bos_corpus["store"], bos_corpus["docs"], f"hf:{model_dir}"
    texts = [tokenizer.decode(doc) for doc in docs]
    assert [tokenizer.encode(t, add_special_tokens=False) for t in texts] == docs
    assert [harness_tok_encode(tokenizer, t) for t in texts] == [[bos, *doc] for doc in docs]
    assert [harness_tok_encode(tokenizer, t, add_bos_token=False) for t in texts] == docs

    run_eval(config(bos_corpus, spec, tmp_path / "harness", windowing="rolling", harness_bos=True))
    run_eval(config(bos_corpus, spec, tmp_path / "plain", windowing="rolling"))
    meta = read_json(tmp_path / "harness" / "meta.json")
    assert meta["harness_bos"] == [bos] and meta["prefix_token"] == bos
    assert read_json(tmp_path / "plain" / "meta.json")["harness_bos"] is None
    harness, plain = (
        read_losses(tmp_path / d).column("nll").to_numpy() for d in ("harness", "plain")
    )
    assert len(harness) == len(plain) == store.n_tokens - 1  # the same rows, keyed as the tags
    fn = plain_logits_fn(spec)
    for d, (doc, text) in enumerate(zip(docs, texts)):
        want = lm_eval_token_nlls(fn, harness_tok_encode(tokenizer, text), bos, L)
        assert len(want) == len(doc) + 1  # p(BOS | BOS) first: it predicts no stream token
        want = want[1:]
        offset = int(store.doc_offsets[d])
        rows = np.arange(offset, offset + len(doc)) - 1
        if d == 0:  # the stream's first token is no target: it has no row
            want, rows = want[1:], rows[1:]
        np.testing.assert_allclose(harness[rows], want, rtol=0, atol=2e-4)
    # plain rolling: the harness run with add_bos_token=False
    assert_documents_equal_harness(plain, store, docs, fn, bos)
    assert np.abs(harness - plain).max() > 1e-2


def test_harness_bos_is_plain_rolling_for_a_tokenizer_that_adds_nothing(bos_corpus, tmp_path):
    model_dir = bos_corpus["dirs"]["bos"]  # declares a BOS, but its encode does not add it
    spec = f"hf:{model_dir}"
    run_eval(config(bos_corpus, spec, tmp_path / "harness", windowing="rolling", harness_bos=True))
    run_eval(config(bos_corpus, spec, tmp_path / "plain", windowing="rolling"))
    assert read_json(tmp_path / "harness" / "meta.json")["harness_bos"] == []
    harness, plain = (
        read_losses(tmp_path / d).column("nll").to_numpy() for d in ("harness", "plain")
    )
    np.testing.assert_array_equal(harness, plain)
    with pytest.raises(ArSliceError, match="--harness-bos applies to --windowing rolling"):
        run_eval(config(bos_corpus, spec, tmp_path / "fixed", harness_bos=True))


def test_prefix_token_needs_rolling_windows(corpus, models_dir, tmp_path):
    with pytest.raises(ArSliceError, match="--prefix-token applies to --windowing rolling"):
        run_eval(config(corpus, models_dir["neox"], tmp_path / "o", prefix_token=3))


# ---- consistency checks -------------------------------------------------------------------------


def test_tokenizer_mismatch_is_refused_unless_skipped(corpus, stdlib_texts, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(
        stdlib_texts[:3],
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False),
    )
    other.save(str(tmp_path / "other.json"))
    spec = f"hf:{make_neox(tmp_path / 'm', tmp_path / 'other.json')}"
    with pytest.raises(TokenizerMismatch, match=r"tokenizer mismatch: model hf:.*token store"):
        run_eval(config(corpus, spec, tmp_path / "out"))
    assert not (tmp_path / "out" / "meta.json").exists()
    run_eval(config(corpus, spec, tmp_path / "out", skip_tokenizer_check=True, max_windows=1))
    meta = read_json(tmp_path / "out" / "meta.json")
    assert meta["skip_tokenizer_check"] is True
    assert meta["model_tokenizer_fingerprint"] != meta["fingerprint"]


def test_model_directory_whose_tokenizer_transformers_resaved_needs_no_skip(
    corpus, bpe_tokenizer_path, tmp_path
):
    """The store's tokenizer.json has null BPE affixes (as the real GPT-2 and NeoX files); the
    model directory's copy went through transformers, which writes them as "". One encoding."""
    from transformers import AutoTokenizer, GPT2Tokenizer

    model_dir = make_neox(tmp_path / "m", None)
    GPT2Tokenizer(tokenizer_file=str(bpe_tokenizer_path)).save_pretrained(tmp_path / "tok")
    AutoTokenizer.from_pretrained(str(tmp_path / "tok")).save_pretrained(model_dir)
    saved = json.loads((model_dir / "tokenizer.json").read_text())
    assert saved["model"]["end_of_word_suffix"] == ""
    assert json.loads(bpe_tokenizer_path.read_text())["model"]["end_of_word_suffix"] is None
    run_eval(config(corpus, f"hf:{model_dir}", tmp_path / "out", max_windows=1))
    meta = read_json(tmp_path / "out" / "meta.json")
    assert meta["model_tokenizer_fingerprint"] == meta["fingerprint"]
    assert meta["skip_tokenizer_check"] is False


def test_vocabulary_too_small_is_refused(corpus, bpe_tokenizer_path, tmp_path):
    spec = f"hf:{make_neox(tmp_path / 'm', bpe_tokenizer_path, vocab=256)}"
    biggest = int(np.max(corpus["store"].tokens))
    with pytest.raises(
        ArSliceError, match=rf"vocabulary of 256 ids but token store .* holds id {biggest}"
    ):
        run_eval(config(corpus, spec, tmp_path / "out"))


def test_window_longer_than_positions_is_refused(corpus, bpe_tokenizer_path, tmp_path):
    spec = f"hf:{make_neox(tmp_path / 'm', bpe_tokenizer_path, max_positions=16)}"
    with pytest.raises(ArSliceError, match=r"windows of 32 tokens .* positional limit of 16"):
        run_eval(config(corpus, spec, tmp_path / "out"))


def test_non_finite_losses_are_refused(corpus, bpe_tokenizer_path, tmp_path):
    from transformers import GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM.from_pretrained(make_neox(tmp_path / "ok", bpe_tokenizer_path))
    s = np.asarray(corpus["store"].tokens)
    early = set(s[: 2 * L + 1].tolist())
    bad = next(int(t) for t in s[2 * L + 1 : 3 * L + 1] if int(t) not in early)
    with torch.no_grad():  # a token first read in window 2 gets a NaN input embedding
        model.gpt_neox.embed_in.weight[bad] = float("nan")
    spec = f"hf:{_save_hf(model, tmp_path / 'nan', bpe_tokenizer_path)}"
    with pytest.raises(
        ArSliceError, match=r"non-finite loss \(nan\) at window 2 pos \d+ \(\d+ such"
    ):
        run_eval(config(corpus, spec, tmp_path / "out"))
    assert not list((tmp_path / "out").glob("losses-*.parquet"))


def test_tags_and_store_must_agree(corpus, models_dir, tmp_path, make_store):
    shorter = make_store(
        corpus["docs"][:3], vocab_size=VOCAB, fingerprint=corpus["store"].fingerprint
    )
    with pytest.raises(
        BadInput, match=r"windows.parquet: row \d+ has n_targets .*\(pass --tokens\)"
    ):
        run_eval(config(corpus, models_dir["native"], tmp_path / "o", tokens=str(shorter.path)))
    other = make_store(corpus["docs"], vocab_size=VOCAB, fingerprint="e" * 64)
    with pytest.raises(TokenizerMismatch, match="tokenizer mismatch: tags"):
        run_eval(config(corpus, models_dir["native"], tmp_path / "o", tokens=str(other.path)))
    incomplete = tmp_path / "tags"
    shutil.copytree(corpus["tags"], incomplete)
    (incomplete / "tags-00000.parquet").unlink()
    with pytest.raises(BadInput, match=r"0 tags-\*.parquet files hold 0 rows"):
        run_eval(
            replace(config(corpus, models_dir["native"], tmp_path / "o"), tags=str(incomplete))
        )


def test_out_of_memory_halves_the_batch_and_carries_on(corpus, models_dir):
    """A forward that runs out of memory above 2 sequences (as CUDA would) is retried smaller."""
    from models import load_model
    from pipeline.eval import fixed_sequences, make_forward, open_tags

    tags = open_tags(corpus["tags"])
    forward = make_forward(load_model(models_dir["neox"]), "cpu", "fp32")
    calls = []

    def limited(inputs, targets):
        calls.append(len(inputs))
        if len(inputs) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(inputs, targets)

    seqs = fixed_sequences(tags, 0, tags.n_windows)
    runner = BatchRunner(limited, batch_size=8)
    got = np.full(int(tags.n_targets.sum()), np.nan, dtype=np.float32)
    runner.run(seqs, got)
    assert runner.batch_size == 2 and runner.backoffs == 2 and calls[:3] == [8, 4, 2]
    ref = np.full_like(got, np.nan)
    BatchRunner(forward, batch_size=1).run(seqs, ref)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    one = BatchRunner(
        lambda i, t: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory")), 1
    )
    with pytest.raises(ArSliceError, match="out of memory with a single sequence of 32 tokens"):
        one.run([Sequence(np.zeros(32, np.int64), np.zeros(32, np.int64), 0, 0)], got)


def test_cli_prints_errors_without_traceback(corpus, bpe_tokenizer_path, tmp_path, capsys):
    from pipeline.cli import main

    spec = f"hf:{make_neox(tmp_path / 'm', bpe_tokenizer_path, max_positions=16)}"
    argv = ["eval", "--model", spec, "--tags", str(corpus["tags"]), "--out", str(tmp_path / "out")]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "arslice eval: error: windows of 32 tokens" in err and "positional limit of 16" in err
    assert "Traceback" not in err


def test_based_checkpoint_evaluates_through_the_cli(corpus, bpe_tokenizer_path, tmp_path):
    from pipeline.cli import main

    spec = f"based:{make_based(tmp_path / 'based-tiny', bpe_tokenizer_path)}"
    out = tmp_path / "out"
    argv = ["eval", "--model", spec, "--tags", str(corpus["tags"]), "--out", str(out)]
    assert main([*argv, "--device", "cpu", "--dtype", "fp32", "--batch-size", "3"]) == 0
    losses = read_losses(out)
    assert losses.select(["window_id", "pos"]).equals(read_tag_keys(corpus["tags"]))
    want = plain_fixed_losses(spec, corpus["store"], L)
    assert want.std() > 0.5
    np.testing.assert_allclose(losses.column("nll").to_numpy(), want, rtol=0, atol=2e-4)
    meta = read_json(out / "meta.json")
    assert meta["spec"] == spec and meta["architecture"] == "based" and meta["name"] == "based-tiny"
    assert meta["fingerprint"] == corpus["store"].fingerprint


def test_a_model_s_default_name_comes_from_its_spec():
    from models.checkpoints.registry import ModelSpec

    def name(spec):
        return ModelSpec.parse(spec).default_name

    assert name("hf:EleutherAI/pythia-160m") == "pythia-160m"
    assert name("native:runs/demo/models/attention/") == "attention"
    assert name("safari:/ckpts/hyena-153m.ckpt") == "hyena-153m"
    assert json.dumps(name("hf:./x y")) == '"x_y"'


@pytest.mark.gpu
def test_cuda_bf16_matches_cpu_fp32(corpus, models_dir, tmp_path):
    spec = models_dir["neox"]
    run_eval(config(corpus, spec, tmp_path / "cpu"))
    run_eval(replace(config(corpus, spec, tmp_path / "bf16"), device="cuda", dtype="auto"))
    run_eval(replace(config(corpus, spec, tmp_path / "fp32"), device="cuda", dtype="fp32"))
    cpu = read_losses(tmp_path / "cpu").column("nll").to_numpy()
    assert read_json(tmp_path / "bf16" / "meta.json")["dtype"] in ("bf16", "fp16")
    np.testing.assert_allclose(
        read_losses(tmp_path / "fp32").column("nll").to_numpy(), cpu, atol=1e-3
    )
    bf16 = read_losses(tmp_path / "bf16").column("nll").to_numpy()
    assert np.abs(bf16 - cpu).mean() < 0.05 and np.abs(bf16 - cpu).max() < 0.5


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["hyena", "base_conv", "rwkv"])
def test_other_native_architectures_equal_plain_forward(
    mixer, corpus, bpe_tokenizer_path, tmp_path
):
    model = save_native_lm(
        tmp_path / mixer, VOCAB, tokenizer=bpe_tokenizer_path, mixer=mixer, d_model=64, l_max=64,
        seed=3, spread=0.5,
    )  # fmt: skip
    spec = f"native:{model}"
    run_eval(config(corpus, spec, tmp_path / "out"))
    got = read_losses(tmp_path / "out").column("nll").to_numpy()
    np.testing.assert_allclose(got, plain_fixed_losses(spec, corpus["store"], L), rtol=0, atol=2e-4)
    assert read_json(tmp_path / "out" / "meta.json")["architecture"] == mixer
