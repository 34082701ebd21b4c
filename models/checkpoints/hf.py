"""`hf:<hub id or directory>`: transformers `AutoModelForCausalLM` checkpoints (Pythia/GPT-NeoX,
GPT-2, GPT-Neo, Llama family, RWKV, Mamba, Mamba-2), and mamba_ssm's own layout
(`state-spaces/mamba-*`, `mamba2-*`, `mamba2attn-2.7b`, `transformerpp-2.7b`,
`hazyresearch/mamba-1.3b`: a config.json with `d_model` and `n_layer`), recognised by its config
(models/checkpoints/mamba_ssm.py).

RWKV-4, Mamba-1 and Mamba-2 run through this project's chunked forwards unless `fast_path=False`:
RWKV-4 as models/mixers/rwkv.py's `FastRwkv` (filled by hf_rwkv.py; its exact fp32 WKV computes
what transformers' own CPU loop computes), Mamba-1 as models/mixers/mamba.py's `MambaLM` and
Mamba-2 as models/mixer_model.py's `MixerLM` (both filled by mamba_ssm.py). A hub id may be bare
(`hf:gpt2`) and takes a revision (`hf:EleutherAI/pythia-160m@step3000`).

A config.json with `auto_map` names Python of the checkpoint's own (transformers' "custom code"):
it is refused, before transformers sees the folder, unless the evaluation asks for it with
`--trust-remote-code`; transformers is always told whether to run it (`trust_remote_code`), so it
never asks on a terminal and never runs the code otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ar_slicing.errors import ArSliceError
from models.checkpoints.registry import (
    LoadedModel,
    LoadRequest,
    count_params,
    fingerprint_near,
    register_loader,
)

log = logging.getLogger(__name__)

# transformers model types that read any length (recurrent: no positional limit)
_RECURRENT = ("rwkv", "mamba", "mamba2", "falcon_mamba")


def _fast_forward(model, architecture: str):
    """`model` converted to this project's forward for its architecture, when it has one."""
    if architecture == "rwkv":
        from models.checkpoints.hf_rwkv import rwkv_from_transformers

        return rwkv_from_transformers(model)
    if architecture == "mamba":
        from models.checkpoints.mamba_ssm import mamba_from_transformers

        return mamba_from_transformers(model)
    if architecture == "mamba2":
        from models.checkpoints.mamba_ssm import mamba2_from_transformers

        return mamba2_from_transformers(model)
    return model


@register_loader("hf", order=1, hub=True, bare_hub_ids=True)
def load_spec(request: LoadRequest) -> LoadedModel:
    """The model of a local directory, or of a hub id read at the commit load_model resolved."""
    from models.checkpoints.based import is_based_config
    from models.checkpoints.mamba_ssm import (
        architecture_of,
        is_mamba_ssm_config,
        load_mamba_ssm,
        read_config_json,
        read_mamba_ssm_config,
    )

    spec, target, commit, dtype = request.spec, request.target, request.commit, request.dtype
    path = Path(target).expanduser()
    looks_local = target.startswith((".", "/", "~")) or path.exists()
    if looks_local:
        target = str(path)
    if looks_local and not path.is_dir():
        raise ArSliceError(
            f"{spec}: {path} is not a directory (expected one saved by save_pretrained)"
        )
    if looks_local and not (path / "config.json").is_file():
        raise ArSliceError(
            f"{spec}: {path / 'config.json'} not found (not a transformers model directory)"
        )
    raw = read_config_json(target, looks_local, commit)
    if isinstance(raw, dict) and raw.get("auto_map") and not request.trust_remote_code:
        raise ArSliceError(
            f"{spec}: its config.json names Python code of its own (auto_map: "
            f"{', '.join(sorted(map(str, raw['auto_map'])))}), which is not run unless asked: "
            "read that code, then pass --trust-remote-code (`trust_remote_code = true` in a "
            "config's [eval] table) to run it"
        )
    if is_mamba_ssm_config(raw):
        model = load_mamba_ssm(
            target, raw, spec, looks_local, as_transformers=not request.fast_path, revision=commit
        )
        architecture = architecture_of(read_mamba_ssm_config(raw, spec))
        if dtype is not None:
            model = model.to(dtype=dtype)
    elif is_based_config(raw):
        raise ArSliceError(
            f"{spec}: its config.json is a HazyResearch/based config (no model_type), not a "
            f"transformers one; load it with based:{target}"
        )
    else:
        model, architecture = _load_transformers(
            spec, target, dtype, commit, request.trust_remote_code
        )
        if request.fast_path:
            model = _fast_forward(model, architecture)
    model.eval().to(request.device)
    tok_dir = path if looks_local else _hub_tokenizer_dir(target, commit)
    tok_fp = fingerprint_near(tok_dir)
    if hasattr(model, "hidden_and_head"):  # this project's forward
        hidden_and_head = model.hidden_and_head
    else:
        base = model.base_model
        head = model.get_output_embeddings()

        def hidden_and_head(input_ids):
            hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
            return hidden, head.weight, getattr(head, "bias", None)

    config = model.config
    max_positions = None
    if architecture not in _RECURRENT:
        max_positions = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
    return LoadedModel(
        model=model,
        spec=spec,
        architecture=architecture,
        n_params=count_params(model),
        vocab_size=_head_rows(model),
        max_positions=max_positions,
        tokenizer_fingerprint=tok_fp,
        tokenizer_source=target if tok_dir is None else str(tok_dir),
        hub_commit=commit,
        _hidden_and_head=hidden_and_head,
    )


