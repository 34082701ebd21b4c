"""Model specs (`PREFIX:TARGET`) and the registry of the checkpoint formats that load them, as
lm-eval registers its models (`@register_model("hf", ...)`).

Each format is one module of models/checkpoints that registers its loader under its prefix:

    @register_loader("based", order=4, hub=True, model_config=True)
    def load_spec(request: LoadRequest) -> LoadedModel: ...

The first lookup imports every module of the package (each keeps torch and transformers inside
its functions, so that is cheap), and what the rest of the project knows of formats is read from
the registrations: the prefixes `ModelSpec.parse` accepts and names, which specs take a hub id
(`ModelSpec.is_hub`, `reads_hub_models`), where `--model-config` applies, and the spec forms the help
texts list (`spec_forms`). A new format is one new file.

A hub id takes a revision, `ID@REVISION` (a branch, tag or commit, e.g.
`hf:EleutherAI/pythia-160m@step3000`): it is resolved to its commit once (`hub.resolve_commit`:
the hub when it answers, else the local cache's refs), every file is read at that commit, and the
commit is what the stage plan and meta.json record.

Checkpoints are read with `torch.load(..., weights_only=True)` or safetensors only
(models/checkpoints/io.py); a pickle that holds anything but plain tensors and containers is
refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LoadRequest:
    """What `load_model` hands a format's loader: the spec, parsed and resolved, and the caller's
    choices (see `load_model`)."""

    spec: str
    target: str  # a local path, or a hub id without its @REVISION
    is_hub: bool
    commit: str | None  # the commit the hub id resolved to; None for a local path
    device: Any = "cpu"
    dtype: Any = None  # a torch dtype; None keeps the checkpoint's fp32
    fast_path: bool = True
    model_config: str | Path | None = None
    trust_remote_code: bool = False  # run the Python a checkpoint names (hf: `auto_map`)


@dataclass(frozen=True)
class CheckpointFormat:
    """One registered format: its spec prefix, its loader and what its specs may name."""

    prefix: str
    load: Callable[[LoadRequest], LoadedModel]
    order: int  # its place wherever the prefixes are listed (messages)
    hub: bool = False  # TARGET may be a hub id (with @REVISION) as well as a local path
    bare_hub_ids: bool = False  # a hub id may be bare (GPT-2's `gpt2`), not only owner/name
    model_config: bool = False  # --model-config may replace the config found with the weights
    # its directories hold this project's meta.json (arslice train), whose digest identifies them
    identified_by_meta: bool = False
    local: tuple[str, ...] = ("dir",)  # what a local TARGET may be: a "file", a "dir"

    @property
    def spec_form(self) -> str:
        """`hf:<hub id or dir>`: what a spec of this format names, for help texts."""
        names = (["hub id"] if self.hub else []) + list(self.local)
        return f"{self.prefix}:<{_listed(names, 'or')}>"


_FORMATS: dict[str, CheckpointFormat] = {}
_discovered = False


def register_loader(
    prefix: str,
    *,
    order: int,
    hub: bool = False,
    bare_hub_ids: bool = False,
    model_config: bool = False,
    identified_by_meta: bool = False,
    local: tuple[str, ...] = ("dir",),
):
    """Register the decorated `load(request: LoadRequest) -> LoadedModel` as the loader of specs
    `PREFIX:TARGET`. `order` places it where prefixes are listed (hf: 1 .. native: 5); the flags
    are `CheckpointFormat`'s."""

    def register(load: Callable[[LoadRequest], LoadedModel]):
        known = _FORMATS.get(prefix)
        if known is not None and known.load.__module__ != load.__module__:
            raise ValueError(
                f"spec prefix {prefix}: registered by {known.load.__module__} and {load.__module__}"
            )
        _FORMATS[prefix] = CheckpointFormat(
            prefix,
            load,
            order,
            hub=hub,
            bare_hub_ids=bare_hub_ids,
            model_config=model_config,
            identified_by_meta=identified_by_meta,
            local=local,
        )
        return load

    return register


def formats() -> list[CheckpointFormat]:
    """Every registered format, in listing order. The first call imports the modules of this
    package, whose `register_loader` decorators fill the table."""
    global _discovered
    if not _discovered:
        import importlib
        import pkgutil

        package = importlib.import_module(__package__)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{module.name}")
        _discovered = True
    return sorted(_FORMATS.values(), key=lambda f: f.order)


