"""Mamba-2: the chunked SSD scan equals the one-token recurrence (and the recurrence the
definition); mamba_ssm's layout with Mamba-2, attention and gated-MLP layers reads as upstream
builds it, refuses what it does not implement by name, and reads the published 2.7B configs.
The per-token losses against upstream's own code are test_mamba.py's fixture tests."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.errors import ArSliceError
from models import load_model
from models.checkpoints.mamba_ssm import architecture_of, read_mamba_ssm_config
from models.mixer_model import MixerLM
from models.mixers.mamba2 import Mamba2Mixer, ssd_chunked, ssd_sequential
from models.nll import per_token_nll
from tests import UPSTREAM

FIXTURES = UPSTREAM / "mamba"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def naive_ssd(x, dt, A, B, C):
    """The definition summed directly in fp64: y_t = sum_{s<=t} (C_t . B_s) exp(A_h sum_{s<r<=t}
    Δ_r) Δ_s x_s, B and C of each head's group."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    b, T, H, P = x.shape
    r = H // B.shape[2]
    B, C = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)  # (b, T, H, N)
    cum = dt.cumsum(1)  # (b, T, H)
    y = torch.zeros(b, T, H, P, dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            w = (C[:, t] * B[:, s]).sum(-1) * torch.exp(A * (cum[:, t] - cum[:, s])) * dt[:, s]
            y[:, t] += w[..., None] * x[:, s]
    return y


def ssd_inputs(g, b, T, H, P, G, N, decay_scale=2.0):
    x = torch.randn(b, T, H, P, generator=g)
    dt = torch.randn(b, T, H, generator=g) * 3 - 1  # before dt_bias and softplus
    A = -torch.exp(torch.randn(H, generator=g) * decay_scale)
    return x, dt, A, torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g)


def test_sequential_ssd_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    x, dt, A, B, C = ssd_inputs(g, 2, 19, 4, 3, 2, 5)
    delta = F.softplus(dt)
    want = naive_ssd(x, delta, A, B, C)
    got = ssd_sequential(x.double(), delta.double(), A.double(), B.double(), C.double())
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    # softplus, dt_bias and the limit are applied as mamba_ssm applies them
    bias = torch.randn(4, generator=g)
    got = ssd_sequential(x.double(), dt.double(), A.double(), B.double(), C.double(),
                         dt_bias=bias.double(), dt_softplus=True, dt_limit=(0.1, 2.0))  # fmt: skip
    want = naive_ssd(x, F.softplus(dt.double() + bias.double()).clamp(0.1, 2.0), A, B, C)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 2),
    T=st.integers(1, 90),
    heads_per_group=st.integers(1, 3),
    G=st.integers(1, 3),
    P=st.integers(1, 6),
    N=st.integers(1, 6),
    chunk=st.sampled_from([1, 3, 8, 16, 64, 256]),
    decay_scale=st.floats(0.0, 4.0),
    options=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_chunked_ssd_equals_the_recurrence(
    b, T, heads_per_group, G, P, N, chunk, decay_scale, options, seed
):
    """Within 1e-4 of the fp64 recurrence in fp32, at every length (most not a multiple of the
    chunk), with the D skip (per head or per channel), the z gate, Δ's bias, softplus and limits
    and an initial state; the final states agree too."""
    g = torch.Generator().manual_seed(seed)
    H = G * heads_per_group
    x, dt, A, B, C = ssd_inputs(g, b, T, H, P, G, N, decay_scale)
    kwargs = {"dt_bias": torch.randn(H, generator=g), "dt_softplus": True}
    if options & 1:
        kwargs["D"] = torch.randn(H, P, generator=g) if options & 4 else torch.randn(H, generator=g)
        kwargs["z"] = torch.randn(b, T, H, P, generator=g)
    if options & 2:
        kwargs["dt_limit"] = (0.05, 3.0)
        kwargs["initial_state"] = torch.randn(b, H, P, N, generator=g)
    as64 = {k: v.double() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    want, want_state = ssd_sequential(
        *(t.double() for t in (x, dt, A, B, C)), **as64, return_final_state=True
    )
    got, state = ssd_chunked(x, dt, A, B, C, chunk, **kwargs, return_final_state=True)
    assert got.dtype == torch.float32 and got.shape == (b, T, H, P)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), want_state, atol=1e-4, rtol=1e-4)


