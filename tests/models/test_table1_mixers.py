"""The paper's other Table 1 mixers (H3, Long Conv) and RetNet's retention: each against a plain
reference of its own equations, causal, trainable, and kept whole by the native format; and the
h3: / retnet: / zoology: loaders' refusals. Upstream's own numbers are in
test_upstream_fixtures.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ar_slicing.errors import ArSliceError
from models import load_model
from models.backbone import LanguageModel, ModelConfig
from models.checkpoints.native import save_native
from models.mixers.h3 import H3
from models.mixers.retnet import MultiScaleRetention
from tests import UPSTREAM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_MIXERS = ["h3", "long_conv", "implicit_long_conv", "retnet"]


def h3_recurrent(mixer: H3, u: torch.Tensor) -> torch.Tensor:
    """H3 token by token: the shift SSM as a shift register, the diagonal SSM as
    `x_t = dA x_{t-1} + dB u_t`, `y_t = 2 Re(C x_t)` (bilinear dA, dB), then H3's products."""
    B, L, D = u.shape
    hd, H = mixer.head_dim, mixer.H
    ssm = mixer.kernel.kernel
    dt = ssm.log_dt.exp()
    A = -ssm.inv_A_real.exp() + 1j * ssm.A_imag
    dtA = A * dt[:, None]
    dA = (1 + dtA / 2) / (1 - dtA / 2)  # (H, n)
    dB = torch.view_as_complex(ssm.B) / (1 - dtA / 2) * dt[:, None]  # (H, n)
    C = torch.view_as_complex(ssm.C)[0]  # (H, n)
    shift_B, shift_C = mixer.ssm_k_kernel.kernel.B, mixer.ssm_k_kernel.kernel.C[0]  # (D, N)
    q, k, v = mixer.q_proj(u), mixer.k_proj(u), mixer.v_proj(u)  # (B, L, D)
    register = torch.zeros(B, D, shift_B.shape[1])
    state = torch.zeros(B, hd, hd, H, A.shape[1], dtype=torch.cfloat)
    out = []
    for t in range(L):
        # SSKernelShift.step: shift the register by one, add B u_t, read out C
        register = torch.cat([register.new_zeros(B, D, 1), register[..., :-1]], -1)
        register = register + shift_B * k[:, t, :, None]
        k_t = (register * shift_C).sum(-1) + mixer.ssm_k_D * k[:, t]  # (B, D)
        kv = k_t.view(B, H, hd, 1).permute(0, 2, 3, 1) * v[:, t].view(B, H, 1, hd).permute(
            0, 2, 3, 1
        )
        state = dA * state + dB * kv[..., None]  # (B, hd, hd, H, n)
        y = 2 * (C * state).sum(-1).real + mixer.D * kv  # (B, hd, hd, H)
        y = (y * q[:, t].view(B, H, hd, 1).permute(0, 2, 3, 1)).sum(1)  # (B, hd, H)
        out.append(y.reshape(B, D))
    return mixer.output_linear(torch.stack(out, 1))


@pytest.mark.parametrize("head_dim", [1, 4])
def test_h3_convolutions_equal_its_recurrence(head_dim):
    torch.manual_seed(0)
    mixer = H3(16, l_max=64, head_dim=head_dim, d_state=8)
    with torch.no_grad():  # a shift kernel that is not the initial e_1 correlation, slow decays
        mixer.ssm_k_kernel.kernel.B.normal_()
        mixer.kernel.kernel.log_dt.uniform_(math.log(1e-3), math.log(0.5))
    u = torch.randn(2, 23, 16)
    with torch.no_grad():
        torch.testing.assert_close(mixer(u), h3_recurrent(mixer, u), atol=2e-5, rtol=1e-4)


