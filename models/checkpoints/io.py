"""Checkpoint files: weights-only reads (safetensors or `torch.load(weights_only=True)`), state-dict
unwrapping, the config files beside them, and a checked `load_state_dict` that lists every
mismatched key.

Every loader in `models/` reads its weights through here, so there is one refusal policy for
pickles that carry code and one message format for weights that do not fit a config.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

# Wrappers that training frameworks put around a state dict, and prefixes they put on its keys.
_STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model", "module")
_KEY_PREFIXES = ("_orig_mod.", "module.", "model.")
_MAX_LISTED_KEYS = 20
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
# omegaconf's plain-data containers: how Lightning stores a hydra config (safari's
# `hyper_parameters`). Unpickling them builds nodes holding values and runs no other code.
_OMEGACONF_GLOBALS = (
    "omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
    "omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata", "omegaconf.nodes.AnyNode",
    "omegaconf.nodes.StringNode", "omegaconf.nodes.IntegerNode", "omegaconf.nodes.FloatNode",
    "omegaconf.nodes.BooleanNode",
)  # fmt: skip
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _config_globals() -> list:
    """The omegaconf classes that `_OMEGACONF_GLOBALS` names (none without omegaconf), plus the
    plain types their pickles name."""
    import collections
    import importlib
    import typing

    found = []
    for name in _OMEGACONF_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            return []
    # the metadata names node and key types as globals
    return [*found, typing.Any, collections.defaultdict, dict, list, tuple, int, float, str, bool]


def refused_global(message: str) -> str | None:
    """The class a weights-only unpickler refused, from torch's error text."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", _ANSI.sub("", message))
    return found.group(1) if found else None


def safe_torch_load(path) -> Any:
    """`torch.load(path, weights_only=True)`, with refusals and corrupt files as ArSliceError.

    Besides tensors and plain containers, omegaconf's config containers load (Lightning keeps a
    hydra config in them); they are returned as omegaconf objects."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ArSliceError(f"{path}: checkpoint file not found")
    if not _written_by_torch_save(path):
        raise ArSliceError(
            f"{path}: not a PyTorch checkpoint (neither the zip archive torch.save writes nor a "
            "pickle); name a file written by torch.save, or a .safetensors file"
        )
    try:
        with torch.serialization.safe_globals(_config_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _RESOLVER_CACHE.search(_ANSI.sub("", str(e))):
            raise ArSliceError(resolver_cache_refusal(path)) from None
        name = refused_global(str(e))
        if name is None and "Unsupported operand" in str(e):  # a pickle's header, then garbage
            raise ArSliceError(
                f"{path}: not a readable PyTorch checkpoint (a damaged pickle: "
                f"{_unsupported_operand(str(e))}); save it again with torch.save"
            ) from None
        what = f"names {name}, a class or function" if name else "holds objects"
        hint = (
            " (an omegaconf config: pip install omegaconf to read it)"
            if name and name.startswith("omegaconf.")
            else ""
        )
        raise ArSliceError(
            f"{path}: refused: this pickle {what}{hint}; only tensors and plain containers are "
            "loaded. Re-save it with torch.save(model.state_dict(), ...) or as safetensors."
        ) from None
    except Exception as e:  # truncated or foreign files fail deep inside the unpickler
        first = _ANSI.sub("", str(e)).strip().splitlines()
        raise ArSliceError(
            f"{path}: not a readable PyTorch checkpoint "
            f"({type(e).__name__}{': ' + first[0] if first else ''})"
        ) from None


# A hydra config pickled after resolving interpolations with a caching resolver (safari's
# `${eval:...}`, `${div_up:...}`) carries omegaconf's resolver cache, a filled defaultdict, which
# the weights-only unpickler cannot rebuild ("Can only SETITEM for dict, ... defaultdict").
_RESOLVER_CACHE = re.compile(r"SETITEM for .*defaultdict")


def resolver_cache_refusal(path: Path) -> str:
    return (
        f"{path}: refused: its hydra config (Lightning hyper_parameters, an omegaconf DictConfig) "
        "holds omegaconf's resolver cache, a collections.defaultdict filled when interpolations "
        "such as ${eval:...} were resolved, which a weights-only load cannot rebuild. For a file "
        "you trust, keep its weights alone: torch.save(torch.load(PATH, weights_only=False)"
        "['state_dict'], 'model.pt'), and pass the run's config (its .hydra/config.yaml) with "
        "--model-config"
    )


def _written_by_torch_save(path: Path) -> bool:
    """The file starts as torch.save's output does: a zip archive, or (the format before torch
    1.6) a pickle's PROTO opcode."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or (
        len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    )


def _unsupported_operand(message: str) -> str:
    found = re.search(r"Unsupported operand \d+", _ANSI.sub("", message))
    return found.group(0) if found else "unreadable"


