"""`zoology:<checkpoint>`: a Zoology LM state dict plus its `ModelConfig`, loaded into models.backbone.

The checkpoint is a weights file (`.pt`/`.pth`/`.bin`/`.ckpt` read with weights_only=True, or
`.safetensors`) or a directory holding one: a bare state dict, `{"model", "optimizer", "config"}`,
Lightning's `{"state_dict": {"model.*"}}`, or `torch.compile`'s `_orig_mod.` keys. The config is
Zoology's `ModelConfig` as a dict — `{"d_model", "n_layers", "vocab_size",
"max_position_embeddings", "sequence_mixer": {"name": "zoology.mixers.hyena.Hyena", "kwargs":
{...}}, "state_mixer": {...}, ...}`, or a whole `TrainConfig` with it under "model" — taken from a
"config" entry inside the checkpoint, else from `config.json` / `config.yaml` beside it.

What Zoology computes, and this loader with it (checked against checkpoints Zoology's own code
made, tests/fixtures/upstream):
  * attention (`MHA`), `BaseConv` (short, explicit long, and both implicit filters: Zoology's
    current Linear-ReLU-Linear one and, told apart by its keys, the Hyena-style one it had before
    2023-10-29), `Hyena` (one head), RWKV-4 (`RWKVTimeMixer` / `RWKVStateMixer`), `h3.H3` (its
    kernels cut at the l_max it is given, as Zoology's are), `convolution.LongConvolution` and
    `ImplicitLongConvolution` on their own (the Long Conv row), and `hybrid.Hybrid` (layer i runs
    its `configs[i % len(configs)]`: the hybrid rows); `MLP`, `GLU`,
    `torch.nn.Identity` state mixers; learned positions; padded vocabularies; untied heads
    (`learnable_word_embeddings: false`).
  * `layer_norm_epsilon` is used for `ln_f` alone: Zoology's blocks build norm1/norm2 with
    LayerNorm's default 1e-5.
  * RWKV: Zoology's `zoology/mixers/rwkv.py` sets `RWKV_FLOAT_MODE=bf16` when imported, so its
    CUDA kernel rounds the WKV output to bf16: Zoology's own losses are those of a bf16 WKV.
    This project computes the WKV exactly in fp32, which is what Zoology computes in its fp32
    mode; no CPU fixture pins it (the kernel needs CUDA).
  * Options that change nothing in an evaluation forward (learning rates, dropout, switches the
    upstream forward ignores) are accepted; any other option this project does not implement is
    refused by name, never ignored.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from models.checkpoints.registry import (
    LoadedModel,
    LoadRequest,
    loaded_language_model,
    register_loader,
)

log = logging.getLogger(__name__)

CONFIG_NAMES = ("config.json", "config.yaml", "config.yml")
# The last component of Zoology's import path -> this project's mixer names.
SEQUENCE_MIXER_NAMES = {
    "MHA": "attention", "SelfAttention": "attention", "BaseConv": "base_conv",
    "Hyena": "hyena", "RWKVTimeMixer": "rwkv", "H3": "h3", "LongConvolution": "long_conv",
    "ImplicitLongConvolution": "implicit_long_conv",
}  # fmt: skip
# Zoology's `hybrid.Hybrid`: layer i runs `configs[i % len(configs)]`, under `sequence_mixer.mixer`
HYBRID = "Hybrid"
STATE_MIXER_NAMES = {"MLP": "mlp", "GLU": "glu", "RWKVStateMixer": "rwkv", "Identity": "identity"}
# Zoology ModelConfig defaults (zoology/config.py) for keys a saved config may omit.
ZOOLOGY_DEFAULTS = {
    "d_model": 128, "n_layers": 2, "max_position_embeddings": 64, "vocab_size": 8192,
    "layer_norm_epsilon": 1e-5, "pad_vocab_size_multiple": 1, "learnable_word_embeddings": True,
    "block_type": "TransformerBlock",
}  # fmt: skip
# Zoology ModelConfig fields that do not change an evaluation forward (dropout, initialisation).
_MODEL_NO_EFFECT = {"resid_dropout", "embed_dropout", "drop_path", "embedding_init_type", "name"}
# Mixer options with no effect on an evaluation forward: training hyper-parameters, the
# initialisation's depth, and settings Zoology's own forward never reads (Hyena's outer_mixing).
_MIXER_NO_EFFECT = {
    "hyena": {"lr", "lr_pos_emb", "wd", "modulation_lr", "return_state", "channels", "outer_mixing"},
    "rwkv": {"n_layer"},
    "mlp": set(), "glu": set(), "identity": set(), "attention": set(), "base_conv": set(),
    # H3: its dropout is never applied; the fast FFT convolution is a CUDA kernel of the same function
    "h3": {"dropout", "use_fast_fftconv", "device", "dtype"},
    "long_conv": set(), "implicit_long_conv": set(),
}  # fmt: skip
# H3's kernel_args (upstream's SSKernel): options that only initialise, and those with one value here
_H3_KERNEL_NO_EFFECT = {"measure", "dt_min", "dt_max", "lr", "deterministic", "rank", "verbose",
                        "measure_args"}  # fmt: skip
_H3_KERNEL_MUST_BE = {"mode": "diag", "real_type": "exp", "bandlimit": None, "force_real": False,
                      "n_ssm": None, "channels": 1}  # fmt: skip
# Zoology options that only their default value leaves without effect.
_MIXER_MUST_BE = {
    "hyena": {"bidirectional": False, "linear_mixer": False},
    "mlp": {"return_residual": False}, "glu": {"return_residual": False},
}  # fmt: skip


def find_files(target: str | Path) -> tuple[Path, Path | None]:
    """(weights file, config file or None) for a checkpoint path or directory."""
    from models.checkpoints.io import find_weights_file

    weights_file = find_weights_file(Path(target), "zoology")
    folder = weights_file.parent
    configs = [
        folder / n for n in (f"{weights_file.stem}.json", *CONFIG_NAMES) if (folder / n).is_file()
    ]
    return weights_file, (configs[0] if configs else None)


def _mixer_name(spec: Any, table: dict[str, str], what: str, source: str) -> tuple[str, dict]:
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ArSliceError(
            f"{source}: {what} must be {{'name': 'zoology.mixers....', 'kwargs': {{...}}}}"
        )
    short = str(spec["name"]).rsplit(".", 1)[-1]
    if short not in table:
        raise ArSliceError(
            f"{source}: {what} {spec['name']!r} is not supported; supported: {', '.join(sorted(table))}"
        )
    return table[short], dict(spec.get("kwargs") or {})


def _mixer_options(name: str, kwargs: dict, what: str, source: str) -> dict:
    """Zoology's kwargs for mixer `name` as this project's options: no-effect keys dropped, keys
    that need a value this project implements checked; the rest go to the typed options."""
    options = {}
    for key, value in kwargs.items():
        if key in _MIXER_NO_EFFECT[name]:
            continue
        if key in _MIXER_MUST_BE.get(name, {}):
            if value != _MIXER_MUST_BE[name][key]:
                raise ArSliceError(
                    f"{source}: {what} option {key}={value!r} is not implemented "
                    f"(only {_MIXER_MUST_BE[name][key]!r})"
                )
            continue
        options[key] = value
    if name == "h3":
        for key, value in (options.pop("kernel_args", None) or {}).items():
            if key == "disc":
                options["disc"] = value
            elif key in _H3_KERNEL_MUST_BE and value != _H3_KERNEL_MUST_BE[key]:
                raise ArSliceError(
                    f"{source}: {what} kernel_args.{key}={value!r} is not implemented "
                    f"(only {_H3_KERNEL_MUST_BE[key]!r})"
                )
            elif key not in _H3_KERNEL_NO_EFFECT | set(_H3_KERNEL_MUST_BE):
                known = sorted({"disc", *_H3_KERNEL_NO_EFFECT, *_H3_KERNEL_MUST_BE})
                raise ArSliceError(
                    f"{source}: {what} kernel_args.{key} is not an option this project "
                    f"implements; it knows: {', '.join(known)}"
                )
    if name in ("mlp", "glu"):
        options.setdefault("hidden_mult", 1)  # Zoology's MLP default (this project's is 4)
    return options


def is_hybrid(spec: Any) -> bool:
    name = spec if isinstance(spec, str) else (spec or {}).get("name", "")
    return str(name).rsplit(".", 1)[-1] == HYBRID


def _layer_mixer_specs(spec: Any, n_layers: int, source: str) -> list[tuple[Any, str]]:
    """(Zoology mixer spec, where it is named) of every layer: the one sequence mixer, or a
    Hybrid's `configs[i % len(configs)]`."""
    if not is_hybrid(spec):
        return [(spec, "sequence_mixer")] * n_layers
    given = dict(spec.get("kwargs") or {}) if isinstance(spec, dict) else {}
    configs = given.get("configs")
    if not isinstance(configs, list) or not configs or set(given) != {"configs"}:
        raise ArSliceError(
            f"{source}: a Hybrid sequence_mixer takes one kwarg, 'configs', a list of mixer "
            f"configs (one per layer, cycled); found {sorted(given)}"
        )
    return [
        (configs[i % len(configs)], f"sequence_mixer.configs[{i % len(configs)}]")
        for i in range(n_layers)
    ]