def test_chunked_ssd_is_exact_for_long_sequences_and_extreme_decays():
    """2048 tokens in chunks of 256 (and 2000 = 7 chunks and a short one): cumulative decays in
    the tens of thousands beside heads that barely decay (outputs in the thousands); the chunked
    result stays within fp32's precision of the fp64 recurrence, no further from it than the
    fp32 recurrence itself is at its worst."""
    g = torch.Generator().manual_seed(5)
    H, P, N = 4, 3, 4
    for T in (2048, 2000):
        x = torch.randn(1, T, H, P, generator=g)
        dt = torch.rand(1, T, H, generator=g) ** 4 * 20
        A = -torch.tensor([1e-4, 0.05, 3.0, 400.0])
        B, C = torch.randn(1, T, 1, N, generator=g), torch.randn(1, T, 1, N, generator=g)
        want = ssd_sequential(*(t.double() for t in (x, dt, A, B, C)))
        got = ssd_chunked(x, dt, A, B, C, 256)
        assert torch.isfinite(got).all()
        error = (got.double() - want).abs().amax(dim=(0, 1, 3))  # per head
        fp32_recurrence = (ssd_sequential(x, dt, A, B, C).double() - want).abs().amax(dim=(0, 1, 3))
        assert (error <= 1e-6 * want.abs().amax(dim=(0, 1, 3))).all()
        assert error.max() <= fp32_recurrence.max()


def test_mixer_chunked_equals_sequential_and_the_scan_is_what_runs():
    torch.manual_seed(0)
    mixer = Mamba2Mixer(
        24, d_state=4, headdim=8, ngroups=2, d_ssm=32, D_has_hdim=True, chunk_size=8
    ).eval()
    with torch.no_grad():
        mixer.A_log.copy_(torch.randn(4) * 2)
        mixer.dt_bias.copy_(torch.randn(4) * 2)
        u = torch.randn(2, 45, 24)
        chunked = mixer(u)
        mixer.mode = "sequential"
        sequential = mixer(u)
        torch.testing.assert_close(chunked, sequential, atol=1e-5, rtol=1e-5)
        mixer.A_log.add_(1.0)  # the scan's input reaches the output
        assert (mixer(u) - sequential).abs().max() > 1e-3


# ---- mamba_ssm's layout --------------------------------------------------------------------------


def expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def max_nll_error(loaded, data: dict) -> float:
    worst = 0.0
    for batch in data["batches"]:
        ids = torch.tensor(batch["ids"])
        got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
        worst = max(worst, float((got - torch.tensor(batch["nll"])).abs().max()))
    return worst


def test_fixtures_cover_every_layer_and_option():
    """The fixture configs hold what the reader must get right, and a window of 2048 predictions
    crosses many chunk boundaries."""
    configs = {c: json.loads((FIXTURES / c / "config.json").read_text()) for c in (
        "ssm-mamba2", "ssm-mamba2-options", "ssm-mamba2-nonorm", "ssm-mamba2attn",
        "ssm-mamba2attn-mlp", "ssm-transformerpp", "ssm-mamba-attn-mlp")}  # fmt: skip
    options = configs["ssm-mamba2-options"]["ssm_cfg"]
    assert options["ngroups"] == 2 and options["headdim"] != 64 and options["d_ssm"] < 48
    assert options["norm_before_gate"] and options["D_has_hdim"] and options["dt_limit"][0] > 0
    assert not configs["ssm-mamba2-options"]["tie_embeddings"]
    attn = configs["ssm-mamba2attn"]["attn_cfg"]
    assert attn["num_heads_kv"] < attn["num_heads"] and attn["rotary_emb_dim"] and attn["d_conv"]
    assert configs["ssm-mamba2attn"]["attn_layer_idx"] == [1, 3]
    tpp = configs["ssm-transformerpp"]
    assert tpp["attn_layer_idx"] == list(range(tpp["n_layer"])) and tpp["d_intermediate"]
    assert tpp["attn_cfg"]["rotary_emb_interleaved"]
    for case in ("ssm-mamba2", "ssm-mamba2attn", "hf-mamba2-groups"):
        assert max(len(b["ids"][0]) for b in expected(case)["batches"]) == 2049


def test_a_wrong_model_misses_the_fixtures():
    """The options matter at these magnitudes: each flipped, the losses miss by far more than
    the tolerance."""
    loaded = load_model(f"hf:{FIXTURES / 'ssm-mamba2-options'}")
    data = expected("ssm-mamba2-options")
    assert max_nll_error(loaded, data) <= 1e-4
    for layer in loaded.model.backbone.layers:
        layer.mixer.norm.norm_before_gate = False
    assert max_nll_error(loaded, data) > 1e-2
    hybrid = load_model(f"hf:{FIXTURES / 'ssm-mamba2attn'}")
    rotary = hybrid.model.backbone.layers[1].mixer.rotary_emb
    rotary.interleaved = True
    assert max_nll_error(hybrid, expected("ssm-mamba2attn")) > 1e-2


