"""zoology: and safari: checkpoints: what the loaders decide that the weights do not show, and the
errors a researcher sees for bad ones. That the losses equal the upstream code's is pinned by
checkpoints that code made (tests/models/test_upstream_fixtures.py); these files come from there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ar_slicing.errors import ArSliceError
from models import load_model
from models.nll import per_token_nll
from tests import UPSTREAM

# tiny tensors: one intra-op thread avoids OpenMP stalls on a busy machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def copy_case(case: str, dest: Path) -> Path:
    shutil.copytree(UPSTREAM / case, dest)
    (dest / "expected.json").unlink()
    return dest


def zoology_config(case: str) -> dict:
    return json.loads((UPSTREAM / case / "config.json").read_text())


def logits(loaded, ids):
    with torch.no_grad():
        hidden, weight, _ = loaded.hidden_and_head(ids)
        return hidden @ weight.T


# ---- zoology ------------------------------------------------------------------------------------


def test_zoology_config_of_a_mixer_option_typo_is_refused_by_name(tmp_path):
    ckpt = copy_case("zoology-mha", tmp_path / "c")
    config = zoology_config("zoology-mha")
    config["sequence_mixer"]["kwargs"] = {"num_head": 2}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError) as err:
        load_model(f"zoology:{ckpt}")
    msg = str(err.value)
    assert "config.json" in msg and "sequence mixer 'attention'" in msg
    assert "unknown option 'num_head'" in msg and "accepts num_heads, bias, dropout" in msg


def test_zoology_hyena_option_typo_is_refused_though_zoology_would_swallow_it(tmp_path):
    ckpt = copy_case("zoology-hyena", tmp_path / "c")
    config = zoology_config("zoology-hyena")
    config["sequence_mixer"]["kwargs"]["filter_ordr"] = 8
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError, match="sequence mixer 'hyena': unknown option 'filter_ordr'"):
        load_model(f"zoology:{ckpt}")
    config["sequence_mixer"]["kwargs"] = {"l_max": 32, "bidirectional": True}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError, match="bidirectional=True is not implemented"):
        load_model(f"zoology:{ckpt}")
    config["sequence_mixer"]["kwargs"] = {"l_max": 32, "lr": 1e-3, "outer_mixing": True}
    (ckpt / "config.json").write_text(json.dumps(config))  # no effect in Zoology's forward
    assert load_model(f"zoology:{ckpt}").architecture == "hyena"


def test_zoology_untied_head_is_never_loaded_into_the_tied_one(tmp_path):
    ckpt = copy_case("zoology-untied", tmp_path / "c")
    loaded = load_model(f"zoology:{ckpt}")
    head, embedding = loaded.model.lm_head.weight, loaded.model.backbone.embeddings.word_embeddings
    assert head is not embedding.weight and not torch.equal(head, embedding.weight)
    config = zoology_config("zoology-untied")
    config["learnable_word_embeddings"] = True  # the config now says tied: two tensors, one slot
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ArSliceError, match="lm_head.weight are one tensor in this model but differ"
    ):
        load_model(f"zoology:{ckpt}")


def test_zoology_norms_use_layer_norm_epsilon_for_ln_f_only():
    model = load_model(f"zoology:{UPSTREAM / 'zoology-eps'}").model
    assert model.backbone.ln_f.eps == 1e-3
    assert {layer.norm1.eps for layer in model.backbone.layers} == {1e-5}
    assert {layer.norm2.eps for layer in model.backbone.layers} == {1e-5}


def test_zoology_base_conv_filter_layouts_are_told_apart_by_their_keys():
    new = load_model(f"zoology:{UPSTREAM / 'zoology-baseconv-implicit'}")
    old = load_model(f"zoology:{UPSTREAM / 'zoology-baseconv-implicit-old'}")
    assert new.model.config.sequence_mixer_kwargs["implicit_filter"] == "mlp"
    assert old.model.config.sequence_mixer_kwargs["implicit_filter"] == "hyena"
    assert old.model.config.state_mixer == "base_conv"  # that Zoology's second BaseConv per block
    assert old.settings["state_is_sequence_copy"] and not new.settings["state_is_sequence_copy"]


def test_zoology_model_config_option_replaces_the_one_found(tmp_path):
    ckpt = copy_case("zoology-mha", tmp_path / "c")
    other = tmp_path / "elsewhere.json"
    (ckpt / "config.json").rename(other)
    with pytest.raises(ArSliceError, match="no model config found"):
        load_model(f"zoology:{ckpt}")
    loaded = load_model(f"zoology:{ckpt}", model_config=other)
    assert loaded.settings["config"] == f"{other} (--model-config)"


def test_zoology_shape_mismatch_lists_the_keys(tmp_path):
    ckpt = copy_case("zoology-mha", tmp_path / "c")
    config = zoology_config("zoology-mha")
    config["state_mixer"]["kwargs"]["hidden_mult"] = 4
    config["n_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError) as err:
        load_model(f"zoology:{ckpt}")
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
        ("unknown_field", "unknown Zoology ModelConfig field.*num_layer"),
        ("not_a_checkpoint", "model.pt: not a PyTorch checkpoint .neither the zip archive"),
        ("config_not_a_mapping", "config.json: expected a mapping of config fields, found list"),
    ],
)
def test_zoology_bad_inputs(tmp_path, setup, words):
    target = tmp_path / "ckpt"
    if setup != "nothing":
        copy_case("zoology-mha", target)
    config = zoology_config("zoology-mha")
    if setup == "no_config":
        (target / "config.json").unlink()
    if setup == "two_weights":
        torch.save({}, target / "b.pt")
    if setup == "mamba":
        config["sequence_mixer"]["name"] = "zoology.mixers.mamba.Mamba"
    if setup == "unknown_field":
        config["num_layer"] = 2
    if setup in ("mamba", "unknown_field"):
        (target / "config.json").write_text(json.dumps(config))
    if setup == "not_a_checkpoint":
        (target / "model.pt").write_text("this is text, not weights")
    if setup == "config_not_a_mapping":
        (target / "config.json").write_text("[1, 2]")
    with pytest.raises(ArSliceError, match=words):
        load_model(f"zoology:{target}")


class Payload:
    """A class a weights-only unpickler must refuse to instantiate."""

    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_pickle_carrying_code_is_refused_in_one_clean_line(tmp_path, capsys):
    ckpt = copy_case("zoology-mha", tmp_path / "c")
    state = torch.load(ckpt / "model.pt", weights_only=True)
    state["extra"] = Payload()
    torch.save(state, ckpt / "model.pt")
    with pytest.raises(ArSliceError) as err:
        load_model(f"zoology:{ckpt}")
    msg = str(err.value)
    assert "refused: this pickle names print, a class or function" in msg
    assert "\x1b" not in msg and "\n" not in msg and "two options" not in msg
    assert "code ran" not in capsys.readouterr().out


# ---- safari ------------------------------------------------------------------------------------


def test_safari_settings_come_from_safaris_own_config_layouts(tmp_path):
    found = {
        case: load_case_settings(case)
        for case in ("safari-modulate", "safari-eval-yaml", "safari-lightning")
    }
    assert found["safari-modulate"]["modulate"] is True
    assert found["safari-modulate"]["config"].endswith("safari-modulate/config.json")
    assert found["safari-eval-yaml"]["modulate"] is False
    assert found["safari-eval-yaml"]["config"].endswith("hyena_tiny.yaml")
    lightning = found["safari-lightning"]
    assert "hyper_parameters" in lightning["config"]
    assert lightning["normalized"] is True and lightning["layer_norm_epsilon"] == 1e-3
    assert "layer.local_order" in found["safari-eval-yaml"]["accepted_without_effect"]
    # without a config, safari's default: modulation on
    bare = tmp_path / "bare.pt"
    shutil.copy(UPSTREAM / "safari-eval-yaml" / "model.pt", bare)
    settings = load_model(f"safari:{bare}").settings
    assert settings["modulate"] is True and settings["config"].startswith("safari's defaults")


def load_case_settings(case: str) -> dict:
    data = json.loads((UPSTREAM / case / "expected.json").read_text())
    return load_model(f"safari:{UPSTREAM / case / data['spec'].split(':', 1)[1]}").settings


def test_safari_hydra_run_directory_config_is_found(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    shutil.copy(UPSTREAM / "safari-no-modulate" / "model.pt", run / "checkpoints" / "last.ckpt")
    shutil.copy(
        UPSTREAM / "safari-no-modulate" / "configs" / "hyena-tiny.yaml",
        run / ".hydra" / "config.yaml",
    )
    settings = load_model(f"safari:{run / 'checkpoints' / 'last.ckpt'}").settings
    assert settings["modulate"] is False and settings["bias"] is False
    assert settings["config"].endswith(".hydra/config.yaml")


def test_the_published_hyena_small_is_recognised_by_hub_id_or_shapes(tmp_path):
    from models.checkpoints.safari import load_safari, published_shapes, shapes_of

    # its exact shapes, as meta tensors: nothing is allocated
    p = published_shapes()
    d, layer = p["d_model"], "backbone.layers.{}.sequence_mixer."
    state = {
        "backbone.embeddings.word_embeddings.weight": torch.empty(p["vocab_rows"], d, device="meta")
    }
    for i in range(p["n_layer"]):
        state[layer.format(i) + "in_proj.weight"] = torch.empty(3 * d, d, device="meta")
        state[layer.format(i) + "short_filter.weight"] = torch.empty(3 * d, 1, 3, device="meta")
        state[layer.format(i) + "filter_fn.pos_emb.z"] = torch.empty(1, 2048, 33, device="meta")
        for j in (0, 2, 4, 6):
            state[layer.format(i) + f"filter_fn.implicit_filter.{j}.weight"] = torch.empty(64, 1)
        state[f"backbone.layers.{i}.state_mixer.fc1.weight"] = torch.empty(2 * d, d, device="meta")
    assert shapes_of(state, "x") == p
    # by its hub id (here in a hub cache path): its evaluation config, modulate False
    cached = tmp_path / "models--Zymrael--hyena-small-150b-tok" / "snapshots" / "abc"
    cached.mkdir(parents=True)
    shutil.copy(UPSTREAM / "safari-modulate" / "model.pt", cached / "model.pt")
    with pytest.raises(ArSliceError, match="d_model is 864 but the weights have 16"):
        load_safari(cached / "model.pt")  # the published config, checked against these weights


@pytest.mark.parametrize(
    "edit, words",
    [
        ({"activation": "gelu"}, "layer.activation='gelu' is not implemented"),
        ({"outer_mixing": True}, "layer.outer_mixing=True is not implemented"),
        ({"filter_ordr": 8}, "layer.filter_ordr is not an option this project implements"),
        ({"filter_order": 32}, "layer.filter_order is 32 but the weights have 64"),
        ({"modulate": "${model.flag}"}, "layer.modulate is an unresolved interpolation"),
    ],
)
def test_safari_options_it_does_not_implement_are_refused_by_name(tmp_path, edit, words):
    ckpt = copy_case("safari-modulate", tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["layer"].update(edit)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArSliceError, match=words.replace("$", r"\$").replace("{", r"\{")):
        load_model(f"safari:{ckpt / 'model.pt'}")


def test_safari_config_that_is_not_an_object_is_one_clear_line(tmp_path):
    ckpt = copy_case("safari-modulate", tmp_path / "c")
    for text, words in (("[1, 2]", "expected a mapping"), ("{not json", "not valid JSON")):
        (ckpt / "config.json").write_text(text)
        with pytest.raises(ArSliceError, match=f"config.json: {words}"):
            load_model(f"safari:{ckpt / 'model.pt'}")
    (ckpt / "config.json").write_text(json.dumps({"modulate": False}))
    with pytest.raises(ArSliceError, match="not a safari config"):
        load_model(f"safari:{ckpt / 'model.pt'}")


def test_safari_tokenizer_beside_the_weights_is_fingerprinted(tmp_path, bpe_tokenizer_path):
    from ar_slicing.data.tokenizer import fingerprint, load_tokenizer

    ckpt = copy_case("safari-modulate", tmp_path / "c")
    shutil.copy(bpe_tokenizer_path, ckpt / "tokenizer.json")
    loaded = load_model(f"safari:{ckpt}")  # a directory holding one weights file
    assert loaded.architecture == "hyena" and loaded.max_positions == 64
    assert loaded.tokenizer_fingerprint == fingerprint(load_tokenizer(bpe_tokenizer_path))


def test_safari_gate_order_is_swapped_on_the_way_in():
    """Read in Zoology's order without the swap, the same weights give other logits."""
    from models.backbone import LanguageModel
    from models.checkpoints.safari import rename_safari_keys

    loaded = load_model(f"safari:{UPSTREAM / 'safari-modulate' / 'model.pt'}")
    unswapped = LanguageModel(loaded.model.config).eval()
    raw = torch.load(UPSTREAM / "safari-modulate" / "model.pt", weights_only=True)
    unswapped.load_state_dict(rename_safari_keys(raw), strict=False)
    ids = torch.randint(0, 50, (1, 24))
    with torch.no_grad():
        assert (loaded.model(ids) - unswapped(ids)).abs().max() > 1e-2


