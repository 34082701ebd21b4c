"""Checkpoints made by Zoology's, safari's and transformers' own code (tests/fixtures/upstream,
written by its make_fixtures.py) load through `models.load_model` and give, token by token, the
losses their code gave."""

from __future__ import annotations

import pytest

from tests import UPSTREAM
from tests.models.upstream_losses import CASES, errors_unpinned, expected, load_case, max_nll_error

TOLERANCE = 1e-4  # nats per token, fp32


# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def upstream_errors() -> dict[str, float]:
    """Every case's distance from upstream's losses, as an unpinned `arslice eval` computes it."""
    return errors_unpinned(CASES)


def test_every_family_and_layout_has_a_fixture():
    assert len(CASES) >= 15
    for prefix in ("zoology-", "safari-", "hf-", "h3-", "retnet-"):
        assert any(c.startswith(prefix) for c in CASES)
    for case in ("zoology-h3", "zoology-longconv", "zoology-implicit-longconv", "zoology-hybrid"):
        assert case in CASES
    total = sum(f.stat().st_size for f in UPSTREAM.rglob("*") if f.is_file())
    # small enough to ship: tiny widths; the largest are the windows of 2048 predictions
    # (Mamba-2), upstream GatedMlp's 256-wide MLPs (Based, JRT) and the H3 and RetNet hybrids
    assert total < 6 * 2**20


@pytest.mark.parametrize("case", CASES)
def test_losses_equal_the_upstream_codes(case, upstream_errors):
    data = expected(case)
    loaded = load_case(case)
    windows = data["windows"]
    assert len(windows[1]["inputs"]) < len(windows[0]["inputs"])  # a window shorter than l_max
    assert upstream_errors[case] <= TOLERANCE
    for key, value in data.get("settings", {}).items():
        assert loaded.settings[key] == value


def with_config_changed(loaded, **change):
    """The same weights in a model whose config differs by `change`."""
    import dataclasses

    from models.backbone import LanguageModel
    from models.checkpoints.registry import wrap_language_model

    model = LanguageModel(dataclasses.replace(loaded.model.config, **change)).eval()
    model.load_state_dict(loaded.model.state_dict())
    return wrap_language_model(model, loaded.spec, None)


def test_the_fixtures_tell_a_wrong_model_apart():
    """The choices the loaders make matter at these magnitudes: the same weights with the
    upstream-contrary choice miss the recorded losses by far more than the tolerance."""
    eps = load_case("zoology-eps")
    wrong = with_config_changed(eps, block_norm_epsilon=None)  # 1e-3 in every norm
    assert max_nll_error(wrong, expected("zoology-eps")["windows"]) > 1e-2
    safari = load_case("safari-eval-yaml")
    kwargs = {**safari.model.config.sequence_mixer_kwargs, "modulate": True}
    wrong = with_config_changed(safari, sequence_mixer_kwargs=kwargs)
    assert max_nll_error(wrong, expected("safari-eval-yaml")["windows"]) > 1.0