def unwrap_hybrid(state: dict) -> dict:
    """A Hybrid's keys `layers.N.sequence_mixer.mixer.*` as its mixer's own, `sequence_mixer.*`."""
    return {
        re.sub(r"(\.layers\.\d+\.sequence_mixer)\.mixer\.", r"\1.", k): v for k, v in state.items()
    }


def state_layout(state: dict) -> dict[str, Any]:
    """What only the keys tell: BaseConv's implicit filter ("mlp" now, "hyena" before
    2023-10-29) and whether each block's state mixer is a copy of its sequence mixer (the
    Zoology of 2023-10-28 .. 2023-11-20)."""
    layout: dict[str, Any] = {}
    if any(".sequence_mixer.conv.implicit_filter." in k for k in state):
        layout["implicit_filter"] = "hyena"
    elif any(".sequence_mixer.conv.mlp." in k for k in state):
        layout["implicit_filter"] = "mlp"
    prefix = "backbone.layers.0."
    seq = {
        k[len(prefix + "sequence_mixer.") :]
        for k in state
        if k.startswith(prefix + "sequence_mixer.")
    }
    st = {k[len(prefix + "state_mixer.") :] for k in state if k.startswith(prefix + "state_mixer.")}
    layout["state_is_sequence_copy"] = bool(seq) and seq == st
    return layout


