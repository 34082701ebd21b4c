"""Sequence mixers: causality, agreement with direct formulas, and Zoology's parameter names."""

from __future__ import annotations

import pytest
import torch

from models.backbone import LanguageModel, ModelConfig
from models.mixers.base_conv import BaseConv
from models.mixers.hyena import Hyena, fft_causal_conv
from tests.models.checks import assert_never_looks_ahead

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


IMPLICIT_FILTER_KEYS = [
    "pos_emb.z", "pos_emb.t", "modulation.deltas", "bias",
    "implicit_filter.0.weight", "implicit_filter.0.bias", "implicit_filter.1.freq",
    "implicit_filter.2.weight", "implicit_filter.2.bias", "implicit_filter.3.freq",
    "implicit_filter.4.weight", "implicit_filter.4.bias", "implicit_filter.5.freq",
    "implicit_filter.6.weight",
]  # fmt: skip
# Zoology's per-layer sequence-mixer keys (zoology/mixers/{base_conv,convolution,hyena,rwkv}.py)
ZOOLOGY_MIXER_KEYS = {
    ("base_conv", 3): ["projection.weight", "projection.bias", "conv.conv.weight", "conv.conv.bias"],
    ("base_conv", -1): [
        "projection.weight", "projection.bias", "conv.pos_emb.z",
        "conv.mlp.0.weight", "conv.mlp.0.bias", "conv.mlp.2.weight", "conv.mlp.2.bias",
    ],
    ("hyena", None): [
        "in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias",
        "short_filter.weight", "short_filter.bias",
    ] + [f"filter_fn.{k}" for k in IMPLICIT_FILTER_KEYS],
    ("rwkv", None): [
        "time_decay", "time_first", "time_mix_k", "time_mix_v", "time_mix_r",
        "key.weight", "value.weight", "receptance.weight", "output.weight",
    ],
}  # fmt: skip
RWKV_STATE_MIXER_KEYS = [
    "time_mix_k",
    "time_mix_r",
    "key.weight",
    "receptance.weight",
    "value.weight",
]


def build(mixer: str, kernel_size=None, seed: int = 0, **kw) -> LanguageModel:
    torch.manual_seed(seed)
    mixer_kwargs = {} if kernel_size is None else {"kernel_size": kernel_size}
    if mixer == "hyena":
        mixer_kwargs["filter_order"] = 16
    cfg = ModelConfig(
        vocab_size=61, d_model=16, n_layers=2, sequence_mixer=mixer,
        sequence_mixer_kwargs=mixer_kwargs, l_max=48, **kw,
    )  # fmt: skip
    return LanguageModel(cfg).eval()


@pytest.mark.parametrize("mixer, kernel", list(ZOOLOGY_MIXER_KEYS))
def test_mixer_keys_are_zoologys(mixer, kernel):
    model = build(mixer, kernel)
    keys = model.state_dict().keys()
    for i in range(2):
        mixer_keys = sorted(
            k.split(".sequence_mixer.")[1] for k in keys if f"layers.{i}.sequence_mixer." in k
        )
        assert mixer_keys == sorted(ZOOLOGY_MIXER_KEYS[(mixer, kernel)])
    state_keys = sorted(k.split(".state_mixer.")[1] for k in keys if "layers.0.state_mixer." in k)
    expected = (
        RWKV_STATE_MIXER_KEYS
        if mixer == "rwkv"
        else ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    )
    assert state_keys == sorted(expected)
    assert not any(
        "position_embeddings" in k for k in keys
    )  # only attention gets positions by default


@pytest.mark.parametrize("mixer, kernel", list(ZOOLOGY_MIXER_KEYS))
def test_changing_future_tokens_never_changes_earlier_outputs(mixer, kernel):
    # FFT convolutions leak rounding noise (~1e-7) backwards, never signal
    assert_never_looks_ahead(build(mixer, kernel), 61, atol=2e-5)


def direct_causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """y[b, d, t] = sum_{s <= t} k[d, s] u[b, d, t - s], by loops."""
    B, D, L = u.shape
    y = torch.zeros(B, D, L, dtype=torch.float64)
    for t in range(L):
        for s in range(t + 1):
            y[:, :, t] += k[:, s].double() * u[:, :, t - s].double()
    return y


def test_fft_convolution_equals_direct_causal_convolution():
    torch.manual_seed(0)
    u, k, skip = torch.randn(2, 3, 37), torch.randn(3, 37), torch.randn(3)
    expected = direct_causal_conv(u, k) + u.double() * skip.double()[:, None]
    torch.testing.assert_close(fft_causal_conv(u, k, skip).double(), expected, atol=1e-4, rtol=1e-4)


