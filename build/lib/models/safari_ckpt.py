"""`safari:<checkpoint>`: a HazyResearch/safari Hyena LM raw state dict (e.g. Hyena-153M) -> models.backbone.

safari's `ConvLMHeadModel` names its blocks `backbone.layers.{i}.mixer.*` and `.mlp.fc1/fc2`
(flash-attn `Block`, tanh-GELU `Mlp`); this project (and Zoology) use `sequence_mixer` and
`state_mixer`. safari's `HyenaOperator` splits the short-filtered `in_proj` output into
`(x0, x1, v)` and computes `x0 ⊙ h * (x1 ⊙ v)`: the *second* third gates before the long
convolution and the *first* after it. Zoology's `Hyena` (models/hyena.py) splits into `(x1, x2, v)`
and computes `x2 ⊙ h * (x1 ⊙ v)`: the first third gates before. So the first two d-row blocks of
`in_proj` and `short_filter` are swapped on the way in.

The architecture (width, depth, vocabulary, filter length and MLP sizes) is read from the tensor
shapes; an optional `config.json` beside the checkpoint may set filter options that leave no trace
in the weights ("shift", "modulate", "normalized") and "layer_norm_epsilon".
"""

from __future__ import annotations

import re
from pathlib import Path

from ar_slicing.errors import ArSliceError

# keys safari's filter may omit (recomputed deterministically from l_max / d_model)
_RECOMPUTED = ("filter_fn.pos_emb.t", "filter_fn.modulation.deltas")
_OPTIONS = ("shift", "modulate", "normalized")


def rename_safari_keys(state: dict) -> dict:
    """safari block names -> Zoology's: `.mixer.` -> `.sequence_mixer.`, `.mlp.` -> `.state_mixer.`."""
    out = {}
    for key, value in state.items():
        key = re.sub(r"^(backbone\.layers\.\d+)\.mixer\.", r"\1.sequence_mixer.", key)
        key = re.sub(r"^(backbone\.layers\.\d+)\.mlp\.", r"\1.state_mixer.", key)
        out[key] = value
    return out


def swap_gate_blocks(tensor, d_model: int):
    """Exchange rows [0, d) and [d, 2d) of an in_proj / short_filter tensor (first dim 3d)."""
    import torch

    return torch.cat(
        [tensor[d_model : 2 * d_model], tensor[:d_model], tensor[2 * d_model :]], dim=0
    )


def config_from_state(state: dict, source: str, options: dict):
    """Infer this project's ModelConfig from a (renamed) safari Hyena state dict."""
    from models.backbone import ModelConfig

    def shape(key):
        if key not in state:
            raise ArSliceError(f"{source}: not a safari Hyena LM state dict (no {key})")
        return tuple(state[key].shape)

    vocab, d_model = shape("backbone.embeddings.word_embeddings.weight")
    layers = sorted(
        {int(m.group(1)) for k in state if (m := re.match(r"backbone\.layers\.(\d+)\.", k))}
    )
    if not layers:
        raise ArSliceError(f"{source}: no backbone.layers.* keys")
    attention_layers = [
        i for i in layers if f"backbone.layers.{i}.sequence_mixer.Wqkv.weight" in state
    ]
    if attention_layers:
        raise ArSliceError(
            f"{source}: layers {attention_layers} are attention (hybrid safari models are not supported)"
        )
    prefix = "backbone.layers.0.sequence_mixer."
    in_rows = shape(prefix + "in_proj.weight")[0]
    if in_rows != 3 * d_model:
        raise ArSliceError(
            f"{source}: in_proj has {in_rows} rows for d_model {d_model}; only order-2 Hyena "
            f"(3 x d_model) is supported"
        )
    short_order = shape(prefix + "short_filter.weight")[-1]
    _, l_max, emb_dim = shape(prefix + "filter_fn.pos_emb.z")
    filter_order = shape(prefix + "filter_fn.implicit_filter.0.weight")[0]
    linears = [
        k for k in state
        if k.startswith(prefix + "filter_fn.implicit_filter.") and k.endswith(".weight")
    ]  # fmt: skip
    hidden = shape("backbone.layers.0.state_mixer.fc1.weight")[0]
    if hidden % d_model:
        raise ArSliceError(f"{source}: MLP width {hidden} is not a multiple of d_model {d_model}")
    positions = state.get("backbone.embeddings.position_embeddings.weight")
    filter_kwargs = {k: options[k] for k in _OPTIONS if k in options}
    return ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=len(layers),
        sequence_mixer="hyena",
        sequence_mixer_kwargs={
            "filter_order": filter_order,
            "short_filter_order": short_order,
            "emb_dim": emb_dim,
            "num_inner_mlps": len(linears) - 2,
            **filter_kwargs,
        },
        state_mixer="mlp",
        state_mixer_kwargs={"hidden_mult": hidden // d_model, "activation": "gelu_tanh"},
        l_max=l_max,
        max_position_embeddings=0 if positions is None else int(positions.shape[0]),
        layer_norm_epsilon=float(options.get("layer_norm_epsilon", 1e-5)),
    )


def convert_safari_state(state: dict, d_model: int) -> dict:
    """Rename safari keys and reorder the Hyena projections to Zoology's gating order."""
    state = rename_safari_keys(state)
    for key in list(state):
        if re.search(r"\.sequence_mixer\.(in_proj|short_filter)\.(weight|bias)$", key):
            state[key] = swap_gate_blocks(state[key], d_model)
    return state


def load_safari(target: str | Path):
    """(LanguageModel with the safari checkpoint's weights, directory to look for a tokenizer in)."""
    from ar_slicing.io import read_json
    from models.backbone import LanguageModel
    from models.checkpoint_io import load_state_dict_checked, read_weights

    path = Path(target)
    if path.is_dir():
        raise ArSliceError(
            f"{path}: is a directory; safari:<file> names the state-dict file itself"
        )
    raw = read_weights(path)
    options = (
        read_json(path.parent / "config.json") if (path.parent / "config.json").is_file() else {}
    )
    d_model = (
        raw["backbone.embeddings.word_embeddings.weight"].shape[1]
        if ("backbone.embeddings.word_embeddings.weight" in raw)
        else 0
    )
    state = convert_safari_state(raw, d_model)
    config = config_from_state(state, str(path), options)
    model = LanguageModel(config)
    may_be_missing = ["lm_head.weight"] + [
        f"backbone.layers.{i}.sequence_mixer.{k}"
        for i in range(config.n_layers)
        for k in _RECOMPUTED
    ]
    load_state_dict_checked(model, state, source=str(path), tied=may_be_missing)
    return model, path.parent
