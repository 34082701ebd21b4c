"""Encoding backends of the tokenize stage: `tokenizers` itself, or `tiktoken` for GPT-2-family BPEs.

A byte-level BPE with GPT-2's pre-tokenizer (the GPT-2, GPT-NeoX and Pythia tokenizers, and
those `tokenizers` trains with `ByteLevel`) can be run by tiktoken, ~5x faster per core: its
`Encoding` is built here from the tokenizer's own vocabulary and merges (no download). tiktoken
ranks a token by the merge that made it and returns ranks, which a table maps back to the
tokenizer's ids. tiktoken merges by the rank of the merged bytes where `tokenizers` merges by the
rank of the pair, which agree for such vocabularies but are not guaranteed to, so tiktoken is only
chosen (`select_encoder`) when the tokenizer's JSON has exactly this shape and both encode the
probe texts (real text and the edge cases: CRLF, emoji, replacement characters, the EOS string in
text, whitespace runs) identically; the encoder also re-encodes a sample of every batch with
`tokenizers` and stops on any difference.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache

import numpy as np

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tokenizers", "tiktoken")
# GPT-2's pre-tokenizer regex (`tokenizers`' ByteLevel with use_regex, and tiktoken's "gpt2")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Every SAMPLE_EVERY-th document of a shard encoded by tiktoken is checked against tokenizers.
SAMPLE_EVERY = 256
PROBES = (
    "Hello world! It's   a test.\r\nSecond line\r\n\r\n\tTabbed\t\tend  ",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and é, ñ, 中文, Ελληνικά, русский",
    "a\ufffdb\ufffd\ufffd replacement characters (lone surrogates after reading)",
    "text<|endoftext|>more <|endoftext|> <|endoftext|><|endoftext|>end",
    "     leading spaces and trailing     \n\n\n   \t \u00a0\u2003 unicode spaces   ",
    "numbers 1234567890 3.14159 1e-10 0x1F 1,000,000 and I'm you're we've they'll he'd",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\nclass C:\n\tpass\n",
    "",
    " ",
    "\n",
)


class TokenizersEncoder:
    """`tokenizers`' own batched encoder (no special tokens added)."""

    name = "tokenizers"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_batch(self, texts: list[str]) -> list:
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]


class TiktokenEncoder:
    """tiktoken with the tokenizer's vocabulary; ids as the tokenizer numbers them."""

    name = "tiktoken"

    def __init__(self, encoding, rank_to_id: np.ndarray, special: set[str], reference):
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self.special = special
        self.reference = TokenizersEncoder(reference)

    def encode_batch(self, texts: list[str], check: bool = True) -> list:
        """The texts' ids; with `check`, every SAMPLE_EVERY-th text is also encoded by the
        tokenizer itself, and any difference stops the run."""
        encode, special = self.encoding.encode, self.special
        ids = [self.rank_to_id[encode(t, allowed_special=special)] for t in texts]
        if check:
            picked = range(0, len(texts), SAMPLE_EVERY)
            want = self.reference.encode_batch([texts[i] for i in picked])
            for i, w in zip(picked, want):
                if not np.array_equal(ids[i], w):
                    raise ArSliceError(
                        f"tiktoken encoded a document ({texts[i][:40]!r}...) differently from "
                        "the tokenizer; rerun with --encoder tokenizers"
                    )
        return ids


def tiktoken_for(tokenizer) -> tuple[TiktokenEncoder | None, str]:
    """A tiktoken encoder built from the tokenizer, or None and why it cannot be one."""
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    data = json.loads(tokenizer.to_str())
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return None, f"a {model.get('type')} model, not BPE"
    if data.get("normalizer") is not None:
        return None, "it has a normalizer"
    if pre != {**pre, "type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
        return None, "its pre-tokenizer is not GPT-2's byte-level split"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "unk_token"):
        if model.get(key):
            return None, f"its BPE sets {key}"
    if model.get("byte_fallback") or model.get("ignore_merges"):
        return None, "its BPE uses byte_fallback or ignore_merges"
    added = data.get("added_tokens") or []
    if any(
        not t.get("special") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
        for t in added
    ):
        return None, "it has added tokens that are not plain special tokens"
    to_byte = {c: b for b, c in zip(range(256), map(chr, _byte_order_codes()))}
    vocab = model["vocab"]
    try:
        ranks = {bytes([b]): b for b in range(256)}
        for i, merge in enumerate(model.get("merges") or []):
            a, b = merge.split(" ") if isinstance(merge, str) else merge
            key = bytes(to_byte[c] for c in a + b)
            if key in ranks:
                return None, f"two merges make the token {a + b!r}"
            ranks[key] = 256 + i
        specials = {t["content"] for t in added}
        ids = {bytes(to_byte[c] for c in t): i for t, i in vocab.items() if t not in specials}
    except KeyError:
        return None, "its vocabulary is not written in GPT-2's byte alphabet"
    if set(ids) != set(ranks):
        return None, "its vocabulary is not exactly the bytes and the merges' results"
    special = {t["content"]: len(ranks) + k for k, t in enumerate(added)}
    rank_to_id = np.zeros(len(ranks) + len(special), np.int64)
    for token, rank in ranks.items():
        rank_to_id[rank] = ids[token]
    for k, t in enumerate(added):
        rank_to_id[len(ranks) + k] = t["id"]
    encoding = tiktoken.Encoding(
        "arslice", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special
    )
    return TiktokenEncoder(encoding, rank_to_id, set(special), tokenizer), ""


@lru_cache(maxsize=1)
def _byte_order_codes() -> tuple[int, ...]:
    """The character code of each byte 0..255 in GPT-2's byte alphabet."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    codes = dict(zip(bs, bs))
    n = 0
    for b in range(256):
        if b not in codes:
            codes[b] = 256 + n
            n += 1
    return tuple(codes[b] for b in range(256))


def same_ids(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)
    )


def select_encoder(tokenizer, choice: str, probes=()) -> tuple[object, str]:
    """The encoder to use and why: tiktoken for "auto" when it reproduces the tokenizer on the
    probe texts (and `probes`), else tokenizers; "tiktoken" refuses where it would not."""
    if choice not in BACKENDS:
        raise ArSliceError(f"--encoder {choice!r}: choose one of {', '.join(BACKENDS)}")
    reference = TokenizersEncoder(tokenizer)
    if choice == "tokenizers":
        return reference, "asked for"
    fast, why = tiktoken_for(tokenizer)
    texts = [*PROBES, *probes]
    if fast is not None and not same_ids(
        fast.encode_batch(texts, check=False), reference.encode_batch(texts)
    ):
        fast, why = None, "it encodes the probe texts differently"
    if fast is None:
        if choice == "tiktoken":
            raise ArSliceError(
                f"--encoder tiktoken: cannot reproduce this tokenizer ({why}); use --encoder tokenizers"
            )
        return reference, f"tiktoken cannot reproduce this tokenizer: {why}"
    return fast, "reproduces the tokenizer on the probe texts"
