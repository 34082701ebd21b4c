"""`based:` against HazyResearch/based itself: golden fixtures its own modules produced
(tests/fixtures/upstream/make_based_fixtures.py), every token compared; the Based mixers against
naive references; and every refusal of what the loader does not implement."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ar_slicing.errors import ArSliceError
from tests import UPSTREAM
from tests.models.checks import assert_never_looks_ahead

torch = pytest.importorskip("torch")

FIXTURES = UPSTREAM / "based"
# based-fla-parallel: feature_dim 8 apart from TaylorExp's input_dim 16, on FLA's kernel (2024
# API); transformer-pp-rotary-35: head_dim 70 at rotary_emb_fraction 0.5 (an odd rotary dim)
CASES = (
    "based-main", "based-2402", "transformer-pp", "based-fla-parallel", "transformer-pp-rotary-35",
)  # fmt: skip
# upstream class -> ours, for the mixer list each fixture recorded
OURS = {
    "BaseConv": "GatedConv",
    "BaseConvWithSiLU4": "GatedConv",
    "LinearAttention": "LinearAttention",
    "SlidingAttention": "SlidingWindowAttention",
    "SlidingsMHA": "SlidingWindowAttention",
    "MHA": "MHA",
}


def expected(case: str, name: str = "expected.json") -> dict:
    return json.loads((FIXTURES / case / name).read_text())


def token_nll(loaded, seq: list[int]) -> torch.Tensor:
    from models.nll import chunked_nll

    ids = torch.tensor([seq], device=loaded.device)
    with torch.no_grad():
        hidden, weight, bias = loaded.hidden_and_head(ids[:, :-1])
        return chunked_nll(hidden, weight, bias, ids[:, 1:])[0]


@pytest.mark.parametrize("case", CASES)
def test_every_token_equals_upstream(case):
    from models.checkpoints.registry import load_model

    want = expected(case)
    loaded = load_model(f"based:{FIXTURES / case}")
    layers = loaded.model.backbone.layers
    assert [type(b.sequence_mixer).__name__ for b in layers] == [OURS[m] for m in want["mixers"]]
    assert loaded.architecture == ("attention" if case.startswith("transformer-pp") else "based")
    assert loaded.vocab_size == 96 and loaded.max_positions is None
    lengths = [len(s) for s in want["sequences"]]
    assert min(lengths) < 8 < max(lengths)  # shorter and longer than the sliding window
    for seq, nll in zip(want["sequences"], want["nll"]):
        ours = token_nll(loaded, seq)
        assert ours.shape == (len(seq) - 1,)
        assert (ours - torch.tensor(nll)).abs().max() <= 1e-4, case


def test_fixture_nll_depends_on_what_is_tested():
    """The fixtures would catch a wrong window or a dropped layer: the NLL moves far past 1e-4."""
    from models.checkpoints.registry import load_model

    want = expected("based-main")
    seq, nll = want["sequences"][1], torch.tensor(want["nll"][1])
    loaded = load_model(f"based:{FIXTURES / 'based-main'}")
    assert nll.std() > 0.5
    sliding = loaded.model.backbone.layers[2].sequence_mixer
    assert sliding.window == 4 and sliding.num_heads == 2  # window_size 8; n_head, not its 4
    sliding.window = 8
    assert (token_nll(loaded, seq) - nll).abs().max() > 1e-2
    sliding.window = 4
    linear = loaded.model.backbone.layers[1].sequence_mixer
    linear.chunk_size = 7  # another chunking gives the same function
    assert (token_nll(loaded, seq) - nll).abs().max() <= 1e-4
    linear.scale_dim = 16
    assert (token_nll(loaded, seq) - nll).abs().max() > 1e-2


def test_fla_kernels_scale_by_feature_dim_not_taylor_exp_input_dim():
    """FLA's parallel_based never calls TaylorExp: its scale is feature_dim ** -0.5 (8 here),
    while the quadratic view on the same weights scales by TaylorExp's input_dim (16)."""
    from models.checkpoints.registry import load_model

    cfg = json.loads((FIXTURES / "based-fla-parallel" / "config.json").read_text())
    spec = cfg["alt_mixer"]
    assert spec["parallel_implementation"] == "fla_parallel"
    assert (spec["feature_dim"], spec["feature_map"]["input_dim"]) == (8, 16)
    linear = load_model(f"based:{FIXTURES / 'based-fla-parallel'}").model.backbone.layers[1]
    assert (linear.sequence_mixer.scale_dim, linear.sequence_mixer.eps) == (8, 1e-6)


