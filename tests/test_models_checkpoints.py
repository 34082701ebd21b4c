"""zoology: and safari: checkpoints, and the errors a researcher sees for bad ones."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ar_slicing.errors import ArSliceError
from models import load_model
from models.backbone import LanguageModel, ModelConfig
from models.nll import per_token_nll


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ZOOLOGY_MIXERS = {
    "attention": ("zoology.mixers.attention.MHA", {"num_heads": 2}),
    "base_conv": ("zoology.mixers.base_conv.BaseConv", {"l_max": 32, "kernel_size": 3}),
    "hyena": ("zoology.mixers.hyena.Hyena", {"l_max": 32, "filter_order": 16}),
    "rwkv": ("zoology.mixers.rwkv.RWKVTimeMixer", {"l_max": 32}),
}


def zoology_config(mixer: str) -> dict:
    """A Zoology ModelConfig as zoology/config.py would dump it."""
    name, kwargs = ZOOLOGY_MIXERS[mixer]
    state = (
        {"name": "zoology.mixers.rwkv.RWKVStateMixer", "kwargs": {}}
        if mixer == "rwkv"
        else {"name": "zoology.mixers.mlp.MLP", "kwargs": {"hidden_mult": 2}}
    )
    return {
        "d_model": 16, "n_layers": 2, "vocab_size": 50, "max_position_embeddings": 32,
        "sequence_mixer": {"name": name, "kwargs": kwargs}, "state_mixer": state,
        "pad_vocab_size_multiple": 8,
    }  # fmt: skip


def zoology_model(mixer: str) -> LanguageModel:
    """The model the config describes, built directly (the weights a Zoology run would save)."""
    torch.manual_seed(0)
    _, kwargs = ZOOLOGY_MIXERS[mixer]
    kwargs = {k: v for k, v in kwargs.items() if k != "l_max"}
    cfg = ModelConfig(
        vocab_size=50, d_model=16, n_layers=2, sequence_mixer=mixer, sequence_mixer_kwargs=kwargs,
        state_mixer_kwargs={} if mixer == "rwkv" else {"hidden_mult": 2},
        l_max=32, max_position_embeddings=32, pad_vocab_size_multiple=8,
    )  # fmt: skip
    return LanguageModel(cfg).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("mixer", list(ZOOLOGY_MIXERS))
def test_zoology_checkpoint_with_config_beside_it(tmp_path, mixer):
    model = zoology_model(mixer)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(zoology_config(mixer)))
    loaded = load_model(f"zoology:{tmp_path / 'model.pt'}")
    assert loaded.architecture == mixer and loaded.vocab_size == 56  # 50 padded to a multiple of 8
    ids = torch.randint(0, 50, (2, 30))
    torch.testing.assert_close(logits(loaded.model, ids), logits(model, ids))
    expected = F.cross_entropy(
        logits(model, ids)[:, :-1].reshape(-1, 56), ids[:, 1:].reshape(-1), reduction="none"
    )
    got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got.view(-1), expected, atol=1e-5, rtol=1e-5)


def test_zoology_lightning_checkpoint_with_embedded_config_and_yaml(tmp_path):
    import yaml

    model = zoology_model("hyena")
    wrapped = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    torch.save({**wrapped, "config": {"model": zoology_config("hyena")}}, tmp_path / "last.ckpt")
    ids = torch.randint(0, 50, (1, 20))
    torch.testing.assert_close(
        logits(load_model(f"zoology:{tmp_path / 'last.ckpt'}").model, ids), logits(model, ids)
    )

    (tmp_path / "yaml").mkdir()
    torch.save(wrapped, tmp_path / "yaml" / "weights.pt")
    (tmp_path / "yaml" / "config.yaml").write_text(yaml.safe_dump(zoology_config("hyena")))
    torch.testing.assert_close(
        logits(load_model(f"zoology:{tmp_path / 'yaml'}").model, ids), logits(model, ids)
    )


def test_zoology_shape_mismatch_lists_the_keys(tmp_path):
    torch.save(zoology_model("attention").state_dict(), tmp_path / "model.pt")
    config = zoology_config("attention")
    config["state_mixer"]["kwargs"]["hidden_mult"] = 4
    config["n_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError) as err:
        load_model(f"zoology:{tmp_path / 'model.pt'}")
    msg = str(err.value)
    assert "missing keys (12): backbone.layers.2." in msg
    assert "backbone.layers.0.state_mixer.fc1.weight (checkpoint (32, 16), model (64, 16))" in msg
    assert "unexpected keys" not in msg


@pytest.mark.parametrize(
    "setup, words",
    [
        ("nothing", "no such checkpoint file or directory"),
        ("no_config", "no model config found"),
        ("two_weights", "several weights files"),
        ("mamba", "'zoology.mixers.mamba.Mamba' is not supported"),
        ("not_a_checkpoint", "not a readable PyTorch checkpoint"),
    ],
)
def test_zoology_bad_inputs(tmp_path, setup, words):
    target = tmp_path / "ckpt"
    if setup != "nothing":
        target.mkdir()
        torch.save(zoology_model("attention").state_dict(), target / "a.pt")
    if setup == "two_weights":
        torch.save({}, target / "b.pt")
    if setup == "mamba":
        config = zoology_config("attention")
        config["sequence_mixer"]["name"] = "zoology.mixers.mamba.Mamba"
        (target / "config.json").write_text(json.dumps(config))
    if setup == "not_a_checkpoint":
        (target / "a.pt").write_text("this is text, not weights")
        (target / "config.json").write_text(json.dumps(zoology_config("attention")))
    with pytest.raises(ArSliceError, match=words):
        load_model(f"zoology:{target}")


class Payload:
    """A class a weights-only unpickler must refuse to instantiate."""

    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_pickle_carrying_code_is_refused(tmp_path, capsys):
    state = dict(zoology_model("attention").state_dict())
    state["extra"] = Payload()
    torch.save(state, tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(zoology_config("attention")))
    with pytest.raises(ArSliceError, match="refused: this pickle holds more than plain weights"):
        load_model(f"zoology:{tmp_path / 'model.pt'}")
    assert "code ran" not in capsys.readouterr().out


# ---- safari ------------------------------------------------------------------------------------


def safari_state_dict(d=16, layers=2, vocab=64, l_max=32, emb_dim=5, seed=0) -> dict:
    """A random state dict with safari's ConvLMHeadModel / HyenaOperator layout and names."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    state = {"backbone.embeddings.word_embeddings.weight": r(vocab, d, scale=0.5)}
    z = r(1, l_max, emb_dim, scale=1.0)
    for i in range(layers):
        p = f"backbone.layers.{i}."
        state |= {
            p + "mixer.in_proj.weight": r(3 * d, d), p + "mixer.in_proj.bias": r(3 * d),
            p + "mixer.out_proj.weight": r(d, d), p + "mixer.out_proj.bias": r(d),
            p + "mixer.short_filter.weight": r(3 * d, 1, 3, scale=0.5),
            p + "mixer.short_filter.bias": r(3 * d),
            p + "mixer.filter_fn.bias": r(d), p + "mixer.filter_fn.pos_emb.z": z,
            p + "mixer.filter_fn.pos_emb.t": torch.linspace(0, 1, l_max)[None, :, None],
            p + "mixer.filter_fn.implicit_filter.0.weight": r(8, emb_dim),
            p + "mixer.filter_fn.implicit_filter.0.bias": r(8),
            p + "mixer.filter_fn.implicit_filter.2.weight": r(8, 8),
            p + "mixer.filter_fn.implicit_filter.2.bias": r(8),
            p + "mixer.filter_fn.implicit_filter.4.weight": r(d, 8),
            p + "mixer.filter_fn.modulation.deltas": -torch.rand(1, 1, d, generator=g) * 5,
            p + "mlp.fc1.weight": r(4 * d, d), p + "mlp.fc1.bias": r(4 * d),
            p + "mlp.fc2.weight": r(d, 4 * d), p + "mlp.fc2.bias": r(d),
            p + "norm1.weight": 1 + r(d), p + "norm1.bias": r(d),
            p + "norm2.weight": 1 + r(d), p + "norm2.bias": r(d),
        }  # fmt: skip
        freq = 1 + r(1, 8)
        state[p + "mixer.filter_fn.implicit_filter.1.freq"] = freq  # one shared Sin module
        state[p + "mixer.filter_fn.implicit_filter.3.freq"] = freq
    state |= {"backbone.ln_f.weight": 1 + r(d), "backbone.ln_f.bias": r(d)}
    return state