def test_safari_state_dict_without_recomputable_buffers(tmp_path):
    raw = torch.load(UPSTREAM / "safari-modulate" / "model.pt", weights_only=True)
    state = {k: v for k, v in raw.items() if not k.endswith(("pos_emb.t", "modulation.deltas"))}
    torch.save(state, tmp_path / "hyena.pt")
    assert load_model(f"safari:{tmp_path / 'hyena.pt'}").architecture == "hyena"


def safari_error(loaded, case: str) -> float:
    """Largest |Δ nll| against the fixture `case` as it loads from its own layout (which
    test_upstream_fixtures holds to safari's losses), in this process: the same weights in another
    layout must give the same losses under the same kernels."""
    from tests.models.upstream_losses import expected, load_case, max_nll_error

    windows = expected(case)["windows"]
    reference = load_case(case)
    for window in windows:
        inputs, targets = torch.tensor([window["inputs"]]), torch.tensor([window["targets"]])
        window["nll"] = per_token_nll(reference, inputs, targets)[0].tolist()
    return max_nll_error(loaded, windows)


def test_safari_legacy_key_names_are_mapped_as_safari_maps_them(tmp_path):
    """ConvLMHeadModel.load_state_dict renames `.mixer.output_linear.` (and `s4seq.encoder.`,
    `embedding.`) before loading; the same weights under those names give safari's losses."""
    raw = torch.load(UPSTREAM / "safari-modulate" / "model.pt", weights_only=True)
    legacy = {}
    for key, value in raw.items():
        key = key.replace(".mixer.out_proj.", ".mixer.output_linear.")
        key = key.replace("backbone.embeddings.word_embeddings.", "embedding.")
        legacy[key.replace("backbone.", "s4seq.encoder.", 1)] = value
    assert any(".mixer.output_linear." in k for k in legacy) and "embedding.weight" in legacy
    ckpt = copy_case("safari-modulate", tmp_path / "c")
    torch.save(legacy, ckpt / "model.pt")
    assert safari_error(load_model(f"safari:{ckpt / 'model.pt'}"), "safari-modulate") <= 1e-4
    legacy["s4seq.encoder.norm.weight"] = torch.ones(16)  # the post-norm order: not implemented
    torch.save(legacy, ckpt / "model.pt")
    with pytest.raises(
        ArSliceError, match="model.pt: backbone.norm.weight: safari's legacy post-norm"
    ):
        load_model(f"safari:{ckpt / 'model.pt'}")


