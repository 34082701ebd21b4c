"""The LM backbone, attention, per-token NLL, the native format and the hf: loader."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from ar_slicing.data.tokenizer import fingerprint
from ar_slicing.errors import ArSliceError
from models import load_model
from models.backbone import LanguageModel, ModelConfig
from models.checkpoints.native import load_native, save_native
from models.mixers.attention import MHA
from models.nll import chunked_nll, per_token_nll, tiled_nll

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# The state-dict keys of a 2-layer Zoology attention LM (zoology/model.py + mixers/attention.py + mlp.py).
ZOOLOGY_ATTENTION_KEYS = [
    "backbone.embeddings.word_embeddings.weight",
    "backbone.embeddings.position_embeddings.weight",
    *[
        f"backbone.layers.{i}.{name}"
        for i in range(2)
        for name in (
            "sequence_mixer.Wqkv.weight",
            "sequence_mixer.Wqkv.bias",
            "sequence_mixer.out_proj.weight",
            "sequence_mixer.out_proj.bias",
            "state_mixer.fc1.weight",
            "state_mixer.fc1.bias",
            "state_mixer.fc2.weight",
            "state_mixer.fc2.bias",
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
        )
    ],
    "backbone.ln_f.weight",
    "backbone.ln_f.bias",
    "lm_head.weight",
]


def tiny(mixer="attention", **kw) -> LanguageModel:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, sequence_mixer=mixer, l_max=64, **kw)
    return LanguageModel(cfg).eval()


def test_attention_backbone_keys_are_zoologys():
    model = tiny(sequence_mixer_kwargs={"num_heads": 4})
    assert sorted(model.state_dict()) == sorted(ZOOLOGY_ATTENTION_KEYS)
    assert model.lm_head.weight is model.backbone.embeddings.word_embeddings.weight


def test_attention_equals_naive_masked_softmax():
    torch.manual_seed(1)
    mha = MHA(d_model=24, l_max=16, num_heads=3).eval()
    x = torch.randn(2, 10, 24)
    qkv = mha.Wqkv(x).view(2, 10, 3, 3, 8)  # (B, T, three, H, Dh)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, H, Dh)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
    mask = torch.ones(10, 10).triu(1).bool()
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    naive = mha.out_proj(torch.einsum("bhts,bshd->bthd", probs, v).reshape(2, 10, 24))
    torch.testing.assert_close(mha(x), naive, atol=1e-5, rtol=1e-5)


def test_attention_lm_is_causal():
    model = tiny()
    ids = torch.randint(0, 97, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 5) % 97
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_forward_losses_agree_with_logits():
    model = tiny()
    ids = torch.randint(0, 97, (3, 17))
    targets = torch.randint(0, 97, (3, 17))
    targets[0, 3] = -1
    with torch.no_grad():
        logits = model(ids)
        per_token = model(ids, targets, loss_reduction="none")
        mean = model(ids, targets)
    ref = F.cross_entropy(logits.view(-1, 97), targets.view(-1), reduction="none", ignore_index=-1)
    assert per_token.dtype == torch.float32 and per_token.shape == (3, 17)
    torch.testing.assert_close(per_token.view(-1), ref, atol=1e-5, rtol=1e-5)
    assert per_token[0, 3] == 0
    torch.testing.assert_close(mean, ref.sum() / 50, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_chunked_nll_equals_full_log_softmax(chunk):
    torch.manual_seed(2)
    hidden, weight, bias = torch.randn(2, 9, 16), torch.randn(50, 16), torch.randn(50)
    targets = torch.randint(0, 50, (2, 9))
    logp = torch.log_softmax(hidden @ weight.T + bias, dim=-1)
    ref = -logp.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(chunked_nll(hidden, weight, bias, targets, chunk_size=chunk), ref)


@pytest.mark.parametrize(
    "rows, vocab_block, bias, scale",
    [(1, 7, True, 1.0), (5, 50, False, 1.0), (4, 13, True, 30.0), (1024, 1024, True, 1.0)],
)
def test_tiled_nll_equals_full_log_softmax(rows, vocab_block, bias, scale):
    """Tiles that do not divide the tokens or the vocabulary, with and without a bias, and logits
    in the hundreds (where a naive exp overflows) all give the full log_softmax's NLL."""
    torch.manual_seed(3)
    hidden, weight = torch.randn(3, 11, 16) * scale, torch.randn(50, 16)
    b = torch.randn(50) if bias else None
    targets = torch.randint(0, 50, (3, 11))
    targets[1, 4] = -1
    logits = hidden @ weight.T + (b if bias else 0)
    ref = -torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ref[1, 4] = 0
    got = tiled_nll(hidden, weight, b, targets, rows=rows, vocab_block=vocab_block)
    assert got.dtype == torch.float32 and got.shape == (3, 11)
    torch.testing.assert_close(got, ref, atol=1e-4 * scale, rtol=1e-5)
    torch.testing.assert_close(
        got, chunked_nll(hidden, weight, b, targets), atol=1e-4 * scale, rtol=1e-5
    )


