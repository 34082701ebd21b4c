"""Scoring under bf16 autocast (CPU here; the gpu-marked cases repeat it on CUDA)."""

from __future__ import annotations

import pytest
import torch

from models.checkpoints.registry import wrap_language_model
from models.mixers.rwkv import wkv_chunked, wkv_sequential
from models.nll import per_token_nll
from tests.tiny_models import tiny_mixer_lm

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


MIXERS = ["attention", "base_conv", "hyena", "rwkv"]


def loaded_model(mixer: str, device: str = "cpu"):
    model = tiny_mixer_lm(mixer, 300, d_model=32, l_max=64).eval().to(device)
    return wrap_language_model(model, f"native:{mixer}", tokenizer_fingerprint=None)


def nll_fp32_and_bf16(mixer: str, device: str):
    loaded = loaded_model(mixer, device)
    ids = torch.randint(0, 300, (2, 64), device=device)
    fp32 = per_token_nll(loaded, ids[:, :-1], ids[:, 1:], chunk_size=50)
    with torch.autocast(device, dtype=torch.bfloat16):
        bf16 = per_token_nll(loaded, ids[:, :-1], ids[:, 1:], chunk_size=50)
    return fp32, bf16


@pytest.mark.parametrize("mixer", MIXERS)
def test_bf16_autocast_scores_close_to_fp32_on_cpu(mixer):
    fp32, bf16 = nll_fp32_and_bf16(mixer, "cpu")
    assert bf16.dtype == torch.float32 and bf16.shape == (2, 63)
    assert torch.isfinite(bf16).all()
    # bf16 keeps ~3 significant digits: per-token NLLs near log(300) = 5.7 agree to a few hundredths
    assert (bf16 - fp32).abs().mean() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("mixer", MIXERS)
def test_bf16_autocast_scores_close_to_fp32_on_cuda(mixer):
    fp32, bf16 = nll_fp32_and_bf16(mixer, "cuda")
    assert torch.isfinite(bf16).all() and (bf16 - fp32).abs().mean() < 0.05


@pytest.mark.gpu
def test_chunked_wkv_on_cuda_equals_sequential():
    torch.manual_seed(0)
    td, tf = torch.randn(64, device="cuda") * 2, torch.randn(64, device="cuda")
    k, v = torch.randn(2, 500, 64, device="cuda") * 5, torch.randn(2, 500, 64, device="cuda")
    ref = wkv_sequential(td.double(), tf.double(), k.double(), v.double())
    torch.testing.assert_close(wkv_chunked(td, tf, k, v).double(), ref, atol=2e-5, rtol=1e-4)
