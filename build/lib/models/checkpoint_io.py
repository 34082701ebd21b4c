"""Checkpoint files: weights-only reads (safetensors or `torch.load(weights_only=True)`), state-dict
unwrapping, and a checked `load_state_dict` that lists every mismatched key.

Every loader in `models/` reads its weights through here, so there is one refusal policy for
pickles that carry code and one message format for weights that do not fit a config.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

# Wrappers that training frameworks put around a state dict, and prefixes they put on its keys.
_STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model", "module")
_KEY_PREFIXES = ("_orig_mod.", "module.", "model.")
_MAX_LISTED_KEYS = 20


def safe_torch_load(path) -> Any:
    """`torch.load(path, weights_only=True)`, with refusals and corrupt files as ArSliceError."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ArSliceError(f"{path}: checkpoint file not found")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArSliceError(
            f"{path}: refused: this pickle holds more than plain weights ({first}). Only tensors "
            "and plain containers are loaded; re-save it with torch.save(model.state_dict(), ...) "
            "or as safetensors."
        ) from None
    except Exception as e:  # truncated or foreign files fail deep inside the unpickler
        raise ArSliceError(
            f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})"
        ) from None


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


def load_state_dict_checked(model, state: Mapping[str, Any], source: str, tied: Iterable[str] = ()):
    """Load `state` into `model` after checking keys and shapes; raise ArSliceError listing every
    missing, unexpected and mis-shaped key. Keys in `tied` may be absent (tied weights, buffers the
    model recomputes)."""
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
    model.load_state_dict({k: v for k, v in state.items()}, strict=False)
    return model