def _head_rows(model) -> int:
    """Rows of the output head (transformers' models, FastRwkv, MambaLM): the vocabulary scored."""
    if hasattr(model, "get_output_embeddings"):
        return int(model.get_output_embeddings().weight.shape[0])
    head = model.lm_head if hasattr(model, "lm_head") else model.head
    return int(head.weight.shape[0])


def _load_transformers(spec: str, target: str, dtype, commit: str | None, trust: bool = False):
    """transformers' AutoModelForCausalLM for `target` (at `commit`), and its model_type;
    `trust`: run the checkpoint's own code (given explicitly, so transformers never asks)."""
    import torch

    from ar_slicing.machinery import hub

    remote = {"trust_remote_code": trust, **hub.files_only()}
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(target, revision=commit, **remote)
    except Exception as e:
        raise ArSliceError(
            f"{spec}: could not read a transformers config ({type(e).__name__}: {e}). Pass a local "
            "directory saved with save_pretrained, or a hub id when the hub is reachable."
        ) from None
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None):
            raise ArSliceError(
                f"{spec}: model_type {config.model_type} transforms its logits ({attr}); per-token "
                "scoring of such models is not supported"
            )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            target, revision=commit, dtype=dtype or torch.float32, **remote
        )
    except Exception as e:
        _refuse_local_pickles(Path(target))
        first = str(e).strip().splitlines()[:1] or [""]
        raise ArSliceError(
            f"{spec}: could not load the weights ({type(e).__name__}: {first[0]})"
        ) from None
    return model, config.model_type


def _refuse_local_pickles(model_dir: Path) -> None:
    """After transformers failed to load `model_dir`: the one-line diagnosis of its pickled
    weights (`pytorch_model*.bin`, read by it with weights_only) when one of them is at fault."""
    from models.checkpoints.io import safe_torch_load

    if model_dir.is_dir() and not any(model_dir.glob("*.safetensors")):
        for weights in sorted(model_dir.glob("pytorch_model*.bin")):
            safe_torch_load(weights)  # raises ArSliceError naming the file when it is unreadable


TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json",
]  # fmt: skip


def _hub_tokenizer_dir(name: str, commit: str | None) -> Path | None:
    """The local folder holding the tokenizer files of hub repo `name` at `commit` (fetched when
    the hub answers, else from the cache), or None when it has none."""
    from ar_slicing.machinery import hub

    try:
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(
                name, revision=commit, allow_patterns=TOKENIZER_FILES, **hub.files_only()
            )
        )
    except Exception as e:
        log.warning("hf:%s: no tokenizer found with the model (%s); fingerprint unknown", name, e)
        return None
    return folder if any((folder / f).is_file() for f in TOKENIZER_FILES) else None
