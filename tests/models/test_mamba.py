"""Mamba: chunked selective scan == sequential recurrence; hf: checkpoints (transformers and
mamba_ssm layouts) give the NLL their upstream code gave, token by token (golden fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.errors import ArSliceError
from models import load_model
from models.mixers.mamba import (
    MambaLM,
    MambaLMConfig,
    selective_scan_chunked,
    selective_scan_sequential,
)
from models.nll import per_token_nll
from tests import UPSTREAM

FIXTURES = UPSTREAM / "mamba"
# per-token NLL against upstream, fp32 (the project's fidelity bar)
NLL_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def naive_scan(u, delta, A, B, C):
    """The definition summed directly in fp64: y_t = sum_{i<=t} C_t . exp(A sum_{i<s<=t} Δ_s)
    Δ_i B_i u_i."""
    u, delta, A, B, C = (t.double() for t in (u, delta, A, B, C))
    Bsz, T, D = u.shape
    out = torch.zeros(Bsz, T, D, dtype=torch.float64)
    cum = delta.cumsum(1)  # (B, T, D)
    for t in range(T):
        for i in range(t + 1):
            decay = torch.exp((cum[:, t] - cum[:, i])[..., None] * A)  # (B, D, N)
            h = decay * (delta[:, i] * u[:, i])[..., None] * B[:, i, None, :]
            out[:, t] += (h * C[:, t, None, :]).sum(-1)
    return out


def scan_inputs(g, B, T, D, N, decay_scale=2.0, dt_scale=2.0):
    """u, Δ = softplus(...), A = -exp(A_log) and B, C with decay rates spread over e^{±decay_scale}."""
    u = torch.randn(B, T, D, generator=g)
    delta = F.softplus(torch.randn(B, T, D, generator=g) * dt_scale - 1)
    A = -torch.exp(torch.randn(D, N, generator=g) * decay_scale)
    return u, delta, A, torch.randn(B, T, N, generator=g), torch.randn(B, T, N, generator=g)


def test_sequential_scan_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    args = scan_inputs(g, 2, 23, 5, 3)
    ref = naive_scan(*args)
    torch.testing.assert_close(
        selective_scan_sequential(*(a.double() for a in args)), ref, atol=1e-12, rtol=1e-10
    )
    torch.testing.assert_close(selective_scan_sequential(*args).double(), ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 70),
    D=st.integers(1, 9),
    N=st.integers(1, 5),
    chunk=st.sampled_from([1, 2, 5, 16, 64]),
    block=st.sampled_from([None, 40, 400]),
    decay_scale=st.floats(0.0, 4.0),
    dt_scale=st.floats(0.0, 4.0),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_sequential(B, T, D, N, chunk, block, decay_scale, dt_scale, seed):
    g = torch.Generator().manual_seed(seed)
    args = scan_inputs(g, B, T, D, N, decay_scale, dt_scale)
    skip, gate = torch.randn(D, generator=g), torch.randn(B, T, D, generator=g)
    if seed % 2:  # half the cases with the D skip and the silu(z) gate
        args = (*args, skip, gate)
    ref = selective_scan_sequential(*(a.double() for a in args))
    got = selective_scan_chunked(*args, chunk_size=chunk, block_elements=block)
    assert got.dtype == torch.float32 and got.shape == (B, T, D)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_chunked_is_exact_for_extreme_decays():
    """Decay rates from 1e-4 to 1e5 per unit of Δ and Δ from ~0 to 40: channels that keep their
    state for the whole sequence beside channels whose decay underflows to 0 at every token."""
    g = torch.Generator().manual_seed(1)
    D, N, T = 6, 4, 83  # 83 tokens: five full chunks of 16 and one of 3
    A = -torch.logspace(-4, 5, D * N).view(D, N)
    u = torch.randn(3, T, D, generator=g) * 10
    delta = torch.rand(3, T, D, generator=g) ** 4 * 40  # many tiny steps, some huge ones
    delta[:, ::7] = 1e-6
    B = torch.randn(3, T, N, generator=g) * 10
    C = torch.randn(3, T, N, generator=g)
    ref = selective_scan_sequential(u.double(), delta.double(), A.double(), B.double(), C.double())
    for block in (None, 3 * 16 * N * D, 16 * N * D):  # all sequences in one block, 1 per block
        got = selective_scan_chunked(u, delta, A, B, C, chunk_size=16, block_elements=block)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


def test_sequences_are_independent_across_blocks():
    """Five sequences in blocks of two (the last block holds one): each equals itself alone."""
    g = torch.Generator().manual_seed(2)
    D, N = 4, 3
    args = scan_inputs(g, 5, 40, D, N)
    together = selective_scan_chunked(*args, chunk_size=16, block_elements=2 * 16 * N * D)
    for b in range(5):
        alone = selective_scan_chunked(*(a[b : b + 1] if a.dim() == 3 else a for a in args))
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-6, rtol=1e-6)


def test_chunked_scan_with_autograd_is_differentiable():
    g = torch.Generator().manual_seed(3)
    u, delta, A, B, C = scan_inputs(g, 2, 20, 3, 2)
    A.requires_grad_(True)
    out = selective_scan_chunked(u, delta, A, B, C)
    out.square().sum().backward()
    assert A.grad is not None and torch.isfinite(A.grad).all() and A.grad.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(out, selective_scan_chunked(u, delta, A, B, C))


def test_mamba_lm_chunked_equals_sequential():
    torch.manual_seed(0)
    model = MambaLM(MambaLMConfig(d_model=16, n_layer=2, vocab_size=64, d_state=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn_like(p) * 2)
        ids = torch.randint(0, 64, (2, 37))
        chunked = model(ids)
        model.set_mode("sequential")
        sequential = model(ids)
    torch.testing.assert_close(chunked, sequential, atol=1e-5, rtol=1e-5)


# ---- golden fixtures made by upstream (tests/fixtures/upstream/make_mamba_fixtures.py) ---------

FIXTURE_CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file())
# the architecture hf: reports, where it is not "mamba"
ARCHITECTURE = {
    "hf-mamba2": "mamba2", "hf-mamba2-groups": "mamba2", "ssm-mamba2": "mamba2",
    "ssm-mamba2-options": "mamba2", "ssm-mamba2-nonorm": "mamba2",
    "ssm-mamba2attn": "mamba2-hybrid", "ssm-mamba2attn-mlp": "mamba2-hybrid",
    "ssm-transformerpp": "attention", "ssm-mamba-attn-mlp": "mamba-hybrid",
}  # fmt: skip
# checkpoints transformers has no class for (attention layers, an MLP, LayerNorm, Mamba-2 options
# beyond its own): refused with --no-fast-path, tested in test_mamba2.py
NO_TRANSFORMERS_CLASS = {
    "ssm-mamba-layernorm", "ssm-mamba2-options", "ssm-mamba2-nonorm", "ssm-mamba2attn",
    "ssm-mamba2attn-mlp", "ssm-transformerpp", "ssm-mamba-attn-mlp",
}  # fmt: skip


def tolerance(expected: dict) -> float:
    """1e-4 nats, or twice upstream's own fp32 distance from its fp64 run where that is larger
    (recorded by make_mamba2_fixtures.py)."""
    return max(NLL_ATOL, 2 * (expected.get("upstream_fp64_distance") or 0.0))


def max_nll_error(loaded, expected: dict) -> float:
    worst = 0.0
    for batch in expected["batches"]:
        ids = torch.tensor(batch["ids"])
        got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
        want = torch.tensor(batch["nll"])
        assert got.shape == want.shape
        worst = max(worst, float((got - want).abs().max()))
    return worst


def test_every_fixture_case_is_present():
    assert set(FIXTURE_CASES) == {
        "hf-mamba", "hf-mamba-variant", "hf-mamba2", "hf-mamba2-groups",
        "ssm-mamba", "ssm-mamba-layernorm", "ssm-mamba-hazy", "ssm-mamba2", "ssm-mamba2-options",
        "ssm-mamba2-nonorm", "ssm-mamba2attn", "ssm-mamba2attn-mlp", "ssm-transformerpp",
        "ssm-mamba-attn-mlp",
    }  # fmt: skip


@pytest.mark.parametrize("case", FIXTURE_CASES)
def test_fast_path_gives_upstream_nll_for_every_token(case):
    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    loaded = load_model(f"hf:{FIXTURES / case}")
    assert loaded.architecture == ARCHITECTURE.get(case, "mamba")
    assert isinstance(loaded.model, MambaLM) == (loaded.architecture == "mamba")
    assert loaded.max_positions is None
    assert max_nll_error(loaded, expected) <= tolerance(expected)


@pytest.mark.parametrize("case", [c for c in FIXTURE_CASES if c not in NO_TRANSFORMERS_CLASS])
def test_transformers_forward_gives_upstream_nll_for_every_token(case):
    """`--no-fast-path`: transformers' own forward, for mamba_ssm checkpoints too (converted)."""
    import transformers

    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    loaded = load_model(f"hf:{FIXTURES / case}", fast_path=False)
    assert isinstance(loaded.model, transformers.PreTrainedModel)
    assert max_nll_error(loaded, expected) <= tolerance(expected)