def checkpoint_format(prefix: str) -> CheckpointFormat | None:
    """The format registered for `prefix`, or None."""
    return next((f for f in formats() if f.prefix == prefix), None)


def _listed(words: list[str], conjunction: str = "and") -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return words[-1] if len(words) < 2 else f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def spec_forms() -> str:
    """`hf:<hub id or dir>, zoology:<file or dir>, ...`: every format's spec, for help texts."""
    return ", ".join(f.spec_form for f in formats())


def model_config_prefixes(conjunction: str = "or") -> str:
    """`zoology:, safari: or based:`: the formats whose config `--model-config` may replace."""
    return _listed([f"{f.prefix}:" for f in formats() if f.model_config], conjunction)


# the file endings a model's default name drops (`hyena-153m.ckpt` -> `hyena-153m`)
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


@dataclass(frozen=True)
class ModelSpec:
    """A model spec, parsed once where it comes in (a flag, a config's `model = ...`):
    `PREFIX:TARGET`, TARGET a local file or folder, or for the formats that read the hub a hub id
    with an optional `@REVISION` (a branch, tag or commit).

    >>> s = ModelSpec.parse("hf:EleutherAI/pythia-160m@step3000")
    >>> (s.prefix, s.target, s.revision, s.is_hub, s.default_name)
    ('hf', 'EleutherAI/pythia-160m', 'step3000', True, 'pythia-160m')
    >>> ModelSpec.parse("safari:/ckpts/hyena-153m.ckpt").path
    PosixPath('/ckpts/hyena-153m.ckpt')
    """

    text: str  # as given
    prefix: str
    written: str  # everything after PREFIX:, as given
    target: str  # the hub id (without its revision) or the path
    revision: str | None
    is_hub: bool

    @classmethod
    def parse(cls, spec: str | ModelSpec) -> ModelSpec:
        if isinstance(spec, ModelSpec):
            return spec
        from ar_slicing.machinery import hub

        text = str(spec)
        prefix, sep, written = text.partition(":")
        found = checkpoint_format(prefix) if sep else None
        if found is None or not written:
            raise ArSliceError(
                f"model spec {text!r}: expected PREFIX:TARGET with PREFIX one of "
                f"{', '.join(f'{f.prefix}:' for f in formats())} (e.g. hf:EleutherAI/pythia-70m, "
                "native:runs/demo/models/transformer_pp)"
            )
        if not found.hub:
            return cls(text, prefix, written, written, None, False)
        name, revision = hub.split_revision(written)
        # owner/name ids only, unless the format also takes a bare one (hf: reads GPT-2's `gpt2`)
        is_hub = hub.is_hub_name(name) and (found.bare_hub_ids or name.count("/") == 1)
        if revision is not None and not is_hub:
            raise ArSliceError(f"{text}: a revision (@{revision}) applies to hub ids only")
        return cls(text, prefix, written, name, revision, is_hub)

    def __str__(self) -> str:
        return self.text

    @property
    def reads_hub(self) -> bool:
        """Whether the format may read a hub id (the target may still be a local path)."""
        return checkpoint_format(self.prefix).hub

    @property
    def path(self) -> Path | None:
        """The local file or folder the spec names; None for a hub id."""
        return None if self.is_hub else Path(self.target).expanduser()

    @property
    def default_name(self) -> str:
        """The model's name when none is given: `hf:EleutherAI/pythia-160m` -> `pythia-160m`,
        `native:runs/x/models/attn/` -> `attn`, `safari:/ckpts/hyena-153m.ckpt` -> `hyena-153m`."""
        import re

        last = [p for p in re.split(r"[/\\]", self.written) if p][-1:] or ["model"]
        name = last[0]
        for suffix in CHECKPOINT_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"

    def identity(self) -> dict:
        """What identifies the weights the spec names, cheaply (no weights are read): a
        checkpoint this project wrote by its meta.json's digest, other local files by size and
        modification time, a hub id by the commit its revision (default: the hub's default
        branch) resolves to, so a hub model that changed under the same name is a changed input."""
        from ar_slicing.machinery import hub
        from ar_slicing.machinery.layout import META_NAME
        from ar_slicing.machinery.plan import file_identity, identity

        if self.is_hub:
            commit = hub.resolve_commit(self.target, self.revision, self.text)
            return {"hub": self.target, "revision": self.revision, "commit": commit}
        path = self.path
        if not path.exists():
            return {"spec": self.text}
        if checkpoint_format(self.prefix).identified_by_meta and (path / META_NAME).is_file():
            return {self.prefix: identity(path)}  # {"native": the digest of its meta.json}
        return {"files": file_identity(path)}