def model_config_from_zoology(data: dict, source: str, layout: dict | None = None):
    """Translate a Zoology ModelConfig dict into this project's ModelConfig."""
    from models.backbone import ModelConfig

    layout = layout or {}
    if "model" in data and isinstance(data["model"], dict):  # a whole TrainConfig
        data = data["model"]
    if "sequence_mixer" not in data:
        raise ArSliceError(
            f"{source}: no 'sequence_mixer' in the config; is this a Zoology ModelConfig?"
        )
    known = set(ZOOLOGY_DEFAULTS) | _MODEL_NO_EFFECT | {"sequence_mixer", "state_mixer"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ArSliceError(
            f"{source}: unknown Zoology ModelConfig field(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(known))}"
        )
    cfg = {**ZOOLOGY_DEFAULTS, **data}
    if cfg["block_type"] != "TransformerBlock":
        raise ArSliceError(f"{source}: block_type {cfg['block_type']!r} is not supported")
    n_layers = int(cfg["n_layers"])
    per_layer, l_maxes = [], set()
    for spec, what in _layer_mixer_specs(cfg["sequence_mixer"], n_layers, source):
        name, zoology_kwargs = _mixer_name(spec, SEQUENCE_MIXER_NAMES, what, source)
        given = zoology_kwargs.pop("l_max", None)
        if given:
            l_maxes.add(int(given))
        for key in ("layer_idx", "d_model"):
            zoology_kwargs.pop(key, None)
        options = _mixer_options(name, zoology_kwargs, what, source)
        if name == "h3" and given:
            options["truncate_kernel"] = True  # Zoology's H3 cuts its kernels at l_max
        per_layer.append((name, options))
    if len(l_maxes) > 1:
        raise ArSliceError(f"{source}: the hybrid's mixers name different l_max {sorted(l_maxes)}")
    l_max = next(iter(l_maxes), None) or cfg["max_position_embeddings"] or 2048
    mixer, mixer_kwargs = per_layer[0]
    layer_mixers = [
        {"layers": [i], "name": name, "kwargs": options}
        for i, (name, options) in enumerate(per_layer)
        if (name, options) != (mixer, mixer_kwargs)
    ]
    if mixer == "base_conv" and "implicit_filter" in layout:
        mixer_kwargs["implicit_filter"] = layout["implicit_filter"]
    if layout.get("state_is_sequence_copy") and mixer == "base_conv":
        log.info(
            "%s: each block's state mixer is a second BaseConv (Zoology of 2023-10-28 .. "
            "2023-11-20 built it from the sequence-mixer config, whatever state_mixer said)",
            source,
        )
        state, state_kwargs = mixer, dict(mixer_kwargs)
    else:
        state_spec = cfg.get("state_mixer") or {
            "name": "zoology.mixers.mlp.MLP",
            "kwargs": {"hidden_mult": 4},
        }
        state, state_kwargs = _mixer_name(state_spec, STATE_MIXER_NAMES, "state_mixer", source)
        state_kwargs = _mixer_options(state, state_kwargs, "state_mixer", source)
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=int(cfg["d_model"]),
            n_layers=n_layers,
            sequence_mixer=mixer,
            sequence_mixer_kwargs=mixer_kwargs,
            state_mixer=state,
            state_mixer_kwargs=state_kwargs,
            l_max=int(l_max),
            max_position_embeddings=int(cfg["max_position_embeddings"] or 0),
            layer_norm_epsilon=float(cfg["layer_norm_epsilon"]),
            block_norm_epsilon=1e-5,  # Zoology's TransformerBlock: nn.LayerNorm(d_model)
            tie_word_embeddings=bool(cfg["learnable_word_embeddings"]),
            pad_vocab_size_multiple=int(cfg["pad_vocab_size_multiple"]),
            layer_mixers=layer_mixers,
        )
    except ArSliceError as e:
        raise ArSliceError(f"{source}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: invalid model config ({e})") from None