def find_weights_file(path: Path, spec_prefix: str) -> Path:
    """The weights file a checkpoint path names: the file itself, or the one in a directory."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ArSliceError(f"{path}: no such checkpoint file or directory")
    weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        raise ArSliceError(
            f"{path}: no weights file ({', '.join(WEIGHT_SUFFIXES)}) in this directory"
        )
    if len(weights) > 1:
        raise ArSliceError(
            f"{path}: several weights files ({', '.join(p.name for p in weights)}); "
            f"name the one to load: {spec_prefix}:<dir>/<file>"
        )
    return weights[0]


def read_config_file(path: Path) -> dict:
    """A JSON or YAML config file holding a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ArSliceError(f"{path}: config file not found")
    if path.suffix == ".json":
        import json

        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArSliceError(f"{path}: not valid JSON ({e})") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            first = str(e).strip().splitlines()
            raise ArSliceError(f"{path}: not valid YAML ({first[0] if first else e})") from None
    if not isinstance(data, dict):
        raise ArSliceError(
            f"{path}: expected a mapping of config fields, found {type(data).__name__}"
        )
    return data


def plain_config(obj: Any) -> Any:
    """An omegaconf container as plain dicts and lists (interpolations left unresolved: resolving
    safari's custom resolvers would run code); anything else as it is."""
    if type(obj).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(obj, resolve=False)
    return obj


def read_checkpoint(path) -> Any:
    """The raw object in a checkpoint file: a safetensors dict or a weights-only torch pickle."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        if not path.is_file():
            raise ArSliceError(f"{path}: checkpoint file not found")
        try:
            return load_file(str(path))
        except Exception as e:
            raise ArSliceError(f"{path}: not a readable safetensors file ({e})") from None
    return safe_torch_load(path)


def state_dict_from(obj: Any, path) -> dict:
    """The flat {name: tensor} state dict inside a checkpoint object, unwrapped and de-prefixed."""
    import torch

    for _ in range(3):  # unwrap {"state_dict": {...}} and the like
        if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
            inner = next(
                (obj[k] for k in _STATE_DICT_WRAPPERS if isinstance(obj.get(k), Mapping)), None
            )
            if inner is None:
                break
            obj = inner
    if not isinstance(obj, Mapping):
        raise ArSliceError(
            f"{path}: expected a state dict (name -> tensor), found {type(obj).__name__}"
        )
    state = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not state:
        raise ArSliceError(
            f"{path}: holds no tensors (keys: {', '.join(list(map(str, obj))[:10])})"
        )
    return strip_key_prefixes(state)


def read_weights(path) -> dict:
    """A flat {name: tensor} state dict from a .safetensors file or a weights-only torch pickle."""
    return state_dict_from(read_checkpoint(path), path)


def strip_key_prefixes(state: Mapping[str, Any]) -> dict:
    """Drop a prefix that every key shares (Lightning's `model.`, DDP's `module.`, compile's `_orig_mod.`)."""
    state = dict(state)
    changed = True
    while changed:
        changed = False
        for prefix in _KEY_PREFIXES:
            if state and all(k.startswith(prefix) for k in state):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
    return state


def _listed(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    return shown + (
        f", … ({len(keys) - _MAX_LISTED_KEYS} more)" if len(keys) > _MAX_LISTED_KEYS else ""
    )


def _shared_keys(model) -> list[list[str]]:
    """Groups of state-dict keys that are one tensor in `model` (tied weights, shared modules)."""
    groups: dict[tuple, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault((tensor.data_ptr(), tensor.shape, tensor.stride()), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def load_state_dict_checked(model, state: Mapping[str, Any], source: str, tied: Iterable[str] = ()):
    """Load `state` into `model` after checking keys and shapes; raise ArSliceError listing every
    missing, unexpected and mis-shaped key. Keys in `tied` may be absent (tied weights, buffers the
    model recomputes). Keys that are one tensor in `model` must hold equal values in `state`:
    two different tensors are never loaded into one."""
    import torch

    expected = model.state_dict()
    tied = set(tied)
    missing = [k for k in expected if k not in state and k not in tied]
    unexpected = [k for k in state if k not in expected]
    misshaped = [
        f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)})"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or misshaped:
        parts = [f"{source}: the weights do not match the model configuration."]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
        if misshaped:
            parts.append(f"mis-shaped keys ({len(misshaped)}): {_listed(misshaped)}")
        parts.append(
            "Check that the config saved beside the checkpoint is the one it was trained with."
        )
        raise ArSliceError("\n  ".join(parts))
    for keys in _shared_keys(model):
        present = [k for k in keys if k in state]
        if len(present) > 1 and not all(torch.equal(state[present[0]], state[k]) for k in present):
            raise ArSliceError(
                f"{source}: {' and '.join(present)} are one tensor in this model but differ in the "
                "checkpoint (an untied head or unshared weights); the config does not match how "
                "the weights were trained"
            )
    model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    return model