def test_based_spec_reads_the_suites_mamba_as_hf_does():
    """HazyResearch's suite lists its Mamba beside Based: `based:` hands it to the same loader."""
    expected = json.loads((FIXTURES / "ssm-mamba-hazy" / "expected.json").read_text())
    loaded = load_model(f"based:{FIXTURES / 'ssm-mamba-hazy'}")
    assert isinstance(loaded.model, MambaLM) and loaded.architecture == "mamba"
    assert max_nll_error(loaded, expected) <= NLL_ATOL


def test_fixture_layouts_are_the_published_ones():
    ssm = json.loads((FIXTURES / "ssm-mamba" / "config.json").read_text())
    assert "model_type" not in ssm and ssm["pad_vocab_size_multiple"] == 8
    assert (FIXTURES / "ssm-mamba" / "pytorch_model.bin").is_file()
    state = torch.load(FIXTURES / "ssm-mamba-hazy" / "pytorch_model.bin", weights_only=True)
    assert (
        "model.backbone.layers.0.mixer.A_log" in state and "val_metrics.num-tokens.count" in state
    )
    loaded = load_model(f"hf:{FIXTURES / 'ssm-mamba'}")
    assert loaded.vocab_size == 128  # 122 padded to a multiple of 8, as mamba_ssm does
    hf = json.loads((FIXTURES / "hf-mamba" / "config.json").read_text())
    assert hf["model_type"] == "mamba" and (FIXTURES / "hf-mamba" / "model.safetensors").is_file()


