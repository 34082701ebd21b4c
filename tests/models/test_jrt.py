"""JRT-RNN through `based:` against HazyResearch/prefix-linear-attention itself (golden fixtures
made by tests/fixtures/upstream/make_jrt_fixtures.py): every token's loss given its own context
as upstream computes it, the one-pass forward as upstream's, what the encoder would leak, the
refusals (the published configs: test_hazy_suites.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ar_slicing.errors import ArSliceError
from models import load_model
from models.mixers.prefix_linear_attention import prefix_causal_hidden
from models.nll import per_token_nll
from tests import UPSTREAM

FIXTURES = UPSTREAM / "based"
CASES = ("jrt", "jrt-two-prefix-layers")
OURS = {
    "BaseConv": "GatedConv",
    "PrefixLinearAttention": "PrefixLinearAttention",
    "SlidingAttention": "SlidingWindowAttention",
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def nll_of(loaded, seq: list[int], one_pass: bool = False) -> torch.Tensor:
    ids = torch.tensor([seq])
    if not one_pass:
        return per_token_nll(loaded, ids[:, :-1], ids[:, 1:])[0]
    from models.nll import tiled_nll

    with torch.no_grad():
        hidden = loaded.model.backbone(ids[:, :-1])
        return tiled_nll(hidden, loaded.model.lm_head.weight, None, ids[:, 1:])[0]


@pytest.mark.parametrize("case", CASES)
def test_every_token_equals_upstream_given_its_own_context(case):
    want = expected(case)
    loaded = load_model(f"based:{FIXTURES / case}")
    layers = loaded.model.backbone.layers
    assert [type(b.sequence_mixer).__name__ for b in layers] == [OURS[m] for m in want["mixers"]]
    assert loaded.architecture == "jrt" and "prefix_scoring" in loaded.settings
    enc = want["enc_length"]
    assert min(map(len, want["sequences"])) < enc < max(map(len, want["sequences"]))
    for seq, nll, one in zip(want["sequences"], want["nll"], want["nll_one_pass"]):
        assert (nll_of(loaded, seq) - torch.tensor(nll)).abs().max() <= 1e-4
        # the one-pass forward is upstream's too: the mixer itself, encoder included
        assert (nll_of(loaded, seq, one_pass=True) - torch.tensor(one)).abs().max() <= 1e-4


def test_the_encoder_leaks_inside_the_prefix_and_only_there():
    """Run once over a window, the positions before enc_length - 1 read their own next tokens:
    upstream's one-pass losses there are far from its own-context ones, and equal after."""
    want = expected("jrt")
    enc = want["enc_length"]
    own, one = torch.tensor(want["nll"][1]), torch.tensor(want["nll_one_pass"][1])
    assert (own[: enc - 1] - one[: enc - 1]).abs().max() > 0.1
    torch.testing.assert_close(own[enc - 1 :], one[enc - 1 :], atol=1e-5, rtol=0)


def test_prefix_scoring_never_looks_ahead():
    """Changing tokens from position 5 on changes no score before it (one pass would)."""
    loaded = load_model(f"based:{FIXTURES / 'jrt'}")
    model = loaded.model
    ids = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 90
    with torch.no_grad():
        a, b = prefix_causal_hidden(model, ids), prefix_causal_hidden(model, changed)
        torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-5, rtol=1e-5)
        assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-3
        leaky_a, leaky_b = model.backbone(ids), model.backbone(changed)
        assert (leaky_a[:, :5] - leaky_b[:, :5]).abs().max() > 1e-3


def test_a_batch_scores_each_row_alone():
    loaded = load_model(f"based:{FIXTURES / 'jrt-two-prefix-layers'}")
    ids = torch.randint(0, 90, (3, 25), generator=torch.Generator().manual_seed(4))
    together = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
    for b in range(3):
        alone = per_token_nll(loaded, ids[b : b + 1, :-1], ids[b : b + 1, 1:])
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-5, rtol=1e-5)


def edited(tmp_path, edit) -> str:
    out = tmp_path / "jrt"
    shutil.copytree(FIXTURES / "jrt", out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return f"based:{out}"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["alt_mixer"].update(implementation="tk"),
            r"implementation='tk' is not implemented",
        ),
        (
            lambda c: c["alt_mixer"].update(num_key_value_heads=1),
            "num_key_value_heads != num_heads",
        ),
        (lambda c: c["alt_mixer"].update(feature_name="performer"), "feature_name='performer'"),
        (
            lambda c: (c["alt_mixer"].pop("enc_length"), c.pop("enc_length")),
            "needs a positive enc_length",
        ),
        (lambda c: c["alt_mixer"].update(chunk=4), "option 'chunk' is not one this loader knows"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(tmp_path, edit, message):
    with pytest.raises(ArSliceError, match=message) as err:
        load_model(edited(tmp_path, edit))
    assert "\n" not in str(err.value)


def test_fla_parallel_is_read_as_the_same_function(tmp_path):
    """The published JRT configs run prefix-linear-attention's FLA kernel (2024 API): the
    function of the "default" implementation the fixtures ran."""
    loaded = load_model(
        edited(tmp_path, lambda c: c["alt_mixer"].update(implementation="fla_parallel"))
    )
    want = expected("jrt")
    for seq, nll in zip(want["sequences"], want["nll"]):
        assert (nll_of(loaded, seq) - torch.tensor(nll)).abs().max() <= 1e-4


def test_based_360m_30b_is_refused_by_name():
    """The suite's 360M Based (prefix-linear-attention's baselines/based-360m-30b.yaml) names a
    `base_conv.BaseConv` taking `kernel_sizes` and a `linear_attn.LinearAttention` with an
    input-dependent fixed decay, from a based commit never published: each refused by name."""
    from models.checkpoints.based import model_config_from_based

    raw = {
        **json.loads((FIXTURES / "jrt" / "config.json").read_text()),
        "fixed_decay": True, "decay_const": -3, "decay_denom": False,
        "mixer": {"_target_": "based.models.mixers.base_conv.BaseConv", "l_max": 2048,
                  "use_bias": True, "expand_proj": 4, "kernel_sizes": [3]},
        "alt_mixer": {"_target_": "based.models.mixers.linear_attn.LinearAttention",
                      "l_max": 2048, "feature_dim": 16, "feature_name": "taylor_exp",
                      "num_heads": 16, "num_key_value_heads": 16, "use_rotary_apply": False,
                      "use_act": False, "train_view": "quadratic", "use_decay_proj": True},
    }  # fmt: skip
    state = {"transformer.layers.0.mlp.fc2.weight": torch.empty(16, 32)}
    with pytest.raises(ArSliceError, match="'kernel_sizes' is not one this loader knows"):
        model_config_from_based(raw, state, "based-360M-30B")
    raw["mixer"] = {**raw["mixer"], "kernel_size": 3}
    del raw["mixer"]["kernel_sizes"]
    with pytest.raises(ArSliceError, match=r"use_decay_proj=True is not implemented"):
        model_config_from_based(raw, state, "based-360M-30B")
