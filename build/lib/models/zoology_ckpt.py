"""`zoology:<checkpoint>`: a Zoology LM state dict plus its `ModelConfig`, loaded into models.backbone.

The checkpoint is a weights file (`.pt`/`.pth`/`.bin`/`.ckpt` read with weights_only=True, or
`.safetensors`) or a directory holding one. The config is Zoology's `ModelConfig` as a dict —
`{"d_model", "n_layers", "vocab_size", "max_position_embeddings", "sequence_mixer": {"name":
"zoology.mixers.hyena.Hyena", "kwargs": {...}}, "state_mixer": {...}, ...}`, or a whole
`TrainConfig` with it under "model" — taken from a "config" entry inside the checkpoint, else from
`config.json` / `config.yaml` beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

CONFIG_NAMES = ("config.json", "config.yaml", "config.yml")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
# The last component of Zoology's import path -> this project's mixer names.
SEQUENCE_MIXER_NAMES = {
    "MHA": "attention", "SelfAttention": "attention", "BaseConv": "base_conv",
    "Hyena": "hyena", "RWKVTimeMixer": "rwkv",
}  # fmt: skip
STATE_MIXER_NAMES = {"MLP": "mlp", "GLU": "glu", "RWKVStateMixer": "rwkv", "Identity": "identity"}
# Zoology ModelConfig defaults (zoology/config.py) for keys a saved config may omit.
ZOOLOGY_DEFAULTS = {
    "d_model": 128, "n_layers": 2, "max_position_embeddings": 64, "vocab_size": 8192,
    "layer_norm_epsilon": 1e-5, "pad_vocab_size_multiple": 1,
}  # fmt: skip


def find_files(target: str | Path) -> tuple[Path, Path | None]:
    """(weights file, config file or None) for a checkpoint path or directory."""
    path = Path(target)
    if path.is_dir():
        weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        if not weights:
            raise ArSliceError(
                f"{path}: no weights file ({', '.join(WEIGHT_SUFFIXES)}) in this directory"
            )
        if len(weights) > 1:
            raise ArSliceError(
                f"{path}: several weights files ({', '.join(p.name for p in weights)}); "
                "name the one to load: zoology:<dir>/<file>"
            )
        weights_file, folder = weights[0], path
    elif path.is_file():
        weights_file, folder = path, path.parent
    else:
        raise ArSliceError(f"{path}: no such checkpoint file or directory")
    configs = [
        folder / n for n in (f"{weights_file.stem}.json", *CONFIG_NAMES) if (folder / n).is_file()
    ]
    return weights_file, (configs[0] if configs else None)


def read_config_file(path: Path) -> dict:
    if path.suffix == ".json":
        from ar_slicing.io import read_json

        return read_json(path)
    try:
        import yaml
    except ImportError:
        raise ArSliceError(
            f"{path}: reading YAML needs PyYAML (pip install pyyaml), or save it as JSON"
        ) from None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ArSliceError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ArSliceError(f"{path}: expected a mapping of config fields")
    return data


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


def model_config_from_zoology(data: dict, source: str):
    """Translate a Zoology ModelConfig dict into this project's ModelConfig."""
    from models.backbone import ModelConfig

    if "model" in data and isinstance(data["model"], dict):  # a whole TrainConfig
        data = data["model"]
    if "sequence_mixer" not in data:
        raise ArSliceError(
            f"{source}: no 'sequence_mixer' in the config; is this a Zoology ModelConfig?"
        )
    cfg = {**ZOOLOGY_DEFAULTS, **data}
    mixer, mixer_kwargs = _mixer_name(
        cfg["sequence_mixer"], SEQUENCE_MIXER_NAMES, "sequence_mixer", source
    )
    state_spec = cfg.get("state_mixer") or {
        "name": "zoology.mixers.mlp.MLP",
        "kwargs": {"hidden_mult": 4},
    }
    state, state_kwargs = _mixer_name(state_spec, STATE_MIXER_NAMES, "state_mixer", source)
    if state in ("mlp", "glu"):
        state_kwargs = {
            "hidden_mult": int(state_kwargs.get("hidden_mult", 1))
        }  # Zoology's default is 1
    else:
        state_kwargs = {}
    l_max = mixer_kwargs.pop("l_max", None) or cfg["max_position_embeddings"] or 2048
    for key in ("n_layer", "layer_idx", "d_model"):
        mixer_kwargs.pop(key, None)
    try:
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=int(cfg["d_model"]),
            n_layers=int(cfg["n_layers"]),
            sequence_mixer=mixer,
            sequence_mixer_kwargs=mixer_kwargs,
            state_mixer=state,
            state_mixer_kwargs=state_kwargs,
            l_max=int(l_max),
            max_position_embeddings=int(cfg["max_position_embeddings"] or 0),
            layer_norm_epsilon=float(cfg["layer_norm_epsilon"]),
            pad_vocab_size_multiple=int(cfg["pad_vocab_size_multiple"]),
        )
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: invalid model config ({e})") from None


def load_zoology(target: str | Path):
    """(LanguageModel with the checkpoint's weights, directory to look for a tokenizer in)."""
    from models.backbone import LanguageModel
    from models.checkpoint_io import load_state_dict_checked, read_checkpoint, state_dict_from

    weights_file, config_file = find_files(target)
    obj = read_checkpoint(weights_file)
    embedded = obj.get("config") if isinstance(obj, dict) else None
    if isinstance(embedded, dict):
        data, source = embedded, f"{weights_file} (embedded config)"
    elif config_file is not None:
        data, source = read_config_file(config_file), str(config_file)
    else:
        raise ArSliceError(
            f"{weights_file}: no model config found (no 'config' entry in the checkpoint and no "
            f"{' / '.join(CONFIG_NAMES)} beside it); save Zoology's ModelConfig there as JSON"
        )
    try:
        model = LanguageModel(model_config_from_zoology(data, source))
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{source}: cannot build the model ({e})") from None
    state = state_dict_from(obj, weights_file)
    load_state_dict_checked(model, state, source=str(weights_file), tied=("lm_head.weight",))
    return model, weights_file.parent
