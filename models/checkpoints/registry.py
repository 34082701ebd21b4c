"""Load a model from a spec string into a `LoadedModel` that the eval stage can score with.

Specs:
    hf:<hub id or directory>   transformers AutoModelForCausalLM (Pythia/GPT-NeoX, GPT-2, GPT-Neo,
                               Llama family, RWKV, Mamba, Mamba-2), and mamba_ssm's own layout
                               (`state-spaces/mamba-*`, `hazyresearch/mamba-1.3b`: a config.json
                               with `d_model` and `n_layer`), recognised by its config. RWKV and
                               Mamba-1 run through this project's fast forwards (models/mixers/rwkv.py,
                               models/mixers/mamba.py) unless `fast_path=False`
    zoology:<checkpoint>       a Zoology state dict + its ModelConfig -> models.backbone
                               (models/checkpoints/zoology.py says what it supports)
    safari:<checkpoint>        a safari Hyena LM (e.g. Hyena-153M): raw state dict or Lightning
                               last.ckpt, with safari's config -> models.backbone (safari_ckpt.py)
    based:<dir or hub id>      HazyResearch/based's Based / Transformer++ (config.json +
                               pytorch_model.bin as published) -> models.backbone; the suite's
                               Mamba (mamba_ssm's layout) is read as hf: reads it
    native:<directory>         config.json + model.safetensors written by models.checkpoints.native.save_native

hf:, based: and safari: hub ids take a revision, `ID@REVISION` (a branch, tag or commit, e.g.
`hf:EleutherAI/pythia-160m@step3000`): it is resolved to its commit once (`hub.resolve_commit`:
the hub when it answers, else the local cache's refs), every file is read at that commit, and the
commit is what the stage plan and meta.json record.

hf: RWKV-4 runs this project's exact fp32 WKV (models/checkpoints/hf_rwkv.py); transformers' own CPU loop
computes the same recurrence. zoology: and safari: checkpoints are checked against fixtures that
Zoology's and safari's own code produced (tests/fixtures/upstream).

Checkpoints are read with `torch.load(..., weights_only=True)` or safetensors only; a pickle that
holds anything but plain tensors and containers is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

SPEC_PREFIXES = ("hf", "zoology", "safari", "based", "native")
HUB_PREFIXES = ("hf", "based", "safari")  # the specs that read a hub id (with @REVISION)


@dataclass
class LoadedModel:
    """A model ready for scoring, with what the eval stage records about it.

    model: the nn.Module in eval mode; architecture: "attention" | "base_conv" | "hyena" | "rwkv"
    (| "based" for a based: Based LM) for this project's models, the transformers `model_type` (e.g. "gpt_neox") for hf:;
    vocab_size: rows of the output head; max_positions: longest input the model accepts (None: no
    limit); tokenizer_fingerprint: of the tokenizer found with the checkpoint, else None;
    settings: what the loader decided that the weights do not show (where the config came from,
    safari's filter settings, ...), recorded in the eval stage's meta.json; tokenizer_source:
    the directory or hub name the model's tokenizer is looked up in (None: nowhere).
    `hidden_and_head(input_ids (B, T))` -> (hidden (B, T, D), head weight (V, D), head bias or None).
    """

    model: Any
    spec: str
    architecture: str
    n_params: int
    vocab_size: int
    max_positions: int | None
    tokenizer_fingerprint: str | None
    settings: dict = field(default_factory=dict)
    tokenizer_source: str | None = None
    hub_commit: str | None = None  # the commit a hub id (and its @revision) resolved to
    _hidden_and_head: Callable = field(repr=False, default=None)

    def hidden_and_head(self, input_ids):
        return self._hidden_and_head(input_ids)

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype


def parse_spec(spec: str) -> tuple[str, str]:
    """`"hf:EleutherAI/pythia-70m"` -> `("hf", "EleutherAI/pythia-70m")`."""
    prefix, sep, target = str(spec).partition(":")
    if not sep or prefix not in SPEC_PREFIXES or not target:
        raise ArSliceError(
            f"model spec {spec!r}: expected PREFIX:TARGET with PREFIX one of "
            f"{', '.join(p + ':' for p in SPEC_PREFIXES)} (e.g. hf:EleutherAI/pythia-70m, "
            "native:runs/demo/models/attention)"
        )
    return prefix, target


def hub_target(spec: str) -> tuple[str, str, str | None, bool]:
    """(prefix, target, revision, whether target is a hub id) of a spec: `hf:ID@REVISION`,
    `based:ID@REVISION` and `safari:ID@REVISION` name a branch, tag or commit of a hub repo; a
    local path is never a hub id."""
    from ar_slicing import hub

    prefix, target = parse_spec(spec)
    if prefix not in HUB_PREFIXES:
        return prefix, target, None, False
    name, revision = hub.split_revision(target)
    # based: and safari: take owner/name ids only (hf: also takes GPT-2's bare `gpt2`)
    is_hub = hub.is_hub_name(name) and (prefix == "hf" or name.count("/") == 1)
    if revision is not None and not is_hub:
        raise ArSliceError(f"{spec}: a revision (@{revision}) applies to hub ids only")
    return prefix, name, revision, is_hub


def spec_path(spec: str) -> Path | None:
    """The local file or folder a spec names; None for a hub id (`hf:`, `based:` and `safari:`
    take either; see `hub_target`)."""
    _prefix, target, _revision, is_hub = hub_target(spec)
    return None if is_hub else Path(target).expanduser()


def spec_identity(spec: str) -> dict:
    """What identifies the weights a spec names, cheaply (no weights are read): a checkpoint
    this project wrote by its meta.json's digest, other local files by size and modification
    time, a hub id by the commit its revision (default: the hub's default branch) resolves to,
    so a hub model that changed under the same name is a changed input."""
    from ar_slicing import hub
    from ar_slicing.layout import META_NAME
    from ar_slicing.plan import file_identity, identity

    prefix, target, revision, is_hub = hub_target(spec)
    if is_hub:
        commit = hub.resolve_commit(target, revision, spec)
        return {"hub": target, "revision": revision, "commit": commit}
    path = Path(target).expanduser()
    if not path.exists():
        return {"spec": spec}
    if path.is_dir() and (path / META_NAME).is_file() and prefix == "native":
        return {"native": identity(path)}
    return {"files": file_identity(path)}


def load_model(
    spec: str, device="cpu", dtype=None, fast_path: bool = True, model_config=None
) -> LoadedModel:
    """Load the model named by `spec` (see the module docstring) onto `device`, in eval mode.

    `dtype` (torch dtype or "bf16"/"fp32"/...) casts the weights; None keeps fp32. `fast_path`
    runs hf: RWKV and Mamba-1 checkpoints through this project's chunked RWKV and Mamba forwards
    instead of transformers' per-token loops (False: transformers' own forward).
    `model_config`: a config file to use instead of the one found with a zoology:, safari: or
    based: checkpoint.
    """
    from ar_slicing import hub
    from models.precision import torch_dtype

    prefix, target, revision, is_hub = hub_target(spec)
    commit = hub.resolve_commit(target, revision, spec) if is_hub else None
    dtype = torch_dtype(dtype)
    if model_config is not None and prefix not in ("zoology", "safari", "based"):
        raise ArSliceError(
            f"{spec}: a model config file (--model-config) applies to zoology:, safari: and "
            "based: checkpoints only; hf: and native: directories carry their own config.json"
        )
    if prefix == "hf":
        return _load_hf(spec, target, device, dtype, fast_path, commit)
    if prefix == "native":
        from models.checkpoints.native import load_native

        path = Path(target)
        if not path.is_dir():
            raise ArSliceError(
                f"{spec}: {path} is not a directory (expected a native checkpoint dir)"
            )
        model = load_native(path, device=device, dtype=dtype)
        loaded = wrap_language_model(model, spec, tokenizer_fingerprint=_fingerprint_near(path))
        loaded.tokenizer_source = str(path)
        return loaded
    architecture = None
    if prefix == "zoology":
        from models.checkpoints.zoology import load_zoology

        model, tok_dir, settings = load_zoology(target, model_config)
    elif prefix == "based":
        from models.checkpoints.based import architecture_of, load_based
        from models.checkpoints.mamba_ssm import is_mamba_ssm_config, read_config_json

        # the suite's Mamba (hazyresearch/mamba-1.3b) is published in mamba_ssm's layout
        if is_mamba_ssm_config(read_config_json(target, not is_hub, commit)):
            return _load_hf(spec, target, device, dtype, fast_path, commit)
        model, tok_dir = load_based(target, spec, model_config, commit)
        architecture, settings = architecture_of(model.config), {}
    else:
        from models.checkpoints.safari import load_safari

        model, tok_dir, settings = load_safari(target, model_config, commit)
    model.eval()
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    loaded = wrap_language_model(
        model, spec, tokenizer_fingerprint=_fingerprint_near(tok_dir), architecture=architecture
    )
    loaded.settings, loaded.tokenizer_source = settings, str(tok_dir)
    loaded.hub_commit = commit
    return loaded


def count_params(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def max_positions_of(config) -> int | None:
    """The longest input one of our LanguageModels accepts: learned positions, filter length, or none."""
    limits = []
    if config.max_position_embeddings:
        limits.append(config.max_position_embeddings)
    for i in range(config.n_layers):
        mixer, kwargs = config.mixer_of_layer(i)
        kernel = kwargs.get("kernel_size", 3)
        long_conv = -1 in (kernel if isinstance(kernel, list) else [kernel])
        # attention without rotary has no notion of order beyond l_max; rotary has no limit
        if (
            (mixer == "attention" and not kwargs.get("rotary_emb_dim"))
            or mixer == "hyena"
            or (mixer == "base_conv" and long_conv)
        ):
            limits.append(config.l_max)
    return min(limits) if limits else None


def wrap_language_model(
    model, spec: str, tokenizer_fingerprint: str | None, architecture: str | None = None
) -> LoadedModel:
    config = model.config
    return LoadedModel(
        model=model,
        spec=spec,
        architecture=architecture or config.sequence_mixer,
        n_params=count_params(model),
        vocab_size=config.padded_vocab_size,
        max_positions=max_positions_of(config),
        tokenizer_fingerprint=tokenizer_fingerprint,
        _hidden_and_head=model.hidden_and_head,
    )


def _fingerprint_near(path) -> str | None:
    """Fingerprint of a tokenizer stored with a checkpoint (tokenizer.json or transformers files)."""
    from ar_slicing.tokenizer import fingerprint, load_tokenizer

    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        path = path.parent
    if (path / "tokenizer.json").is_file():
        return fingerprint(load_tokenizer(path / "tokenizer.json"))
    if any(
        (path / n).is_file() for n in ("vocab.json", "tokenizer.model", "tokenizer_config.json")
    ):
        try:
            return fingerprint(load_tokenizer(path))
        except ArSliceError as e:
            log.warning("%s: tokenizer files present but unreadable (%s)", path, e)
    return None


# ---- transformers ------------------------------------------------------------------------------


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
    return model


def _load_hf(
    spec: str, target: str, device, dtype, fast_path: bool, commit: str | None
) -> LoadedModel:
    """`target`: a local directory, or a hub id read at `commit` (resolved by load_model)."""
    from models.checkpoints.based import is_based_config
    from models.checkpoints.mamba_ssm import is_mamba_ssm_config, load_mamba_ssm, read_config_json

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
    if is_mamba_ssm_config(raw):
        model = load_mamba_ssm(
            target, raw, spec, looks_local, as_transformers=not fast_path, revision=commit
        )
        architecture = "mamba"
        if dtype is not None:
            model = model.to(dtype=dtype)
    elif is_based_config(raw):
        raise ArSliceError(
            f"{spec}: its config.json is a HazyResearch/based config (no model_type), not a "
            f"transformers one; load it with based:{target}"
        )
    else:
        model, architecture = _load_transformers(spec, target, dtype, commit)
        if fast_path:
            model = _fast_forward(model, architecture)
    model.eval().to(device)
    tok_dir = path if looks_local else _hub_tokenizer_dir(target, commit)
    tok_fp = _fingerprint_near(tok_dir)
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


def _load_transformers(spec: str, target: str, dtype, commit: str | None):
    """transformers' AutoModelForCausalLM for `target` (at `commit`), and its model_type."""
    import torch

    from ar_slicing import hub

    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(target, revision=commit, **hub.files_only())
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
            target, revision=commit, dtype=dtype or torch.float32, **hub.files_only()
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
    from ar_slicing import hub

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