def test_h3_kernels_cut_at_l_max_only_when_asked():
    torch.manual_seed(0)
    whole = H3(8, l_max=6, d_state=4)
    cut = H3(8, l_max=6, d_state=4, truncate_kernel=True)
    cut.load_state_dict(whole.state_dict())
    u = torch.randn(1, 20, 8)
    with torch.no_grad():
        torch.testing.assert_close(whole(u)[:, :6], cut(u)[:, :6])
        assert (whole(u)[:, 6:] - cut(u)[:, 6:]).abs().max() > 1e-4
        shift, ssm = cut.kernels(20)
        assert not ssm[:, 6:].any() and ssm[:, :6].abs().sum() > 0


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_retention_chunks_equal_the_recurrence(chunk_size):
    torch.manual_seed(0)
    mixer = MultiScaleRetention(32, 64, num_heads=4, chunk_size=chunk_size)
    x = torch.randn(2, 45, 32)
    with torch.no_grad():
        parallel, recurrent = mixer(x), mixer.recurrent_forward(x)
    # both forms scale each (token, head) row differently before the group norm, which undoes it
    # up to its epsilon (1e-6 against row means of squares around 1e-2 here)
    torch.testing.assert_close(parallel, recurrent, atol=2e-5, rtol=1e-4)
    torch.manual_seed(0)
    whole = MultiScaleRetention(32, 64, num_heads=4, chunk_size=1000)
    with torch.no_grad():
        torch.testing.assert_close(parallel, whole(x), atol=1e-6, rtol=1e-6)


def test_retention_decays_per_head_as_torchscale():
    mixer = MultiScaleRetention(32, 64, num_heads=4)
    gammas = mixer.decay.exp()
    assert torch.allclose(gammas, torch.tensor([1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8]))
    # row i of the normalised mask: gamma^(i-j) / sqrt(sum_j<=i gamma^(i-j))
    rows = mixer.decay_rows(2, 3, 4)[0, 0]
    g = gammas[0].item()
    norm = math.sqrt(1 + g + g * g)
    torch.testing.assert_close(rows, torch.tensor([g * g, g, 1, 0]) / norm)


@pytest.mark.parametrize("mixer", NEW_MIXERS)
def test_new_mixers_are_causal(mixer):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=40, d_model=32, n_layers=2, sequence_mixer=mixer, l_max=48)).eval()  # fmt: skip
    ids = torch.randint(0, 40, (2, 48))
    changed = ids.clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % 40
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :30], model(changed)[:, :30], atol=1e-5, rtol=0)
        assert (model(ids)[:, 30:] - model(changed)[:, 30:]).abs().max() > 1e-3


@pytest.mark.parametrize("mixer", NEW_MIXERS)
def test_new_mixers_train_and_keep_their_losses_through_native(mixer, tmp_path):
    """A few steps of the trainer's own optimizer on a copy task, then the native round trip."""
    from pipeline.train.config import TrainConfig
    from pipeline.train.model import make_optimizer, model_config_for

    cfg = TrainConfig(arch=mixer, tokens="-", out="-", d_model=32, n_layers=2, seq_len=32, lr=1e-2)
    torch.manual_seed(0)
    model = LanguageModel(model_config_for(cfg, vocab_size=24))
    optimizer = make_optimizer(model, cfg.recipe)
    g = torch.Generator().manual_seed(0)
    half = torch.randint(0, 24, (8, 16), generator=g)
    batch = torch.cat([half, half, half[:, :1]], 1)  # the second half repeats the first
    losses = []
    for _ in range(30):
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    save_native(model.eval(), tmp_path / mixer)
    loaded = load_model(f"native:{tmp_path / mixer}")
    assert loaded.model.config == model.config and loaded.architecture == mixer
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch[:, :-1]), model(batch[:, :-1]))


def test_h3_ssm_parameters_are_not_decayed():
    from pipeline.train.config import TrainConfig
    from pipeline.train.model import make_optimizer, model_config_for

    cfg = TrainConfig(arch="h3", tokens="-", out="-", d_model=16, n_layers=1, seq_len=16)
    model = LanguageModel(model_config_for(cfg, vocab_size=20))
    decayed, kept = (g["params"] for g in make_optimizer(model, cfg.recipe).param_groups)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)].split("sequence_mixer.")[-1] for p in kept if id(p) in names}
    # as upstream's OptimModule.register: log_dt, B, inv_A_real, A_imag and the shift's B
    assert {"kernel.kernel.B", "kernel.kernel.inv_A_real", "kernel.kernel.A_imag",
            "kernel.kernel.log_dt", "ssm_k_kernel.kernel.B"} <= no_decay  # fmt: skip
    decayed_names = {names[id(p)].split("sequence_mixer.")[-1] for p in decayed}
    assert {"q_proj.weight", "kernel.kernel.C", "ssm_k_kernel.kernel.C"} <= decayed_names