def test_each_fla_version_is_reproduced_and_they_disagree(tmp_path):
    """Based's `parallel_based(q, k, v, True, True)`: FLA 0.1 reads the 4th argument as `scale`
    (1), the 2024 API as `use_scale`; the fixture ran FLA 0.1's own naive_parallel_based."""
    from models.checkpoints.registry import load_model

    case = FIXTURES / "based-fla-parallel"
    want = expected("based-fla-parallel", "expected-fla-0.1.json")
    assert want["upstream"]["flash_linear_attention"].startswith("cb0d1bb")  # v0.1.0
    default = load_model(f"based:{case}")  # the published config: the 2024 API
    seq, nll = want["sequences"][1], torch.tensor(want["nll"][1])
    assert (token_nll(default, seq) - nll).abs().max() > 0.5
    cfg = json.loads((case / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "fla_version": "0.1"}))
    loaded = load_model(f"based:{case}", model_config=str(tmp_path / "config.json"))
    for seq, nll in zip(want["sequences"], want["nll"]):
        assert (token_nll(loaded, seq) - torch.tensor(nll)).abs().max() <= 1e-4
    (tmp_path / "later.json").write_text(json.dumps({**cfg, "fla_version": "0.2"}))
    with pytest.raises(
        ArSliceError, match="fla_version '0.2' is not implemented; implemented: '2024'"
    ):
        load_model(f"based:{case}", model_config=str(tmp_path / "later.json"))
    with pytest.raises(ArSliceError, match="--model-config .*nope.json: no such file"):
        load_model(f"based:{case}", model_config=str(tmp_path / "nope.json"))


def test_odd_rotary_dimension_rotates_as_flash_attn_rounds():
    """rotary_emb_dim 35: flash-attn makes 18 frequencies base^(-2i/35) and turns 36 channels."""
    from models.checkpoints.registry import load_model
    from models.mixers.rotary import RotaryEmbedding

    mha = load_model(f"based:{FIXTURES / 'transformer-pp-rotary-35'}").model.backbone.layers[0]
    rotary = mha.sequence_mixer.rotary_emb
    assert (mha.sequence_mixer.head_dim, rotary.dim, rotary.channels) == (70, 35, 36)
    want = 1.0 / 10000.0 ** (torch.arange(0, 35, 2, dtype=torch.float32) / 35)
    assert torch.equal(rotary.inv_freq, want)
    with pytest.raises(ValueError, match="rotates 36 channels > head_dim 35"):
        from models.mixers.attention import MHA

        MHA(35, num_heads=1, rotary_emb_dim=35)
    assert RotaryEmbedding(4).channels == 4


def test_a_loaded_based_model_saves_and_reloads_as_native(tmp_path):
    from models.checkpoints.native import save_native
    from models.checkpoints.registry import load_model

    want = expected("based-2402")
    save_native(load_model(f"based:{FIXTURES / 'based-2402'}").model, tmp_path / "native")
    loaded = load_model(f"native:{tmp_path / 'native'}")
    assert loaded.model.config.norm == "rmsnorm" and loaded.model.config.layer_mixers
    diff = token_nll(loaded, want["sequences"][1]) - torch.tensor(want["nll"][1])
    assert diff.abs().max() <= 1e-4


def test_bf16_stays_close_to_upstream_fp32():
    from models.checkpoints.registry import load_model

    want = expected("based-main")
    loaded = load_model(f"based:{FIXTURES / 'based-main'}", dtype="bf16")
    assert loaded.dtype == torch.bfloat16
    diff = (token_nll(loaded, want["sequences"][1]) - torch.tensor(want["nll"][1])).abs()
    assert diff.mean() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_fp32_equals_upstream(case, monkeypatch):
    from models.checkpoints.registry import load_model

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    want = expected(case)
    loaded = load_model(f"based:{FIXTURES / case}", device="cuda")
    for seq, nll in zip(want["sequences"], want["nll"]):
        ours = token_nll(loaded, seq)
        assert (ours.cpu() - torch.tensor(nll)).abs().max() <= 1e-4, case