def test_tied_and_untied_heads_count_their_parameters_once(tmp_path):
    tied = load_model(f"hf:{FIXTURES / 'ssm-mamba'}").model
    assert tied.lm_head.weight is tied.backbone.embedding.weight
    untied = load_model(f"hf:{FIXTURES / 'ssm-mamba-layernorm'}").model
    assert untied.lm_head.weight is not untied.backbone.embedding.weight
    state = torch.load(FIXTURES / "ssm-mamba-layernorm" / "pytorch_model.bin", weights_only=True)
    torch.testing.assert_close(untied.lm_head.weight, state["lm_head.weight"])


def test_bf16_autocast_runs_close_to_fp32():
    expected = json.loads((FIXTURES / "hf-mamba-variant" / "expected.json").read_text())
    loaded = load_model(f"hf:{FIXTURES / 'hf-mamba-variant'}")
    ids = torch.tensor(expected["batches"][0]["ids"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
    want = torch.tensor(expected["batches"][0]["nll"])
    assert torch.isfinite(got).all()
    assert float((got - want).abs().mean()) < 0.1


# ---- refusals ----------------------------------------------------------------------------------


def edited_ssm_fixture(tmp_path, changes: dict, case: str = "ssm-mamba") -> Path:
    """A copy of a mamba_ssm fixture with config.json edited (`ssm_cfg.KEY` edits inside it)."""
    out = tmp_path / case
    shutil.copytree(FIXTURES / case, out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("ssm_cfg."):
            cfg.setdefault("ssm_cfg", {})[key.removeprefix("ssm_cfg.")] = value
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"ssm_cfg.layer": "Mamba3"}, "ssm_cfg.layer = 'Mamba3'"),
        ({"ssm_cfg.d_ssm": 32}, "ssm_cfg key(s) d_ssm"),
        ({"norm_epsilon": 1e-3}, "config key(s) norm_epsilon"),
    ],
)
def test_mamba_ssm_options_not_implemented_are_refused_by_name(tmp_path, changes, named):
    path = edited_ssm_fixture(tmp_path, changes)
    with pytest.raises(ArSliceError, match="not implemented") as err:
        load_model(f"hf:{path}")
    assert named in str(err.value) and "\n" not in str(err.value)


def test_mamba_ssm_settings_without_effect_are_accepted(tmp_path):
    changes = {"fused_add_norm": False, "use_fast_path": False, "_name_or_path": "x",
               "ssm_cfg.dt_init": "constant", "ssm_cfg.dt_max": 0.5, "ssm_cfg.layer": "Mamba1"}  # fmt: skip
    path = edited_ssm_fixture(tmp_path, changes)
    expected = json.loads((path / "expected.json").read_text())
    assert max_nll_error(load_model(f"hf:{path}"), expected) <= NLL_ATOL


def test_missing_or_mismatched_mamba_ssm_weights_are_clear_errors(tmp_path):
    path = edited_ssm_fixture(tmp_path, {})
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(ArSliceError, match="no model.safetensors or pytorch_model.bin"):
        load_model(f"hf:{path}")
    path = edited_ssm_fixture(tmp_path / "b", {"n_layer": 3})
    with pytest.raises(ArSliceError, match="missing keys .*backbone.layers.2"):
        load_model(f"hf:{path}")


def test_layernorm_mamba_ssm_has_no_transformers_forward():
    with pytest.raises(ArSliceError, match="rms_norm = false"):
        load_model(f"hf:{FIXTURES / 'ssm-mamba-layernorm'}", fast_path=False)


def test_transformers_mamba_with_another_activation_needs_its_own_forward(tmp_path):
    import transformers

    cfg = transformers.MambaConfig(
        vocab_size=50, hidden_size=16, state_size=4, num_hidden_layers=1, hidden_act="gelu"
    )
    transformers.MambaForCausalLM(cfg).save_pretrained(tmp_path / "gelu")
    with pytest.raises(ArSliceError, match="hidden_act = 'gelu'.*--no-fast-path"):
        load_model(f"hf:{tmp_path / 'gelu'}")
    loaded = load_model(f"hf:{tmp_path / 'gelu'}", fast_path=False)
    ids = torch.randint(0, 50, (1, 12))
    assert torch.isfinite(per_token_nll(loaded, ids[:, :-1], ids[:, 1:])).all()
