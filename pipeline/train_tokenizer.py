"""`arslice train-tokenizer`: a byte-level BPE (GPT-2 style) trained by `tokenizers` on text sources.

The demo trains its own tokenizer on the training part of the Python standard library, so the
whole pipeline runs with no download. The result is a plain `tokenizer.json` with
`<|endoftext|>` as its only special token (id 0), the end-of-document id every later stage uses.
Training reads the documents in source order and is deterministic: the same sources and options
give the same file, byte for byte.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.io import atomic_path
from ar_slicing.readers import ReadStats, iter_documents
from pipeline.config import Command, glob_option, on_bad_record_option, text_field_option

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TrainTokenizerConfig:
    source: list[str] = field(metadata={"help": "text sources, as for `arslice tokenize`"})
    out: str = field(metadata={"help": "tokenizer.json to write"})
    vocab_size: int = field(
        metadata={"help": "vocabulary size, special token and 256 bytes included"}
    )
    glob: str = glob_option()
    text_field: str = text_field_option()
    on_bad_record: str = on_bad_record_option()
    split_fraction: float | None = field(
        default=None, metadata={"help": "with --split-part: train on one deterministic part only"}
    )
    split_part: str | None = field(
        default=None,
        metadata={"help": "part to train on (normally train)", "choices": ["train", "val"]},
    )
    max_docs: int | None = field(
        default=None, metadata={"help": "train on at most this many documents"}
    )
    min_frequency: int = field(
        default=2, metadata={"help": "merges of pairs seen fewer times are not learned"}
    )
    overwrite: bool = field(default=False, metadata={"help": "replace an existing tokenizer file"})


def build_bpe_tokenizer():
    """An untrained GPT-2-style byte-level BPE: no normalizer, byte-level pre-tokenizer and decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(texts, vocab_size: int, min_frequency: int = 2):
    """Train `build_bpe_tokenizer()` on an iterable of strings."""
    from tokenizers import pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ArSliceError(
            f"--vocab-size {vocab_size} is too small: the byte alphabet and {EOS_TOKEN} need {len(alphabet) + 1}"
        )
    tok = build_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def run_train_tokenizer(cfg: TrainTokenizerConfig) -> dict:
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        print(f"train-tokenizer: {out} exists; pass --overwrite to retrain it")
        return {"out": str(out), "skipped": True}
    t0 = time.time()
    stats = ReadStats()
    docs = iter_documents(
        cfg.source,
        text_field=cfg.text_field,
        glob=cfg.glob,
        on_bad_record=cfg.on_bad_record,
        split_fraction=cfg.split_fraction,
        split_part=cfg.split_part,
        max_docs=cfg.max_docs,
        stats=stats,
    )
    # Streamed: the trainer only counts words, so memory stays that of the word counts.
    tok = train_bpe((d.text for d in docs), cfg.vocab_size, cfg.min_frequency)
    if stats.documents == 0:
        raise ArSliceError(
            f"no documents to train on in {', '.join(cfg.source)} (check --glob and --split-*)"
        )
    with atomic_path(out) as tmp:
        tok.save(str(tmp), pretty=True)
    from ar_slicing.tokenizer import fingerprint

    summary = {
        "out": str(out),
        "skipped": False,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_id": tok.token_to_id(EOS_TOKEN),
        "fingerprint": fingerprint(tok),
        "documents": stats.documents,
        "bytes": stats.bytes,
        "bad_records": stats.bad_records,
        "empty": stats.empty,
        "wall_time_s": time.time() - t0,
    }
    print(
        f"train-tokenizer: vocabulary {summary['vocab_size']} from {stats.documents:,} docs "
        f"({stats.bytes / 1e6:.1f} MB) -> {out} (fingerprint {summary['fingerprint'][:12]}) "
        f"in {summary['wall_time_s']:.1f}s"
    )
    return summary


COMMAND = Command(
    TrainTokenizerConfig,
    run_train_tokenizer,
    summary="train a byte-level BPE tokenizer on text sources",
    examples="""
  arslice train-tokenizer --source /usr/lib/python3.11 --glob '**/*.py' --split-fraction 0.1 \\
      --split-part train --vocab-size 4096 --out runs/demo/tokenizer.json
  arslice train-tokenizer --source train.jsonl.zst --vocab-size 50257 --max-docs 100000 --out tokenizer.json""",
)