# ---- loaders --------------------------------------------------------------------------------


def copy_case(case: str, tmp_path, *, config=None, drop_config=False):
    import shutil

    folder = tmp_path / case
    shutil.copytree(UPSTREAM / case, folder)
    (folder / "expected.json").unlink()
    if drop_config:
        for name in ("config.json", "h3-config.json"):
            (folder / name).unlink(missing_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_h3_attention_heads_must_come_from_a_config(tmp_path):
    folder = copy_case("h3-hybrid", tmp_path, drop_config=True)
    with pytest.raises(ArSliceError, match=r"attention at layers \[1\].*--model-config"):
        load_model(f"h3:{folder / 'model.pt'}")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ssm_cfg": {"mode": "nplr"}}, r"ssm_cfg.mode='nplr' is not implemented"),
        (
            {"attn_cfg": {"num_heads": 2, "dwconv": True}},
            r"attn_cfg.dwconv=True is not implemented",
        ),
        ({"attn_layer_idx": [2]}, r"attn_layer_idx is \[2\] but the weights have \[1\]"),
        ({"ssm_cfg": {"d_state": 64}}, r"ssm_cfg.d_state is 64 but the weights have 16"),
        ({"n_layers": 3}, r"n_layers is not an option"),
    ],
)
def test_h3_config_is_checked_against_the_weights(tmp_path, change, message):
    base = json.loads((UPSTREAM / "h3-hybrid" / "config.json").read_text())
    for key, value in change.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
    folder = copy_case("h3-hybrid", tmp_path, config=base)
    with pytest.raises(ArSliceError, match=message):
        load_model(f"h3:{folder / 'model.pt'}")


def test_h3_records_its_settings(tmp_path):
    loaded = load_model(f"h3:{UPSTREAM / 'h3-hybrid' / 'model.pt'}")
    s = loaded.settings
    assert (s["attention_layers"], s["num_heads"], s["d_state"], s["head_dim"]) == ([1], 2, 16, 1)
    assert s["config"].endswith("config.json") and s["published_checkpoint"] is False
    assert loaded.architecture == "h3" and loaded.vocab_size == 56


def test_h3_published_shapes_name_their_heads():
    from models.checkpoints.h3 import PUBLISHED, model_config_for, resolve_settings

    shapes = {"vocab_size": 50264, "d_model": 768, "n_layer": 12, "d_inner": 3072,
              "attn_layer_idx": [6], "max_position_embeddings": 0, "d_state": 64, "head_dim": 1}  # fmt: skip
    name, attn = PUBLISHED[(768, 12, (6,))]
    settings = resolve_settings({"attn_cfg": attn, "ssm_cfg": {"mode": "diag"}}, shapes, name)
    config = model_config_for(shapes, settings)
    assert config.layer_mixers == [
        {"layers": [6], "name": "attention",
         "kwargs": {**config.layer_mixers[0]["kwargs"], "num_heads": 12, "rotary_emb_dim": 0}}
    ]  # fmt: skip
    rotary = PUBLISHED[(2560, 32, (10, 21))][1]
    assert rotary == {"num_heads": 20, "rotary_emb_dim": 64}


