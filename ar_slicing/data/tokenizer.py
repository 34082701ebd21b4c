"""Loading tokenizers from a file, a `transformers` directory or a hub name, and fingerprinting them.

The fingerprint is a sha256 over exactly what decides the encoding — model type, vocabulary,
merges, normalizer, pre-tokenizer and added/special tokens — in a canonical form, so the same
tokenizer saved by `tokenizers` or by `transformers` has one fingerprint, while a change to any
merge or normalisation rule gives another. Forms that encode alike are one form: merges as pairs
or strings, a BPE affix that is null or "" (the real GPT-NeoX and GPT-2 files say null;
transformers 5 re-saves them as ""), an empty Sequence normalizer or pre-tokenizer and none.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ar_slicing.errors import ArSliceError, TokenizerMismatch
from ar_slicing.machinery.layout import TOKENIZER_NAME

# Tried in order when a tokenizer does not say which token ends a document.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "<EOS>")
# Model fields that do not change the ids produced for a text.
_NON_ENCODING_MODEL_KEYS = {"dropout"}
# Model fields whose null and "" forms encode alike (an empty affix adds nothing to a subword).
_EMPTY_IS_NULL_MODEL_KEYS = ("continuing_subword_prefix", "end_of_word_suffix")
# Where a Sequence normalizer / pre-tokenizer keeps its parts; with none it changes nothing.
_SEQUENCE_PARTS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers"}


def load_tokenizer(spec: str | Path):
    """A `tokenizers.Tokenizer` from a `tokenizer.json` path, a tokenizer directory or a hub name."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ArSliceError(f"{path}: not a readable tokenizer.json ({e})") from None
    if path.is_dir():
        if (path / TOKENIZER_NAME).is_file():
            return load_tokenizer(path / TOKENIZER_NAME)
        return _from_transformers(str(path))
    if str(spec).endswith(".json") or "/" in str(spec) and str(spec).startswith((".", "/")):
        raise ArSliceError(f"tokenizer {spec}: no such file or directory")
    return _from_transformers(str(spec))


def _from_transformers(name: str):
    from ar_slicing.machinery import hub

    if hub.is_hub_name(name):
        hub.require([(f"tokenizer {name!r}", name, "model")])
    try:
        from transformers import AutoTokenizer

        # (never a tokenizer's own Python: told so, transformers neither runs it nor asks)
        tok = AutoTokenizer.from_pretrained(
            name, use_fast=True, trust_remote_code=False, **hub.files_only()
        )
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ArSliceError(
            f"tokenizer {name!r}: could not load it as a local directory or hub name ({first}). "
            "Pass a tokenizer.json file, a directory saved by transformers, or a reachable hub id."
        ) from None
    if not getattr(tok, "is_fast", False):
        raise ArSliceError(f"tokenizer {name!r} has no fast (tokenizers) implementation")
    return tok.backend_tokenizer


def _canonical_merges(merges) -> list[str]:
    # tokenizers >= 0.20 saves merges as [a, b] pairs, older versions as "a b" strings.
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def encoding_spec(tokenizer) -> dict:
    """The parts of a tokenizer's JSON that decide its encoding, in canonical form."""
    data = json.loads(tokenizer.to_str())
    model = {k: v for k, v in data.get("model", {}).items() if k not in _NON_ENCODING_MODEL_KEYS}
    for key in _EMPTY_IS_NULL_MODEL_KEYS:
        if model.get(key) == "" and model.get("type") == "BPE":
            model[key] = None
    if "merges" in model and model["merges"] is not None:
        model["merges"] = _canonical_merges(model["merges"])
    if isinstance(model.get("vocab"), dict):
        model["vocab"] = sorted(model["vocab"].items(), key=lambda kv: (kv[1], kv[0]))
    added = sorted(
        (t["id"], t["content"], bool(t.get("special", False)))
        for t in data.get("added_tokens", []) or []
    )
    return {
        "model": model,
        "normalizer": _none_if_empty(data.get("normalizer"), _SEQUENCE_PARTS["normalizer"]),
        "pre_tokenizer": _none_if_empty(
            data.get("pre_tokenizer"), _SEQUENCE_PARTS["pre_tokenizer"]
        ),
        "added_tokens": added,
    }


def _none_if_empty(component, parts: str):
    """None for a Sequence of no parts (it changes nothing), else the component as it is."""
    if isinstance(component, dict) and component.get("type") == "Sequence":
        if not component.get(parts):
            return None
    return component


def fingerprint(tokenizer) -> str:
    """sha256 (hex) of `encoding_spec(tokenizer)`."""
    blob = json.dumps(encoding_spec(tokenizer), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def special_token_ids(spec: str | Path) -> dict[str, int | None]:
    """The BOS and EOS ids a transformers tokenizer declares — a directory with
    tokenizer_config.json or special_tokens_map.json, or a hub name — as `bos_token_id`,
    `eos_token_id`; {} where none is declared (a bare tokenizer.json names no BOS)."""
    path = Path(spec)
    if path.is_file():
        path = path.parent
    if path.is_dir():
        declared = ("tokenizer_config.json", "special_tokens_map.json")
        if not any((path / name).is_file() for name in declared):
            return {}
        spec = str(path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(spec), trust_remote_code=False)
    except Exception:  # unreadable or unreachable: nothing declared that we can see
        return {}
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        **encode_added_tokens(tok),
    }


def encode_added_tokens(tok) -> dict[str, list[int]]:
    """The ids a transformers tokenizer's `encode(text)` adds before and after the text by default
    (`add_special_tokens=True`): `encode_prefix` [BOS] for Llama's `add_bos_token=True`, [] for
    GPT-2's; `encode_suffix` likewise (e.g. `add_eos_token=True`); None when the text's own
    tokens differ between the two encodings, so what was added cannot be told apart."""
    probe = "a b"
    plain = tok.encode(probe, add_special_tokens=False)
    full = tok.encode(probe)
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return {"encode_prefix": full[:i], "encode_suffix": full[i + len(plain) :]}
    return {"encode_prefix": None, "encode_suffix": None}  # the text itself encodes otherwise


def eos_id(tokenizer, eos_token: str | None = None) -> int:
    """The id that ends a document: `eos_token` if given, else the first known EOS token present."""
    candidates = (eos_token,) if eos_token else EOS_CANDIDATES
    for tok in candidates:
        tid = tokenizer.token_to_id(tok)
        if tid is not None:
            return tid
    raise ArSliceError(
        f"the tokenizer has no end-of-document token (looked for {', '.join(candidates)}); "
        "pass --eos-token with the token that separates documents"
    )


def describe(tokenizer, name: str, eos_token: str | None = None) -> dict:
    """What a store's `meta.json` records about its tokenizer."""
    return {
        "name": str(name),
        "fingerprint": fingerprint(tokenizer),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eos_id": eos_id(tokenizer, eos_token),
    }


def require_same_fingerprint(a: str, what_a: str, b: str, what_b: str) -> None:
    """Refuse to combine artefacts of two tokenizers, naming both."""
    if a != b:
        raise TokenizerMismatch(
            f"tokenizer mismatch: {what_a} was made with tokenizer {a[:12]}… but {what_b} with "
            f"{b[:12]}…; they cannot be combined. Re-run the earlier stage with the same tokenizer."
        )