def safari_reference_logits(state: dict, ids: torch.Tensor, d: int = 16) -> torch.Tensor:
    """safari's forward written out from its source, directly on the safari-layout weights."""
    S = {k: v.double() for k, v in state.items()}
    x = S["backbone.embeddings.word_embeddings.weight"][ids]  # (B, L, D)
    L = ids.shape[1]
    residual = None
    i = 0
    while f"backbone.layers.{i}.norm1.weight" in S:
        p = f"backbone.layers.{i}."
        residual = x if residual is None else residual + x
        h = F.layer_norm(residual, (d,), S[p + "norm1.weight"], S[p + "norm1.bias"], eps=1e-5)
        u = F.linear(h, S[p + "mixer.in_proj.weight"], S[p + "mixer.in_proj.bias"]).transpose(1, 2)
        uc = F.conv1d(
            u,
            S[p + "mixer.short_filter.weight"],
            S[p + "mixer.short_filter.bias"],
            padding=2,
            groups=3 * d,
        )[..., :L]
        x0, x1, v = uc.split(d, dim=1)  # safari: *x, v = uc.split(d_model)
        # HyenaFilter.filter: implicit MLP (shared Sin), then exponential modulation
        f = f"{p}mixer.filter_fn."
        z, t = S[f + "pos_emb.z"][:, :L], S[f + "pos_emb.t"][:, :L]
        hz = torch.sin(
            S[f + "implicit_filter.1.freq"]
            * F.linear(z, S[f + "implicit_filter.0.weight"], S[f + "implicit_filter.0.bias"])
        )
        hz = torch.sin(
            S[f + "implicit_filter.3.freq"]
            * F.linear(hz, S[f + "implicit_filter.2.weight"], S[f + "implicit_filter.2.bias"])
        )
        hz = F.linear(hz, S[f + "implicit_filter.4.weight"])
        k = (hz * torch.exp(-t * S[f + "modulation.deltas"].abs()))[0].T  # (D, L)
        v = v * x1  # for o, x_i in enumerate(reversed(x[1:])): v = v * x_i
        conv = torch.zeros_like(v)
        for tt in range(L):
            conv[..., tt] = (k[:, : tt + 1].flip(-1) * v[..., : tt + 1]).sum(-1)
        v = conv + v * S[f + "bias"][:, None]
        y = (v * x0).transpose(1, 2)  # y = v * x[0]
        x = F.linear(y, S[p + "mixer.out_proj.weight"], S[p + "mixer.out_proj.bias"])
        residual = residual + x
        h = F.layer_norm(residual, (d,), S[p + "norm2.weight"], S[p + "norm2.bias"], eps=1e-5)
        h = F.gelu(F.linear(h, S[p + "mlp.fc1.weight"], S[p + "mlp.fc1.bias"]), approximate="tanh")
        x = F.linear(h, S[p + "mlp.fc2.weight"], S[p + "mlp.fc2.bias"])
        i += 1
    h = F.layer_norm(
        residual + x, (d,), S["backbone.ln_f.weight"], S["backbone.ln_f.bias"], eps=1e-5
    )
    return (h @ S["backbone.embeddings.word_embeddings.weight"].T).float()