def load_zoology(target: str | Path, model_config: str | Path | None = None):
    """(LanguageModel with the checkpoint's weights, directory to look for a tokenizer in, the
    settings used). `model_config`: a config file to use instead of the one found."""
    from models.backbone import LanguageModel
    from models.checkpoints.io import (
        load_state_dict_checked,
        read_checkpoint,
        read_config_file,
        state_dict_from,
    )

    weights_file, config_file = find_files(target)
    obj = read_checkpoint(weights_file)
    embedded = obj.get("config") if isinstance(obj, dict) else None
    if model_config is not None:
        data, source = read_config_file(Path(model_config)), f"{model_config} (--model-config)"
    elif isinstance(embedded, dict):
        data, source = embedded, f"{weights_file} (embedded config)"
    elif config_file is not None:
        data, source = read_config_file(config_file), str(config_file)
    else:
        raise ArSliceError(
            f"{weights_file}: no model config found (no 'config' entry in the checkpoint and no "
            f"{' / '.join(CONFIG_NAMES)} beside it); save Zoology's ModelConfig there as JSON"
        )
    state = state_dict_from(obj, weights_file)
    if is_hybrid(
        (data.get("model") if isinstance(data.get("model"), dict) else data).get("sequence_mixer")
    ):
        state = unwrap_hybrid(state)
    layout = state_layout(state)
    config = model_config_from_zoology(data, source, layout)
    try:
        model = LanguageModel(config)
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: cannot build the model ({e})") from None
    tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
    load_state_dict_checked(model, state, source=str(weights_file), tied=tied)
    return model, weights_file.parent, {"config": source, **layout}


@register_loader("zoology", order=2, model_config=True, local=("file", "dir"))
def load_spec(request: LoadRequest) -> LoadedModel:
    model, tokenizer_dir, settings = load_zoology(request.target, request.model_config)
    return loaded_language_model(model, request, tokenizer_dir, settings)