def test_tiled_nll_under_bf16_autocast_stays_close_to_fp32():
    torch.manual_seed(4)
    hidden, weight = torch.randn(2, 64, 32), torch.randn(300, 32) * 0.2
    targets = torch.randint(0, 300, (2, 64))
    fp32 = tiled_nll(hidden, weight, None, targets, rows=40, vocab_block=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = tiled_nll(hidden.bfloat16(), weight, None, targets, rows=40, vocab_block=128)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max() < 0.05 and (bf16 - fp32).abs().max() > 0


def test_native_round_trip(tmp_path, bpe_tokenizer_path, bpe_tokenizer):
    model = tiny(sequence_mixer_kwargs={"num_heads": 2})
    save_native(model, tmp_path / "m", tokenizer_json=bpe_tokenizer_path)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architecture"] == "attention"
    again = load_native(tmp_path / "m")
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)
    assert again.lm_head.weight is again.backbone.embeddings.word_embeddings.weight

    loaded = load_model(f"native:{tmp_path / 'm'}")
    assert loaded.architecture == "attention"
    assert loaded.n_params == sum(p.numel() for p in model.parameters())
    assert loaded.vocab_size == 97 and loaded.max_positions == 64
    assert loaded.tokenizer_fingerprint == fingerprint(bpe_tokenizer)
    nll = per_token_nll(loaded, ids[:, :-1], ids[:, 1:])
    ref = F.cross_entropy(
        model(ids)[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1), reduction="none"
    )
    torch.testing.assert_close(nll.view(-1), ref.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mixer", ["attention", "hyena", "base_conv", "rwkv"])
def test_native_bf16_save_rounds_every_parameter_shared_ones_included(tmp_path, mixer):
    """saved_dtype="bf16": the saved weights are the parameters rounded to bf16, and a model
    whose parameters are shared (Hyena's Sin frequencies) loads back with them still one."""
    torch.manual_seed(0)
    model = tiny(mixer)
    with torch.no_grad():  # as after training: no parameter is a bf16 number by chance
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    save_native(model, tmp_path / "m", saved_dtype="bf16")
    again = load_native(tmp_path / "m")
    got = dict(again.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        want = p.detach().to(torch.bfloat16).float()
        assert torch.equal(got[name].detach(), want), name
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        assert torch.isfinite(again(ids)).all()


def test_native_untied_head_round_trip(tmp_path):
    model = tiny(tie_word_embeddings=False, state_mixer="identity", state_mixer_kwargs={})
    assert model.lm_head.weight is not model.backbone.embeddings.word_embeddings.weight
    save_native(model, tmp_path / "m")
    again = load_native(tmp_path / "m")
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)
    assert not torch.equal(again.lm_head.weight, again.backbone.embeddings.word_embeddings.weight)


def test_native_format_1_config_reads_as_the_model_it_described(tmp_path):
    """Before the options were typed, configs kept the MLP's hidden_mult for every state mixer
    and a long BaseConv meant the Hyena-style implicit filter."""
    from safetensors.torch import save_file

    config = ModelConfig(
        vocab_size=97, d_model=16, n_layers=2, sequence_mixer="base_conv", l_max=32,
        sequence_mixer_kwargs={"kernel_size": [3, -1], "implicit_filter": "hyena"},
        state_mixer="identity",
    )  # fmt: skip
    model = LanguageModel(config).eval()
    (tmp_path / "m").mkdir()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    old = {
        "vocab_size": 97, "d_model": 16, "n_layers": 2, "sequence_mixer": "base_conv",
        "sequence_mixer_kwargs": {"kernel_size": [3, -1]}, "state_mixer": "identity",
        "state_mixer_kwargs": {"hidden_mult": 4}, "l_max": 32, "max_position_embeddings": 0,
        "layer_norm_epsilon": 1e-5, "pad_vocab_size_multiple": 1, "embed_dropout": 0.0,
        "resid_dropout": 0.0,
    }  # fmt: skip
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({"format": "ar-slicing-native", "format_version": 1, "model": old})
    )
    again = load_native(tmp_path / "m")
    assert again.config.sequence_mixer_kwargs["implicit_filter"] == "hyena"
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_native_weights_that_do_not_match_the_config_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    save_native(tiny(), tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state.pop("backbone.ln_f.bias")
    state["backbone.extra.weight"] = torch.zeros(3)
    state["backbone.layers.0.state_mixer.fc1.weight"] = torch.zeros(5, 32)
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ArSliceError) as err:
        load_model(f"native:{tmp_path / 'm'}")
    msg = str(err.value)
    assert "model.safetensors" in msg
    assert "missing keys (1): backbone.ln_f.bias" in msg
    assert "unexpected keys (1): backbone.extra.weight" in msg
    assert "backbone.layers.0.state_mixer.fc1.weight (checkpoint (5, 32), model (128, 32))" in msg