def test_safari_layout_loads_and_computes_what_safari_computes(tmp_path, bpe_tokenizer_path):
    from ar_slicing.tokenizer import fingerprint, load_tokenizer

    state = safari_state_dict()
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}}, tmp_path / "hyena.ckpt")
    (tmp_path / "tokenizer.json").write_bytes(bpe_tokenizer_path.read_bytes())
    loaded = load_model(f"safari:{tmp_path / 'hyena.ckpt'}")
    assert loaded.architecture == "hyena" and loaded.max_positions == 32 and loaded.vocab_size == 64
    assert loaded.tokenizer_fingerprint == fingerprint(load_tokenizer(bpe_tokenizer_path))
    ids = torch.randint(0, 64, (2, 24))
    expected = safari_reference_logits(state, ids)
    torch.testing.assert_close(logits(loaded.model, ids), expected, atol=1e-4, rtol=1e-4)
    # and the reordering matters: read in Zoology's order without the swap, the logits differ
    from models.safari_ckpt import rename_safari_keys

    unswapped = LanguageModel(loaded.model.config).eval()
    unswapped.load_state_dict(rename_safari_keys(state), strict=False)
    assert (logits(unswapped, ids) - expected).abs().max() > 1e-2


def test_safari_state_dict_without_recomputable_buffers(tmp_path):
    state = {
        k: v
        for k, v in safari_state_dict().items()
        if not k.endswith(("pos_emb.t", "modulation.deltas"))
    }
    torch.save(state, tmp_path / "hyena.pt")
    assert load_model(f"safari:{tmp_path / 'hyena.pt'}").architecture == "hyena"


def test_safari_bad_inputs(tmp_path):
    with pytest.raises(ArSliceError, match="checkpoint file not found"):
        load_model(f"safari:{tmp_path / 'missing.pt'}")
    torch.save({"backbone.ln_f.weight": torch.ones(4)}, tmp_path / "other.pt")
    with pytest.raises(ArSliceError, match="not a safari Hyena LM state dict"):
        load_model(f"safari:{tmp_path / 'other.pt'}")
    state = safari_state_dict()
    state["backbone.layers.1.mixer.out_proj.weight"] = torch.zeros(16, 15)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(
        ArSliceError,
        match=r"sequence_mixer.out_proj.weight \(checkpoint \(16, 15\), model \(16, 16\)\)",
    ):
        load_model(f"safari:{tmp_path / 'bad.pt'}")