def test_safari_mlp_width_need_not_be_a_multiple_of_d_model(tmp_path):
    """d_inner 100 with d_model 16: safari's Mlp takes any width. The fixture's 32 hidden units
    plus 68 whose output weights are zero compute safari's function with fc1 (100, 16)."""
    raw = torch.load(UPSTREAM / "safari-modulate" / "model.pt", weights_only=True)
    gen = torch.Generator().manual_seed(0)
    for i in (0, 1):
        mlp = f"backbone.layers.{i}.mlp."
        raw[mlp + "fc1.weight"] = torch.cat(
            [raw[mlp + "fc1.weight"], torch.randn(68, 16, generator=gen)]
        )
        raw[mlp + "fc1.bias"] = torch.cat([raw[mlp + "fc1.bias"], torch.randn(68, generator=gen)])
        raw[mlp + "fc2.weight"] = torch.cat([raw[mlp + "fc2.weight"], torch.zeros(16, 68)], dim=1)
    ckpt = copy_case("safari-modulate", tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["d_inner"] = 100
    (ckpt / "config.json").write_text(json.dumps(config))
    torch.save(raw, ckpt / "model.pt")
    loaded = load_model(f"safari:{ckpt / 'model.pt'}")
    assert loaded.model.backbone.layers[0].state_mixer.fc1.weight.shape == (100, 16)
    assert safari_error(loaded, "safari-modulate") <= 1e-4


@pytest.mark.parametrize("activation", ["identity", "linear", None])
def test_safari_identity_activations_are_accepted(tmp_path, activation):
    """safari's Activation() is nn.Identity for None, 'id', 'identity' and 'linear' alike."""
    ckpt = copy_case("safari-modulate", tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["layer"]["activation"] = activation
    (ckpt / "config.json").write_text(json.dumps(config))
    assert safari_error(load_model(f"safari:{ckpt / 'model.pt'}"), "safari-modulate") <= 1e-4


def test_safari_hydra_config_with_a_resolver_cache_says_how_to_load_it(tmp_path):
    """safari's train.py resolves `${eval:...}`: a DictConfig pickled after a caching resolver ran
    carries omegaconf's filled resolver cache, which no weights-only load rebuilds. The message
    says so, and what it suggests loads."""
    import inspect

    import yaml
    from omegaconf import OmegaConf

    from models.checkpoints.io import safe_torch_load

    ckpt = safe_torch_load(UPSTREAM / "safari-lightning" / "checkpoints" / "last.ckpt")
    name = "arslice_test_eval"
    if not OmegaConf.has_resolver(name):  # safari's train.py calls register_new_resolver,
        # which omegaconf 2.4 renamed; the cache is the same
        register = getattr(OmegaConf, "register_resolver", OmegaConf.register_new_resolver)
        if "use_cache" not in inspect.signature(register).parameters:
            register = OmegaConf.register_new_resolver
        register(name, eval, use_cache=True)
    hparams = OmegaConf.create(OmegaConf.to_container(ckpt["hyper_parameters"]))
    hparams.tokens_per_step = "${" + name + ":2 * ${model.d_model}}"
    assert hparams.tokens_per_step == 32  # resolved once: now in the resolver cache
    assert hparams._metadata.resolver_cache
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({**ckpt, "hyper_parameters": hparams}, run / "checkpoints" / "last.ckpt")
    with pytest.raises(ArSliceError) as err:
        load_model(f"safari:{run / 'checkpoints' / 'last.ckpt'}")
    msg = str(err.value)
    assert msg.startswith(f"{run / 'checkpoints' / 'last.ckpt'}: refused: its hydra config")
    assert "resolver cache" in msg and "--model-config" in msg and "\n" not in msg
    # what it suggests: the weights alone, the run's config given
    full = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    torch.save(full["state_dict"], tmp_path / "model.pt")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump(OmegaConf.to_container(hparams, resolve=True))
    )
    loaded = load_model(
        f"safari:{tmp_path / 'model.pt'}", model_config=run / ".hydra" / "config.yaml"
    )
    assert safari_error(loaded, "safari-lightning") <= 1e-4


def test_safari_bad_inputs(tmp_path):
    with pytest.raises(ArSliceError, match="checkpoint file not found"):
        load_model(f"safari:{tmp_path / 'missing.pt'}")
    torch.save({"backbone.ln_f.weight": torch.ones(4)}, tmp_path / "other.pt")
    with pytest.raises(ArSliceError, match="not a safari Hyena LM state dict"):
        load_model(f"safari:{tmp_path / 'other.pt'}")
    state = torch.load(UPSTREAM / "safari-modulate" / "model.pt", weights_only=True)
    state["backbone.layers.1.mixer.out_proj.weight"] = torch.zeros(16, 15)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(
        ArSliceError,
        match=r"sequence_mixer.out_proj.weight \(checkpoint \(16, 15\), model \(16, 16\)\)",
    ):
        load_model(f"safari:{tmp_path / 'bad.pt'}")
    with pytest.raises(
        ArSliceError, match="applies to zoology:, safari:, based:, h3: and retnet: checkpoints only"
    ):
        load_model(f"native:{tmp_path}", model_config=tmp_path / "x.yaml")