def reads_hub_models(prefix: str) -> bool:
    """Whether specs of `prefix` may name a model on the hub (else only local paths)."""
    found = checkpoint_format(prefix)
    return found is not None and found.hub


def load_model(
    spec: str | ModelSpec,
    device="cpu",
    dtype=None,
    fast_path: bool = True,
    model_config=None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load the model named by `spec` (`PREFIX:TARGET`, read by the format registered for PREFIX)
    onto `device`, in eval mode.

    `dtype` (torch dtype or "bf16"/"fp32"/...) casts the weights; None keeps fp32. `fast_path`
    runs hf: RWKV and Mamba-1 checkpoints through this project's chunked RWKV and Mamba forwards
    instead of transformers' per-token loops (False: transformers' own forward).
    `model_config`: a config file to use instead of the one found with the checkpoint, for the
    formats that read one. `trust_remote_code` lets a checkpoint's own Python run (an hf: config
    with `auto_map`); without it such a checkpoint is refused and none of its code runs.
    """
    from ar_slicing.machinery import hub
    from models.precision import torch_dtype

    parsed = ModelSpec.parse(spec)
    spec, target, is_hub = parsed.text, parsed.target, parsed.is_hub
    commit = hub.resolve_commit(target, parsed.revision, spec) if is_hub else None
    dtype = torch_dtype(dtype)
    found = checkpoint_format(parsed.prefix)
    if model_config is not None and not found.model_config:
        takes = model_config_prefixes("and")
        others = [f"{f.prefix}:" for f in formats() if not f.model_config]
        raise ArSliceError(
            f"{spec}: a model config file (--model-config) applies to {takes} "
            f"checkpoints only; {_listed(others)} directories carry their own config.json"
        )
    request = LoadRequest(
        spec, target, is_hub, commit, device, dtype, fast_path, model_config, trust_remote_code
    )
    return found.load(request)


def fmt_params(n: Any) -> str:
    """A parameter count as tables print it (`1.2M`, `350K`; `?` when unknown)."""
    if n is None:
        return "?"
    n = float(n)
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n)}"


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
            or mixer in ("hyena", "long_conv", "implicit_long_conv")
            or (mixer == "base_conv" and long_conv)
            or (mixer == "h3" and kwargs.get("truncate_kernel"))
        ):
            limits.append(config.l_max)
    return min(limits) if limits else None


def wrap_language_model(
    model, spec: str, tokenizer_fingerprint: str | None, architecture: str | None = None
) -> LoadedModel:
    from models.mixers.prefix_linear_attention import prefix_scoring

    config = model.config
    # JRT's encoder reads ahead inside its prefix: such models score each position apart
    hidden_and_head, settings = prefix_scoring(model, spec) or (model.hidden_and_head, {})
    return LoadedModel(
        model=model,
        spec=spec,
        architecture=architecture or config.sequence_mixer,
        n_params=count_params(model),
        vocab_size=config.padded_vocab_size,
        max_positions=max_positions_of(config),
        tokenizer_fingerprint=tokenizer_fingerprint,
        settings=settings,
        _hidden_and_head=hidden_and_head,
    )


def loaded_language_model(
    model,
    request: LoadRequest,
    tokenizer_dir,
    settings: dict | None = None,
    architecture: str | None = None,
) -> LoadedModel:
    """A models.backbone `LanguageModel` a format has read, as `load_model` returns it: in eval
    mode on the request's device and dtype, with the tokenizer found in `tokenizer_dir`."""
    model.eval()
    if request.dtype is not None:
        model = model.to(device=request.device, dtype=request.dtype)
    else:
        model = model.to(request.device)
    loaded = wrap_language_model(
        model,
        request.spec,
        tokenizer_fingerprint=fingerprint_near(tokenizer_dir),
        architecture=architecture,
    )
    loaded.settings = {**loaded.settings, **(settings or {})}
    loaded.tokenizer_source = str(tokenizer_dir)
    loaded.hub_commit = request.commit
    return loaded


def fingerprint_near(path) -> str | None:
    """Fingerprint of a tokenizer stored with a checkpoint (tokenizer.json or transformers files)."""
    from ar_slicing.data.tokenizer import fingerprint, load_tokenizer

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