def test_h3_rotary_frequencies_are_checked(tmp_path):
    """A rotary hybrid as flash-attn saved it (with `inv_freq`): read, and refused when the stored
    frequencies are not base^(-2i/dim)."""
    torch.manual_seed(0)
    attention = {"num_heads": 2, "rotary_emb_dim": 8}
    model = LanguageModel(ModelConfig(
        vocab_size=56, d_model=16, n_layers=2, sequence_mixer="h3", sequence_mixer_kwargs={"d_state": 4},
        state_mixer="mlp", state_mixer_kwargs={"hidden": 32, "activation": "gelu_tanh"},
        max_position_embeddings=0, layer_mixers=[{"layers": [1], "name": "attention", "kwargs": attention}],
    )).eval()  # fmt: skip
    state = {k.replace("sequence_mixer", "mixer").replace("state_mixer", "mlp"): v
             for k, v in model.state_dict().items()}  # fmt: skip
    inv_freq = model.backbone.layers[1].sequence_mixer.rotary_emb.inv_freq.clone()
    state["backbone.layers.1.mixer.rotary_emb.inv_freq"] = inv_freq
    torch.save(state, tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps({"attn_cfg": attention}))
    loaded = load_model(f"h3:{tmp_path / 'model.pt'}")
    ids = torch.randint(0, 56, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), model(ids))
    state["backbone.layers.1.mixer.rotary_emb.inv_freq"] = inv_freq * 1.01
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(ArSliceError, match="inv_freq differs"):
        load_model(f"h3:{tmp_path / 'model.pt'}")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"chunkwise_recurrent": True}, r"chunkwise_recurrent=True is not implemented"),
        ({"moe_freq": 2}, r"moe_freq=2 is not implemented"),
        ({"decoder_layers": 3}, r"decoder_layers is 3 but the weights have 2"),
        ({"decoder_retention_heads": 4}, r"decoder_retention_heads is 4 but the weights have 2"),
        ({"share_decoder_input_output_embed": True, "no_scale_embedding": False}, r"tied output"),
        ({"flash_retention": True}, r"flash_retention is not an option"),
    ],
)
def test_retnet_refuses_what_it_does_not_implement(tmp_path, change, message):
    base = json.loads((UPSTREAM / "retnet-torchscale" / "config.json").read_text())
    folder = copy_case("retnet-torchscale", tmp_path, config={**base, **change})
    with pytest.raises(ArSliceError, match=message):
        load_model(f"retnet:{folder / 'model.pt'}")


def test_retnet_needs_its_config(tmp_path):
    folder = copy_case("retnet-torchscale", tmp_path, drop_config=True)
    with pytest.raises(ArSliceError, match="no RetNetConfig beside it"):
        load_model(f"retnet:{folder / 'model.pt'}")


def test_zoology_hybrid_needs_its_configs(tmp_path):
    base = json.loads((UPSTREAM / "zoology-hybrid" / "config.json").read_text())
    base["sequence_mixer"]["kwargs"] = {"configs": [], "mixers": 2}
    folder = copy_case("zoology-hybrid", tmp_path, config=base)
    with pytest.raises(ArSliceError, match="a Hybrid sequence_mixer takes one kwarg, 'configs'"):
        load_model(f"zoology:{folder / 'model.pt'}")


def test_zoology_h3_kernel_args_are_checked(tmp_path):
    base = json.loads((UPSTREAM / "zoology-h3" / "config.json").read_text())
    base["sequence_mixer"]["kwargs"]["kernel_args"] = {"mode": "nplr"}
    folder = copy_case("zoology-h3", tmp_path, config=base)
    with pytest.raises(ArSliceError, match=r"kernel_args.mode='nplr' is not implemented"):
        load_model(f"zoology:{folder / 'model.pt'}")
    base["sequence_mixer"]["kwargs"]["kernel_args"] = {"measure": "diag-inv", "dt_min": 0.01}
    folder = copy_case("zoology-h3", tmp_path / "ok", config=base)
    load_model(f"zoology:{folder / 'model.pt'}")  # initialisation only: accepted


@pytest.mark.parametrize("arch", NEW_MIXERS)
def test_mqar_builds_the_new_mixers(arch):
    """`arslice mqar --archs h3 ...`: Figure 2's two-block model of each, on an MQAR batch."""
    from pipeline.mqar import MORE_ARCHITECTURES, MqarConfig, build_model, train_batch

    assert arch in MORE_ARCHITECTURES
    model = build_model(arch, d_model=32, seq_len=64, vocab_size=128)
    inputs, _ = train_batch(MqarConfig(out="-", vocab_size=128, batch_tokens=128), 64, step=0)
    assert model(torch.as_tensor(inputs)).shape == (*inputs.shape, 128)
