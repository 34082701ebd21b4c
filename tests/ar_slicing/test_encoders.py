"""The tiktoken backend of `arslice tokenize`: the same token stream as `tokenizers`, or refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ar_slicing.data.encoders import TokenizersEncoder, select_encoder, tiktoken_for
from ar_slicing.errors import ArSliceError

pytest.importorskip("tiktoken")

EDGE_CASES = [
    "first line\r\nsecond line\r\n\r\nthird\rfourth\n",
    "emoji 😀 👍🏽 👨‍👩‍👧 🇫🇷 mixed with text😀and no spaces",
    "before<|endoftext|>after <|endoftext|> <|endoftext|><|endoftext|>",
    "          ten spaces, then tabs\t\t\t\tand newlines\n\n\n\n   \n \u00a0\u3000 end   ",
    "don't I'll we've they're she'd 'quoted' ''' \"double\"",
    "",
]


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "meta": {"pile_set_name": "Github"}}) + "\n")
        # a lone surrogate, as a JSON escape: the reader replaces it before encoding
        f.write(
            '{"text": "lone \\ud800 surrogate \\udfff here", "meta": {"pile_set_name": "Pile-CC"}}\n'
        )
    return path


def tokenize(source, tokenizer, out, encoder):
    from pipeline.tokenize import TokenizeConfig, run_tokenize

    run_tokenize(
        TokenizeConfig(
            source=[str(source)],
            tokenizer=str(tokenizer),
            out=str(out),
            workers=2,
            encoder=encoder,
            shard_docs=7,
        )
    )
    return out


def test_tiktoken_stream_equals_tokenizers_stream(tmp_path, stdlib_texts, bpe_tokenizer_path):
    """Real text plus the edge cases through the whole stage: byte-identical stores."""
    source = write_jsonl(tmp_path / "docs.jsonl", [*stdlib_texts, *EDGE_CASES])
    slow = tokenize(source, bpe_tokenizer_path, tmp_path / "slow", "tokenizers")
    fast = tokenize(source, bpe_tokenizer_path, tmp_path / "fast", "tiktoken")
    auto = tokenize(source, bpe_tokenizer_path, tmp_path / "auto", "auto")
    tokens = (slow / "tokens.bin").read_bytes()
    assert len(tokens) > 100_000
    assert (fast / "tokens.bin").read_bytes() == tokens == (auto / "tokens.bin").read_bytes()
    assert (fast / "docs.parquet").read_bytes() == (slow / "docs.parquet").read_bytes()
    metas = {d.name: json.loads((d / "meta.json").read_text()) for d in (slow, fast, auto)}
    assert [metas[n]["encoder"]["backend"] for n in ("slow", "fast", "auto")] == [
        "tokenizers",
        "tiktoken",
        "tiktoken",
    ]
    assert metas["fast"]["counts"]["eos_in_text"] == 4  # the literal EOS strings, one id each
    assert metas["fast"]["counts"]["invalid_utf8"] == 1  # the lone surrogates, replaced


def test_tokenizers_outside_the_gpt2_family_keep_their_own_encoder(tmp_path, bpe_tokenizer_path):
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(str(bpe_tokenizer_path))
    assert select_encoder(tok, "auto")[0].name == "tiktoken"
    tok.normalizer = normalizers.NFKC()  # tiktoken has no normalizer
    encoder, why = select_encoder(tok, "auto")
    assert encoder.name == "tokenizers" and "normalizer" in why
    with pytest.raises(ArSliceError, match="--encoder tiktoken: cannot reproduce.*normalizer"):
        select_encoder(tok, "tiktoken")
    with pytest.raises(ArSliceError, match="--encoder 'fast'"):
        select_encoder(tok, "fast")


def test_two_merges_of_one_token_are_refused(bpe_tokenizer_path):
    """A token made by two merges ("ab" + "c" and "a" + "bc"): tiktoken ranks tokens, not pairs."""
    from tokenizers import Tokenizer

    data = json.loads(bpe_tokenizer_path.read_text())
    vocab = data["model"]["vocab"]
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]
    ]
    other = next(
        (w[:k], w[k:])
        for w in (a + b for a, b in merges)
        for k in range(1, len(w))
        if w[:k] in vocab and w[k:] in vocab and (w[:k], w[k:]) not in merges
    )
    data["model"]["merges"].append(list(other))
    tok = Tokenizer.from_str(json.dumps(data))
    encoder, why = tiktoken_for(tok)
    assert encoder is None and "two merges make the token" in why
    assert select_encoder(tok, "auto")[0].name == "tokenizers"


def test_a_difference_on_the_sampled_documents_stops_the_run(bpe_tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_tokenizer_path))
    encoder, _ = tiktoken_for(tok)
    texts = ["def f(x):\n    return x\n"] * 300
    want = TokenizersEncoder(tok).encode_batch(texts)
    got = encoder.encode_batch(texts)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    encoder.rank_to_id = np.roll(encoder.rank_to_id, 1)  # a wrong mapping of ranks to ids
    with pytest.raises(ArSliceError, match="differently from the tokenizer"):
        encoder.encode_batch(texts)