def short_conv_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv: y[b, t, c] = bias[c] + sum_j weight[c, 0, j] x[b, t - (K-1) + j, c]."""
    B, T, C = x.shape
    K = weight.shape[-1]
    y = bias.expand(B, T, C).clone()
    for t in range(T):
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                y[:, t] += weight[:, 0, j] * x[:, src]
    return y


@pytest.mark.parametrize(
    "kernel, bias", [(1, True), (3, False), (4, True), (17, True), (20, False)]
)
def test_short_convolution_equals_the_direct_sum(kernel, bias):
    from models.mixers.base_conv import ShortConvolution

    torch.manual_seed(kernel)
    conv = ShortConvolution(6, kernel_size=kernel, bias=bias)  # K > 16 takes the conv1d path
    x = torch.randn(2, 25, 6)
    expected = short_conv_direct(x, conv.conv.weight, conv.conv.bias if bias else torch.zeros(6))
    with torch.no_grad():
        torch.testing.assert_close(conv(x), expected.detach(), atol=1e-5, rtol=1e-5)


def test_base_conv_short_equals_its_formula():
    torch.manual_seed(0)
    mixer = BaseConv(d_model=8, l_max=32, kernel_size=3).eval()
    u = torch.randn(2, 20, 8)
    W, b1 = mixer.projection.weight, mixer.projection.bias
    h_u = short_conv_direct(u, mixer.conv.conv.weight, mixer.conv.conv.bias)  # h * u + b2
    expected = (u @ W.T + b1) * h_u + u
    with torch.no_grad():
        torch.testing.assert_close(mixer(u), expected.detach(), atol=1e-5, rtol=1e-5)


def test_base_conv_long_equals_its_formula():
    torch.manual_seed(0)
    mixer = BaseConv(d_model=8, l_max=32, kernel_size=-1).eval()
    u = torch.randn(2, 20, 8)
    with torch.no_grad():
        h = mixer.conv.filter(20)  # (D, L)
        conv = direct_causal_conv(u.transpose(1, 2), h).float().transpose(1, 2) + u  # h * u + u
        expected = mixer.projection(u) * conv + u
        torch.testing.assert_close(mixer(u), expected, atol=1e-5, rtol=1e-5)


def test_base_conv_explicit_long_equals_its_formula_and_zoology_keys():
    torch.manual_seed(0)
    mixer = BaseConv(d_model=8, l_max=32, kernel_size=-1, implicit_long_conv=False).eval()
    assert sorted(mixer.state_dict()) == [
        "conv.filter",
        "projection.bias",
        "projection.weight",
    ]
    assert mixer.conv.filter.shape == (8, 32)
    for L in (20, 32):  # shorter than the filter, and its full length
        u = torch.randn(2, L, 8)
        with torch.no_grad():
            h = mixer.conv.filter[:, :L]
            conv = direct_causal_conv(u.transpose(1, 2), h).float().transpose(1, 2) + u
            expected = mixer.projection(u) * conv + u
            torch.testing.assert_close(mixer(u), expected, atol=1e-4, rtol=1e-5)
    u = torch.randn(1, 32, 8)
    v = u.clone()
    v[:, 20:] = torch.randn(1, 12, 8)  # a different future
    with torch.no_grad():
        torch.testing.assert_close(mixer(u)[:, :20], mixer(v)[:, :20])
        with pytest.raises(ValueError, match="l_max=32"):
            mixer(torch.randn(1, 33, 8))


def test_hyena_equals_gated_direct_convolution():
    torch.manual_seed(0)
    mixer = Hyena(d_model=8, l_max=32, filter_order=16).eval()
    u = torch.randn(2, 20, 8)
    with torch.no_grad():
        z = mixer.in_proj(u)  # (B, L, 3D)
        z = short_conv_direct(z, mixer.short_filter.weight, mixer.short_filter.bias)
        x1, x2, v = z[..., :8], z[..., 8:16], z[..., 16:]
        pre = (v * x1).transpose(1, 2)  # (B, D, L)
        h = mixer.filter_fn.filter(20)
        long = direct_causal_conv(pre, h).float() + pre * mixer.filter_fn.bias[:, None]
        expected = mixer.out_proj(long.transpose(1, 2) * x2)
        torch.testing.assert_close(mixer(u), expected, atol=1e-5, rtol=1e-5)


def test_hyena_filter_decays_and_respects_l_max():
    torch.manual_seed(0)
    mixer = Hyena(d_model=8, l_max=32)
    h = mixer.filter_fn.filter(32).detach()
    # exponential modulation: the filter's tail is much smaller than its head
    assert h[:, -4:].abs().mean() < h[:, :4].abs().mean()
    with pytest.raises(ValueError, match="l_max=32"):
        mixer(torch.randn(1, 33, 8))


@pytest.mark.parametrize("mixer", ["attention", "base_conv", "hyena", "rwkv"])
def test_training_step_gives_finite_gradients(mixer):
    model = build(mixer).train()
    ids = torch.randint(0, 61, (2, 33))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert abs(loss.item() - torch.log(torch.tensor(61.0)).item()) < 1.0  # near-uniform at init


def test_config_defaults():
    assert ModelConfig(vocab_size=10, sequence_mixer="rwkv").state_mixer == "rwkv"
    assert ModelConfig(vocab_size=10, sequence_mixer="hyena").state_mixer == "mlp"
    assert ModelConfig(vocab_size=10, l_max=128).max_position_embeddings == 128
    assert ModelConfig(vocab_size=50257, pad_vocab_size_multiple=8).padded_vocab_size == 50264
    with pytest.raises(ValueError, match="unknown sequence mixer 'mamba'"):
        ModelConfig(vocab_size=10, sequence_mixer="mamba")