# ---- the mixers against naive references --------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(1, 40), window=st.integers(0, 12), block=st.integers(1, 9), rotary=st.booleans()
)
def test_sliding_window_equals_banded_softmax(T, window, block, rotary):
    from models.mixers.sliding_attention import SlidingWindowAttention

    torch.manual_seed(T * 100 + window)
    m = SlidingWindowAttention(
        16, num_heads=2, window=window, block=block, rotary_emb_dim=8 if rotary else 0
    )
    x = torch.randn(2, T, 16)
    qkv = m.Wqkv(x).view(2, T, 3, 2, 8)
    q, k, v = qkv.unbind(2)
    if rotary:
        q, k = m.rotary_emb(q, k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (j <= i) & (j >= i - window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.where(band, 0.0, -torch.inf)
    ref = m.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, 16))
    assert torch.allclose(m(x), ref, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 40), chunk=st.integers(1, 17), feature_dim=st.integers(1, 5))
def test_chunked_taylor_attention_equals_the_quadratic_form(T, chunk, feature_dim):
    from models.mixers.linear_attention import causal_taylor_attention, taylor_features

    torch.manual_seed(T + 7 * chunk)
    q, k = torch.randn(2, 3, T, feature_dim), torch.randn(2, 3, T, feature_dim)
    v = torch.randn(2, 3, T, 4)
    phi_q, phi_k = taylor_features(q, feature_dim), taylor_features(k, feature_dim)
    dots = q @ k.transpose(-1, -2)  # phi is the Taylor expansion of exp(q.k / sqrt(d))
    taylor = 1 + dots / math.sqrt(feature_dim) + dots**2 / (2 * feature_dim)
    assert torch.allclose(phi_q @ phi_k.transpose(-1, -2), taylor, atol=1e-4)
    a = torch.tril(taylor)
    ref = (a @ v) / (a.sum(-1, keepdim=True) + 1e-12)
    got = causal_taylor_attention(q, k, v, feature_dim, 1e-12, chunk_size=chunk)
    assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("mixer", ["based_conv", "linear_attention", "sliding_attention"])
def test_based_mixers_never_look_ahead(mixer):
    from models.backbone import LanguageModel, ModelConfig

    torch.manual_seed(1)
    kwargs = {"window": 5, "block": 4} if mixer == "sliding_attention" else {}
    if mixer == "linear_attention":
        kwargs = {"feature_dim": 4, "num_heads": 2, "chunk_size": 8}
    model = LanguageModel(
        ModelConfig(
            vocab_size=61,
            d_model=16,
            n_layers=2,
            sequence_mixer=mixer,
            sequence_mixer_kwargs=kwargs,
            state_mixer="swiglu",
            norm="rmsnorm",
            l_max=48,
        )  # fmt: skip
    ).eval()
    assert_never_looks_ahead(model, 61)


# ---- what the loader refuses ---------------------------------------------------------------------


def edited(tmp_path: Path, case: str, edit=None, state_edit=None) -> str:
    """A copy of a fixture with its config (and weights) edited; returns the spec."""
    out = tmp_path / case
    shutil.copytree(FIXTURES / case, out)
    cfg = json.loads((out / "config.json").read_text())
    if edit:
        edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    if state_edit:
        state = torch.load(out / "pytorch_model.bin", weights_only=True)
        state_edit(state)
        torch.save(state, out / "pytorch_model.bin")
    return f"based:{out}"