def test_sequential_mode_gives_the_same_losses():
    loaded = load_model(f"hf:{FIXTURES / 'ssm-mamba2attn-mlp'}")
    assert isinstance(loaded.model, MixerLM)
    loaded.model.set_mode("sequential")
    data = expected("ssm-mamba2attn-mlp")
    assert max_nll_error(loaded, data) <= max(1e-4, 2 * data["upstream_fp64_distance"])


def edited(tmp_path, case: str, edit) -> str:
    out = tmp_path / case
    shutil.copytree(FIXTURES / case, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return f"hf:{out}"


@pytest.mark.parametrize(
    "case, edit, named",
    [
        ("ssm-mamba2", lambda c: c["ssm_cfg"].update(layer="Mamba3"), "ssm_cfg.layer = 'Mamba3'"),
        ("ssm-mamba2", lambda c: c["ssm_cfg"].update(d_head=8), "ssm_cfg (Mamba2) key(s) d_head"),
        ("ssm-mamba2attn", lambda c: c["attn_cfg"].update(causal=False), "attn_cfg.causal"),
        ("ssm-mamba2attn", lambda c: c["attn_cfg"].update(window=8), "attn_cfg key(s) window"),
    ],
)
def test_options_not_implemented_are_refused_by_name(tmp_path, case, edit, named):
    with pytest.raises(ArSliceError, match="not implemented") as err:
        load_model(edited(tmp_path, case, edit))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_bad_layer_lists_and_missing_heads_are_one_line_errors(tmp_path):
    with pytest.raises(ArSliceError, match=r"attn_layer_idx \[1, 9\] must list layers 0..3"):
        load_model(
            edited(tmp_path / "a", "ssm-mamba2attn", lambda c: c.update(attn_layer_idx=[1, 9]))
        )
    with pytest.raises(ArSliceError, match="attn_cfg needs num_heads"):
        load_model(
            edited(tmp_path / "b", "ssm-mamba2attn", lambda c: c["attn_cfg"].pop("num_heads"))
        )


def test_hybrids_have_no_transformers_forward():
    with pytest.raises(ArSliceError, match="Mamba2ForCausalLM has no attn_layer_idx.*fast path"):
        load_model(f"hf:{FIXTURES / 'ssm-mamba2attn'}", fast_path=False)


# the published configs (config.json of each hub repo, as mamba_ssm's save_pretrained wrote them)
MAMBA2_27B = {
    "d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277,
    "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
    "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
    "tie_embeddings": True,
}  # fmt: skip
MAMBA2ATTN_27B = {
    **MAMBA2_27B, "attn_layer_idx": [9, 18, 27, 36, 45, 56],
    "attn_cfg": {"causal": True, "d_conv": 4, "head_dim": 128, "num_heads": 30,
                 "out_proj_bias": False, "qkv_proj_bias": False, "rotary_emb_dim": 64},
}  # fmt: skip
TRANSFORMERPP_27B = {
    **MAMBA2_27B, "d_intermediate": 6912, "n_layer": 32, "attn_layer_idx": list(range(32)),
    "attn_cfg": {"causal": True, "d_conv": 0, "head_dim": 128, "num_heads": 20,
                 "out_proj_bias": False, "qkv_proj_bias": False, "rotary_emb_dim": 64},
}  # fmt: skip


@pytest.mark.parametrize(
    "raw, architecture, billions",
    [(MAMBA2_27B, "mamba2", 2.70), (MAMBA2ATTN_27B, "mamba2-hybrid", 2.70),
     (TRANSFORMERPP_27B, "attention", 2.70)],
)  # fmt: skip
def test_published_configs_build_the_published_sizes(raw, architecture, billions):
    """The 2.7B suite trained on the same 300B Pile tokens: each config builds (no weights: on
    the meta device) a model of its published size, the vocabulary padded to 50288."""
    cfg = read_mamba_ssm_config(raw, "config.json")
    assert architecture_of(cfg) == architecture and cfg.vocab_size == 50288
    with torch.device("meta"):
        model = MixerLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert math.isclose(n / 1e9, billions, abs_tol=0.06), n
    kinds = {type(layer.mixer).__name__ for layer in model.backbone.layers}
    assert kinds == {"mamba2": {"Mamba2Mixer"}, "mamba2-hybrid": {"Mamba2Mixer", "MambaMHA"},
                     "attention": {"MambaMHA"}}[architecture]  # fmt: skip