@pytest.mark.parametrize(
    "spec, words",
    [
        ("pythia-70m", "PREFIX:TARGET"),
        ("gguf:model.bin", "hf:, zoology:, safari:, based:, native:"),
        ("native:/nonexistent/dir", "not a directory"),
        ("hf:/nonexistent/dir", "not a directory"),
    ],
)
def test_bad_specs_are_explained(spec, words):
    with pytest.raises(ArSliceError, match=words.replace("(", r"\(")):
        load_model(spec)


def _tiny_hf(kind: str):
    import transformers

    torch.manual_seed(3)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=1024, n_positions=64, n_embd=32, n_layer=2, n_head=2
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.GPTNeoXConfig(
        vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg)


@pytest.mark.parametrize(
    "kind, model_type, positions", [("gpt2", "gpt2", 64), ("neox", "gpt_neox", 128)]
)
def test_hf_loader_scores_like_transformers(tmp_path, bpe_tokenizer, kind, model_type, positions):
    from transformers import PreTrainedTokenizerFast

    ref = _tiny_hf(kind).eval()
    ref.save_pretrained(tmp_path / kind)
    PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer).save_pretrained(tmp_path / kind)
    loaded = load_model(f"hf:{tmp_path / kind}")
    assert loaded.architecture == model_type
    assert loaded.max_positions == positions and loaded.vocab_size == 1024
    assert loaded.n_params == sum(p.numel() for p in ref.parameters())
    assert loaded.tokenizer_fingerprint == fingerprint(bpe_tokenizer)
    ids = torch.randint(0, 1024, (2, 33))
    with torch.no_grad():
        logits = ref(ids[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, 1024), ids[:, 1:].reshape(-1), reduction="none")
    got = per_token_nll(loaded, ids[:, :-1], ids[:, 1:], chunk_size=10)
    torch.testing.assert_close(got.view(-1), expected, atol=1e-4, rtol=1e-4)


def test_hf_directory_without_config_is_explained(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArSliceError, match="config.json not found"):
        load_model(f"hf:{tmp_path / 'empty'}")
