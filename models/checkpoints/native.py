"""`native:<directory>`, this project's own checkpoint format: `config.json` + `model.safetensors`
(+ `tokenizer.json`), as `arslice train` writes it.

`save_native` writes the weights first and `config.json` last, each atomically, so a directory
with a `config.json` is a complete checkpoint. A checkpoint the trainer kept along the way,
`<model>/checkpoints/step-<n>/`, holds no tokenizer of its own: it is its model folder's. The
trainer's `meta.json` beside the weights records where a model stands along training (`step`,
`tokens_seen`), for a kept checkpoint as for the final model (`training_point`). A tied `lm_head.weight` is not stored twice
(safetensors refuses shared tensors); `load_native` ties it again. Format version 2 stores every
mixer option resolved; version 1 configs (written before the options were typed) are read as the
models they described.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import atomic_path, os_errors_of, read_json, write_json_atomic
from ar_slicing.machinery.layout import (
    META_NAME,
    MODEL_CONFIG_NAME,
    MODEL_WEIGHTS_NAME,
    TOKENIZER_NAME,
    model_of_checkpoint,
)
from models.checkpoints.registry import (
    LoadedModel,
    LoadRequest,
    loaded_language_model,
    register_loader,
)

FORMAT = "ar-slicing-native"
FORMAT_VERSION = 2
TIED_KEYS = ("lm_head.weight",)


def save_native(model, out_dir, tokenizer_json=None, saved_dtype: str = "fp32") -> Path:
    """Save a `LanguageModel` to `out_dir` (config.json, model.safetensors, tokenizer.json if
    given). `saved_dtype="bf16"` rounds every parameter to bf16 first (written as fp32 still;
    buffers are kept as they are): the weights a folder of prebuilt models stores, exactly."""
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tied = TIED_KEYS if model.config.tie_word_embeddings else ()
    state = {
        k: v.detach().to("cpu").clone().contiguous()  # clone: shared Sin freqs would share storage
        for k, v in model.state_dict().items()
        if k not in tied
    }
    if saved_dtype == "bf16":
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        state = {
            k: v.to(torch.bfloat16).to(v.dtype) if k in parameters and v.is_floating_point() else v
            for k, v in state.items()
        }
    write_weights(state, out_dir / MODEL_WEIGHTS_NAME)
    if tokenizer_json is not None:
        copy_tokenizer(tokenizer_json, out_dir)
    write_json_atomic(
        out_dir / MODEL_CONFIG_NAME,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "architecture": model.config.sequence_mixer,
            "model": model.config.to_dict(),
        },
    )
    return out_dir


def copy_tokenizer(tokenizer_json, out_dir) -> None:
    """The tokenizer beside a model: `tokenizer_json` copied to `out_dir`, atomically."""
    src = Path(tokenizer_json)
    if not src.is_file():
        raise ArSliceError(f"tokenizer {src}: no such file (expected a tokenizer.json)")
    with atomic_path(Path(out_dir) / TOKENIZER_NAME) as tmp:
        shutil.copyfile(src, tmp)


def write_weights(state: dict, path) -> None:
    """Write a state dict as the native `model.safetensors`, atomically; the same tensors give
    the same bytes however they came (trained here, or upcast from a prebuilt folder's bf16)."""
    from safetensors.torch import save_file

    with atomic_path(Path(path)) as tmp, os_errors_of(path):
        save_file(state, str(tmp), metadata={"format": "pt"})


def read_native_config(model_dir):
    from models.backbone import ModelConfig

    path = Path(model_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise ArSliceError(
            f"{path}: not found; a native checkpoint directory holds config.json and "
            f"model.safetensors as written by models.checkpoints.native.save_native"
        )
    data = read_json(path)
    if data.get("format") != FORMAT or "model" not in data:
        raise ArSliceError(
            f"{path}: not a native checkpoint config (format {data.get('format')!r}); "
            "for a transformers directory use the spec hf:<dir>"
        )
    model = dict(data["model"])
    if data.get("format_version", 1) == 1:
        model = _from_format_1(model)
    try:
        return ModelConfig.from_dict(model)
    except ArSliceError as e:
        raise ArSliceError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{path}: invalid model config ({e})") from None


def _from_format_1(model: dict) -> dict:
    """A format-1 ModelConfig as format 2 says it: the options the mixers then read and nothing
    they ignored (state mixers other than the MLP dropped `hidden_mult`; a long BaseConv's
    implicit filter was the Hyena-style one)."""
    state = model.get("state_mixer") or ("rwkv" if model.get("sequence_mixer") == "rwkv" else "mlp")
    if state not in ("mlp", "glu", "swiglu"):
        model["state_mixer_kwargs"] = {
            k: v for k, v in (model.get("state_mixer_kwargs") or {}).items() if k != "hidden_mult"
        }
    kwargs = dict(model.get("sequence_mixer_kwargs") or {})
    if model.get("sequence_mixer") == "base_conv":
        kwargs = {
            k: v for k, v in kwargs.items() if k in ("kernel_size", "implicit_long_conv", "use_act")
        }
        kwargs["implicit_filter"] = "hyena"
    model["sequence_mixer_kwargs"] = kwargs
    return model


def load_native(model_dir, device="cpu", dtype=None):
    """Rebuild the `LanguageModel` saved in `model_dir`, in eval mode, on `device` (and `dtype`)."""
    from safetensors.torch import load_file

    from models.backbone import LanguageModel
    from models.checkpoints.io import load_state_dict_checked

    model_dir = Path(model_dir)
    config = read_native_config(model_dir)
    weights = model_dir / MODEL_WEIGHTS_NAME
    if not weights.is_file():
        raise ArSliceError(f"{weights}: not found (the checkpoint is incomplete; re-save it)")
    try:
        state = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ArSliceError(f"{weights}: not a readable safetensors file ({e})") from None
    model = LanguageModel(config)
    tied = TIED_KEYS if config.tie_word_embeddings else ()
    load_state_dict_checked(model, state, source=str(weights), tied=tied)
    model.eval()
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


def tokenizer_dir(model_dir) -> Path:
    """Where a native checkpoint's tokenizer is: its own folder, or, for a checkpoint kept along
    training (`<model>/checkpoints/step-<n>`), its model folder's."""
    model_dir = Path(model_dir)
    model = model_of_checkpoint(model_dir)
    if not (model_dir / TOKENIZER_NAME).is_file() and model is not None:
        return model
    return model_dir


def training_point(model_dir) -> dict | None:
    """{"step", "tokens_seen"} of a model `arslice train` wrote (the final model or a checkpoint
    it kept), from its meta.json; None when there is none or it records no step."""
    meta_path = Path(model_dir) / META_NAME
    if not meta_path.is_file():
        return None
    meta = read_json(meta_path)
    step = meta.get("step", (meta.get("counts") or {}).get("steps"))
    if step is None or meta.get("tokens_seen") is None:
        return None
    return {"step": int(step), "tokens_seen": int(meta["tokens_seen"])}


@register_loader("native", order=5, identified_by_meta=True)
def load_spec(request: LoadRequest) -> LoadedModel:
    path = Path(request.target)
    if not path.is_dir():
        raise ArSliceError(
            f"{request.spec}: {path} is not a directory (expected a native checkpoint dir)"
        )
    return loaded_language_model(load_native(path), request, tokenizer_dir=tokenizer_dir(path))
