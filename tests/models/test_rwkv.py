"""RWKV-4: chunked WKV == sequential recurrence == transformers' RwkvForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from models import load_model
from models.backbone import LanguageModel, ModelConfig
from models.checkpoints.hf_rwkv import rwkv_from_transformers
from models.mixers import rwkv as R
from models.mixers.rwkv import FastRwkv, wkv_chunked, wkv_sequential
from models.nll import per_token_nll

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Tolerances: fp32 recurrence vs fp64 factorised sums differ by float32 rounding of outputs ~1.
WKV_ATOL = 2e-5
# Whole-model logits (a few layers of fp32 matmuls on top of the WKV difference).
LOGITS_ATOL = 1e-4


def naive_wkv(time_decay, time_first, k, v):
    """The definition, summed directly in float64 (no stabilisation needed at these sizes)."""
    B, T, D = k.shape
    w, u = torch.exp(time_decay.double()), time_first.double()
    k, v = k.double(), v.double()
    out = torch.empty(B, T, D, dtype=torch.float64)
    for t in range(T):
        i = torch.arange(t, dtype=torch.float64)[:, None]
        weights = torch.exp(k[:, :t] - (t - 1 - i) * w)  # (B, t, D)
        bonus = torch.exp(u + k[:, t])
        out[:, t] = ((weights * v[:, :t]).sum(1) + bonus * v[:, t]) / (weights.sum(1) + bonus)
    return out


def test_sequential_recurrence_matches_the_definition():
    torch.manual_seed(0)
    td, tf = torch.randn(6) * 2, torch.randn(6)
    k, v = torch.randn(2, 30, 6) * 3, torch.randn(2, 30, 6)
    torch.testing.assert_close(
        wkv_sequential(td, tf, k, v).double(), naive_wkv(td, tf, k, v), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        wkv_sequential(td.double(), tf.double(), k.double(), v.double()), naive_wkv(td, tf, k, v)
    )


@settings(max_examples=20, deadline=None)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 70),
    D=st.integers(1, 9),
    chunk=st.sampled_from([1, 2, 5, 16, 64]),
    decay_scale=st.floats(0.0, 4.0),
    key_scale=st.floats(0.0, 10.0),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_sequential(B, T, D, chunk, decay_scale, key_scale, seed):
    g = torch.Generator().manual_seed(seed)
    td = torch.randn(D, generator=g) * decay_scale
    tf = torch.randn(D, generator=g)
    k = torch.randn(B, T, D, generator=g) * key_scale
    v = torch.randn(B, T, D, generator=g)
    ref = wkv_sequential(td.double(), tf.double(), k.double(), v.double())
    torch.testing.assert_close(
        wkv_chunked(td, tf, k, v, chunk).double(), ref, atol=WKV_ATOL, rtol=1e-4
    )
    torch.testing.assert_close(wkv_sequential(td, tf, k, v).double(), ref, atol=WKV_ATOL, rtol=1e-4)


def test_chunked_is_exact_for_extreme_decays_and_keys():
    torch.manual_seed(1)
    # from no decay at all (w ~ 2e-9) to w ~ 22 000 per step, which cannot be factorised
    td = torch.tensor([-20.0, -5.0, 0.0, 2.0, 3.5, 5.0, 8.0, 10.0])
    tf = torch.randn(8)
    for key_scale in (1.0, 20.0, 400.0):
        k, v = torch.randn(2, 90, 8) * key_scale, torch.randn(2, 90, 8)
        ref = wkv_sequential(td.double(), tf.double(), k.double(), v.double())  # fp64 reference
        out = wkv_chunked(td, tf, k, v, 16)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, atol=WKV_ATOL, rtol=1e-4)


def tiny_hf_rwkv(rescale_every: int = 0, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.RwkvConfig(
        vocab_size=300, context_length=128, hidden_size=32, num_hidden_layers=3,
        intermediate_size=96, rescale_every=rescale_every,
    )  # fmt: skip
    model = transformers.RwkvForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the RWKV parameters beyond their near-constant initialisation
        for name, p in model.named_parameters():
            if "time_decay" in name:
                p.copy_(torch.randn_like(p) * 2)
            elif "time_first" in name or "time_mix" in name:
                p.copy_(torch.rand_like(p))
    return model


def test_ours_equals_transformers_rwkv_on_the_same_weights():
    hf = tiny_hf_rwkv()
    ours = rwkv_from_transformers(hf)
    ids = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        ref = hf(ids).logits
        chunked = ours(ids)
        for block in ours.rwkv.blocks:
            block.attention.mode = "sequential"
        sequential = ours(ids)
    torch.testing.assert_close(chunked, ref, atol=LOGITS_ATOL, rtol=1e-4)
    torch.testing.assert_close(sequential, ref, atol=LOGITS_ATOL, rtol=1e-4)
    torch.testing.assert_close(chunked, sequential, atol=LOGITS_ATOL, rtol=1e-4)


def test_transformers_inference_rescaling_is_undone():
    hf = tiny_hf_rwkv(rescale_every=1)
    ids = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits  # the first eval forward rescales the weights in place
        assert hf.rwkv.layers_are_rescaled
        ours = rwkv_from_transformers(hf)(ids)
    # same function up to LayerNorm's epsilon acting on a hidden state halved per layer
    torch.testing.assert_close(ours, ref, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("fast", [True, False])
def test_hf_rwkv_directory_loads_and_scores(tmp_path, fast):
    hf = tiny_hf_rwkv(seed=2)
    hf.save_pretrained(tmp_path / "rwkv")
    loaded = load_model(f"hf:{tmp_path / 'rwkv'}", fast_path=fast)
    assert loaded.architecture == "rwkv" and loaded.max_positions is None
    assert loaded.vocab_size == 300 and loaded.tokenizer_fingerprint is None
    assert isinstance(loaded.model, FastRwkv) == fast
    assert loaded.n_params == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 300, (2, 41))
    with torch.no_grad():
        logits = hf(ids[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, 300), ids[:, 1:].reshape(-1), reduction="none")
    got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got.view(-1), expected, atol=LOGITS_ATOL, rtol=1e-4)


def test_rwkv_language_model_chunked_equals_sequential():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=50, d_model=16, n_layers=2, sequence_mixer="rwkv"))
    model.eval()
    ids = torch.randint(0, 50, (2, 37))
    with torch.no_grad():
        chunked = model(ids)
        for layer in model.backbone.layers:
            layer.sequence_mixer.mode = "sequential"
        sequential = model(ids)
    torch.testing.assert_close(chunked, sequential, atol=LOGITS_ATOL, rtol=1e-4)


def reference64(td, tf, k, v):
    return wkv_sequential(td.double(), tf.double(), k.double(), v.double())


def test_every_fast_path_matches_the_recurrence_across_blocks_and_tails():
    """Decays spanning the chunk-16, chunk-4 and window forms, channels in scattered order (so the
    groups are gathered), T not a multiple of the chunk and blocks of a single chunk."""
    torch.manual_seed(3)
    D = 24
    td = torch.linspace(-6, 5, D)[torch.randperm(D)]
    tf = torch.randn(D)
    k, v = torch.randn(3, 203, D) * 3, torch.randn(3, 203, D)
    ref = reference64(td, tf, k, v)
    torch.testing.assert_close(wkv_chunked(td, tf, k, v).double(), ref, atol=WKV_ATOL, rtol=1e-4)
    torch.testing.assert_close(
        wkv_chunked(td, tf, k.bfloat16(), v.bfloat16()).double(),
        reference64(td, tf, k.bfloat16(), v.bfloat16()),
        atol=WKV_ATOL,
        rtol=1e-4,
    )
    w64, u64 = torch.exp(td.double()), tf.double()
    slow = 16 * w64 <= R._CHUNK_DECAY_BUDGET
    for block in (1, 1 << 20):  # one chunk per block, and the whole sequence in one block
        out = torch.empty(3, 203, int(slow.sum()))
        ok = R._wkv_chunks_fp32(
            w64[slow], u64[slow], k[..., slow], v[..., slow], out, 16, block_elements=block
        )
        assert ok.all()
        torch.testing.assert_close(out.double(), ref[..., slow], atol=WKV_ATOL, rtol=1e-4)
    fast = ~(4 * w64 <= R._CHUNK_DECAY_BUDGET)
    out = torch.empty(3, 203, int(fast.sum()))
    ok = R._wkv_window_fp32(w64[fast], u64[fast], k[..., fast], v[..., fast], out)
    assert ok.all()
    torch.testing.assert_close(out.double(), ref[..., fast], atol=WKV_ATOL, rtol=1e-4)


def test_fast_paths_flag_channels_they_cannot_prove_accurate():
    """A key spike of +150 inside a chunk sends the rows before it below fp32's range in the chunk
    form; a key range of 400 needs more than the window's tokens. Both must say so (and
    `wkv_chunked` then recomputes those channels exactly)."""
    torch.manual_seed(4)
    k, v = torch.randn(1, 64, 2), torch.randn(1, 64, 2)
    k[0, 40, 0] = 150.0
    k[0, 10, 1] = -400.0
    w64 = torch.tensor([1.0, 1.0], dtype=torch.float64)
    u64 = torch.zeros(2, dtype=torch.float64)
    out = torch.empty(1, 64, 2)
    ok = R._wkv_chunks_fp32(w64, u64, k, v, out, 16)
    assert not ok[0]
    ok = R._wkv_window_fp32(w64 * 20, u64, k, v, out)
    assert not ok[1]
    td = torch.log(w64).float()
    torch.testing.assert_close(
        wkv_chunked(td, u64.float(), k, v).double(),
        reference64(td, u64.float(), k, v),
        atol=WKV_ATOL,
        rtol=1e-4,
    )


def test_chunked_gradients_match_the_recurrence():
    torch.manual_seed(5)
    td = (torch.randn(6) * 2).requires_grad_()
    tf = torch.randn(6).requires_grad_()
    k = (torch.randn(2, 40, 6) * 2).requires_grad_()
    v = torch.randn(2, 40, 6).requires_grad_()
    weights = torch.randn(2, 40, 6)
    grads = []
    for fn in (wkv_chunked, wkv_sequential):
        (fn(td, tf, k, v) * weights).sum().backward()
        grads.append([t.grad.clone() for t in (td, tf, k, v)])
        for t in (td, tf, k, v):
            t.grad = None
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
