"""The tokenizer fingerprint: one value for one encoding, however the tokenizer was saved; another
value as soon as anything that decides the encoding changes."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, normalizers

from ar_slicing.data.store import TokenStore
from ar_slicing.data.tokenizer import encoding_spec, fingerprint, load_tokenizer
from pipeline.tokenize import TokenizeConfig, run_tokenize

SAMPLE = "def  main(argv):\n    return {'x': 1}  # café\n"


def edited(tokenizer: Tokenizer, edit) -> Tokenizer:
    data = json.loads(tokenizer.to_str())
    edit(data)
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory, bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer, eos_token="<|endoftext|>")
    out = tmp_path_factory.mktemp("hf_tokenizer")
    wrapped.save_pretrained(str(out))
    return out


def test_same_tokenizer_saved_by_tokenizers_and_transformers(bpe_tokenizer_path, transformers_dir):
    from transformers import AutoTokenizer

    from_file = load_tokenizer(bpe_tokenizer_path)
    from_dir = load_tokenizer(transformers_dir)
    via_transformers = AutoTokenizer.from_pretrained(str(transformers_dir)).backend_tokenizer
    assert fingerprint(from_file) == fingerprint(from_dir) == fingerprint(via_transformers)
    # and they really are one encoding
    assert from_file.encode(SAMPLE).ids == via_transformers.encode(SAMPLE).ids


def test_stores_made_from_either_copy_share_a_fingerprint(
    tmp_path, bpe_tokenizer_path, transformers_dir
):
    (tmp_path / "a.txt").write_text(SAMPLE)
    for name, tok in (("file", bpe_tokenizer_path), ("dir", transformers_dir)):
        cfg = TokenizeConfig(
            source=[str(tmp_path / "a.txt")],
            tokenizer=str(tok),
            out=str(tmp_path / name),
            workers=1,
        )
        run_tokenize(cfg)
    a, b = TokenStore.open(tmp_path / "file"), TokenStore.open(tmp_path / "dir")
    assert a.fingerprint == b.fingerprint
    assert (tmp_path / "file" / "tokens.bin").read_bytes() == (
        tmp_path / "dir" / "tokens.bin"
    ).read_bytes()


def test_serialisation_details_do_not_matter(tmp_path, bpe_tokenizer):
    base = fingerprint(bpe_tokenizer)
    # pretty vs compact JSON
    compact = tmp_path / "compact.json"
    bpe_tokenizer.save(str(compact), pretty=False)
    assert fingerprint(load_tokenizer(compact)) == base

    # merges in the older "a b" string form that tokenizers < 0.20 wrote
    def legacy_merges(d):
        d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]

    assert fingerprint(edited(bpe_tokenizer, legacy_merges)) == base
    # padding and truncation settings change batch shapes, not the ids of a text
    padded = Tokenizer.from_str(bpe_tokenizer.to_str())
    padded.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    padded.enable_truncation(512)
    assert fingerprint(padded) == base


def test_one_changed_merge_changes_the_fingerprint(bpe_tokenizer):
    def swap_first_merges(d):
        merges = d["model"]["merges"]
        merges[0], merges[1] = merges[1], merges[0]

    changed = edited(bpe_tokenizer, swap_first_merges)
    assert fingerprint(changed) != fingerprint(bpe_tokenizer)

    def drop_last_merge(d):
        d["model"]["merges"].pop()

    assert fingerprint(edited(bpe_tokenizer, drop_last_merge)) != fingerprint(bpe_tokenizer)


def test_normalizer_pretokenizer_and_special_tokens_count(bpe_tokenizer):
    base = fingerprint(bpe_tokenizer)
    nfkc = Tokenizer.from_str(bpe_tokenizer.to_str())
    nfkc.normalizer = normalizers.NFKC()
    assert fingerprint(nfkc) != base

    def prefix_space(d):
        d["pre_tokenizer"]["add_prefix_space"] = True

    spaced = edited(bpe_tokenizer, prefix_space)
    assert spaced.encode("x = 1").ids != bpe_tokenizer.encode("x = 1").ids
    assert fingerprint(spaced) != base
    extra = Tokenizer.from_str(bpe_tokenizer.to_str())
    extra.add_special_tokens(["<|pad|>"])
    assert fingerprint(extra) != base


# ---- forms that encode alike ---------------------------------------------------------------------


def shaped_like(kind: str, texts: list[str]) -> Tokenizer:
    """A BPE built by `tokenizers` with the components of the real GPT-NeoX (20B_tokenizer.json) or
    GPT-2 tokenizer.json: byte-level pre-tokenizer and decoder, null affixes; NeoX adds NFC, a
    byte-level post-processor and its padding token."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"]
    if kind == "neox":
        tok.normalizer = normalizers.NFC()
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
        special.append("<|padding|>")
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@pytest.mark.parametrize("kind", ["neox", "gpt2"])
def test_null_and_empty_affixes_are_one_tokenizer(tmp_path, stdlib_texts, kind):
    tok = shaped_like(kind, stdlib_texts[:8])
    data = json.loads(tok.to_str())
    assert data["model"]["continuing_subword_prefix"] is None
    assert data["model"]["end_of_word_suffix"] is None
    tok.save(str(tmp_path / "null.json"))

    def empty_affixes(d):  # as transformers 5 re-saves them
        d["model"]["continuing_subword_prefix"] = ""
        d["model"]["end_of_word_suffix"] = ""

    empty = edited(tok, empty_affixes)
    empty.save(str(tmp_path / "empty.json"))
    a, b = load_tokenizer(tmp_path / "null.json"), load_tokenizer(tmp_path / "empty.json")
    assert json.loads(b.to_str())["model"]["end_of_word_suffix"] == ""  # really written that way
    assert a.encode(SAMPLE).ids == b.encode(SAMPLE).ids
    assert fingerprint(a) == fingerprint(b)

    def suffix(d):  # a real suffix is another encoding
        d["model"]["end_of_word_suffix"] = "</w>"

    assert fingerprint(edited(tok, suffix)) != fingerprint(a)


@pytest.mark.parametrize("kind, cls", [("neox", "GPTNeoXTokenizer"), ("gpt2", "GPT2Tokenizer")])
def test_transformers_resaved_directory_has_the_files_fingerprint(
    tmp_path, stdlib_texts, kind, cls
):
    import transformers
    from transformers import AutoTokenizer

    shaped_like(kind, stdlib_texts[:8]).save(str(tmp_path / "tokenizer.json"))
    wrapper = getattr(transformers, cls)(
        tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    wrapper.save_pretrained(tmp_path / "first")
    AutoTokenizer.from_pretrained(str(tmp_path / "first")).save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "tokenizer.json").read_text())
    assert resaved["model"]["continuing_subword_prefix"] == ""  # how transformers writes it
    assert fingerprint(load_tokenizer(tmp_path / "resaved")) == fingerprint(
        load_tokenizer(tmp_path / "tokenizer.json")
    )


def test_an_empty_sequence_is_no_normalizer(bpe_tokenizer):
    def empty_sequence(d):
        d["normalizer"] = {"type": "Sequence", "normalizers": []}
        d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [d["pre_tokenizer"]]}

    wrapped = edited(bpe_tokenizer, empty_sequence)
    assert wrapped.encode(SAMPLE).ids == bpe_tokenizer.encode(SAMPLE).ids
    # an empty normalizer Sequence is none; a pre-tokenizer wrapped in a Sequence is kept as such
    assert encoding_spec(wrapped)["normalizer"] is None
    assert encoding_spec(wrapped)["pre_tokenizer"]["type"] == "Sequence"