def _set(path: list, value):
    def edit(cfg):
        node = cfg
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    "case, edit, message",
    [
        ("based-main", _set(["alt_mixer", "_target_"], "based.models.mixers.mha.MHA"),
         "alt_mixer 'based.models.mixers.mha.MHA' is not implemented"),
        ("based-main", _set(["alt_mixer", "parallel_implementation"], "tk"),
         "parallel_implementation='tk' is not implemented"),
        ("based-main", _set(["alt_mixer", "feature_map", "_target_"], "x.FeatureMap"),
         "feature_map .* is not implemented"),
        ("based-main", _set(["mixer", "kernel"], 3), "option 'kernel' is not one this loader knows"),
        ("based-main", _set(["alt_mixer_2", "window_size"], None), "needs a window_size"),
        ("based-2402", _set(["alt_mixer", "feature_name"], "performer"),
         "feature_name='performer' is not implemented"),
        ("based-2402", _set(["alt_mixer", "use_decay_proj"], True), "use_decay_proj=True"),
        ("based-2402", _set(["alt_mixer", "num_key_value_heads"], 1), "grouped heads"),
        ("based-2402", _set(["fixed_decay"], True), "fixed_decay with linear_attn"),
        ("transformer-pp", _set(["n_head_kv"], 1), "grouped-query attention"),
        ("transformer-pp", _set(["activation_function"], "gelu"), "activation_function 'gelu'"),
        ("transformer-pp", _set(["parallel_block"], True), "parallel_block=True"),
        ("transformer-pp", _set(["rotary_emb_interleaved"], True), "rotary_emb_interleaved"),
        ("transformer-pp", _set(["tie_word_embeddings"], False), "tie_word_embeddings=False"),
        ("transformer-pp", _set(["mlp_type"], "alt"), "mlp_type='alt'"),
    ],
)  # fmt: skip
def test_unimplemented_options_are_refused_by_name(tmp_path, case, edit, message):
    from models.checkpoints.registry import load_model

    with pytest.raises(ArSliceError, match=message):
        load_model(edited(tmp_path, case, edit))


def test_mismatched_weights_and_untied_heads_are_refused(tmp_path):
    from models.checkpoints.registry import load_model

    def untie(state):
        state["lm_head.weight"] = state["lm_head.weight"] + 1

    with pytest.raises(ArSliceError, match="untied head is not implemented"):
        load_model(edited(tmp_path / "a", "transformer-pp", state_edit=untie))
    with pytest.raises(ArSliceError, match="mis-shaped keys.*in_proj"):
        load_model(edited(tmp_path / "b", "based-main", _set(["mixer", "expand_proj"], 2)))
    with pytest.raises(ArSliceError, match="missing keys.*conv.conv.weight"):
        # the 1.3B layout's `conv1` keys under today's class name: nothing to rename
        load_model(edited(tmp_path / "c", "based-2402", _set(
            ["mixer", "_target_"], "based.models.mixers.convolution.BaseConv")))  # fmt: skip

    def bad_freq(state):
        state["transformer.layers.0.mixer.rotary_emb.inv_freq"] = torch.ones(2)

    with pytest.raises(ArSliceError, match="inv_freq differs"):
        load_model(edited(tmp_path / "d", "transformer-pp", state_edit=bad_freq))


def test_stored_rotary_frequencies_are_accepted_when_they_agree(tmp_path):
    from models.checkpoints.registry import load_model
    from models.mixers.rotary import RotaryEmbedding

    def add_freq(state):
        state["transformer.layers.1.mixer.rotary_emb.inv_freq"] = RotaryEmbedding(4).inv_freq

    want = expected("transformer-pp")
    loaded = load_model(edited(tmp_path, "transformer-pp", state_edit=add_freq))
    seq = want["sequences"][1]
    assert (token_nll(loaded, seq) - torch.tensor(want["nll"][1])).abs().max() <= 1e-4


def test_missing_files_mamba_configs_and_unreachable_hubs_are_refused(tmp_path, monkeypatch):
    from models.checkpoints.registry import load_model

    with pytest.raises(ArSliceError, match="HazyResearch/based config.*load it with based:"):
        load_model(f"hf:{FIXTURES / 'based-main'}")

    with pytest.raises(ArSliceError, match="no such directory"):
        load_model(f"based:{tmp_path / 'nope'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArSliceError, match="config.json not found"):
        load_model(f"based:{tmp_path / 'empty'}")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ArSliceError, match="no pytorch_model.bin or model.safetensors"):
        load_model(f"based:{tmp_path / 'empty'}")
    mamba = tmp_path / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 2, "ssm_cfg": {}}))
    shutil.copy(FIXTURES / "based-main" / "pytorch_model.bin", mamba)
    with pytest.raises(ArSliceError, match="the weights do not match"):
        load_model(f"based:{mamba}")  # read as a Mamba, whose keys these are not
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(
        ArSliceError, match="hub is not reachable .*: based:hazyresearch/based-360m"
    ):
        load_model("based:hazyresearch/based-360m")
