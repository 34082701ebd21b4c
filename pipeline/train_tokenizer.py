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

from ar_slicing.data.readers import ReadStats, check_sources, check_split_options
from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import atomic_path
from pipeline.config import (
    READER_FIELDS,
    Command,
    glob_option,
    normalize_glob,
    on_bad_record_option,
    read_documents,
    text_field_option,
)
from pipeline.stage import Finished
from pipeline.wiring import TOKENIZER, Fanned, Run, Table, Wiring, per_store

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TrainTokenizerConfig:
    source: list[str] = field(metadata={"help": "text sources, as for `arslice tokenize`"})
    out: str = field(metadata={"help": "tokenizer.json to write"})
    vocab_size: int = field(
        metadata={"help": "vocabulary size, special token and 256 bytes included"}
    )
    glob: list[str] = glob_option()
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

    def __post_init__(self):
        normalize_glob(self)


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


def validate_train_tokenizer(cfg: TrainTokenizerConfig) -> None:
    check_sources(list(cfg.source))
    check_split_options(cfg.split_fraction, cfg.split_part)
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise ArSliceError(f"--max-docs {cfg.max_docs}: must be at least 1")
    if cfg.min_frequency < 1:
        raise ArSliceError(f"--min-frequency {cfg.min_frequency}: must be at least 1")


def train_tokenizer_settings(cfg: TrainTokenizerConfig) -> dict:
    keys = ("vocab_size", "glob", "text_field", "split_fraction", "split_part", "max_docs")
    return {
        "sources": [str(s) for s in cfg.source],
        "min_frequency": cfg.min_frequency,
        **{k: getattr(cfg, k) for k in keys},
    }


def run_train_tokenizer(cfg: TrainTokenizerConfig) -> dict:
    from ar_slicing.machinery.plan import StagePlan
    from pipeline.stage import run_stage
    from pipeline.tokenize.shards import source_identity

    validate_train_tokenizer(cfg)
    out = Path(cfg.out)
    plan = StagePlan(
        "train-tokenizer",
        settings=train_tokenizer_settings(cfg),
        inputs={"sources": [source_identity(s, cfg.glob) for s in cfg.source]},
    )
    return run_stage(
        "train-tokenizer",
        out,
        plan,
        lambda stage, _: _train(stage, cfg),
        overwrite=cfg.overwrite,
        single_file=True,
        skipped=lambda meta: {"out": str(out), "skipped": True},
    )


def _train(stage, cfg: TrainTokenizerConfig) -> Finished:
    from ar_slicing.data.tokenizer import fingerprint
    from ar_slicing.machinery.io import build_meta

    out = stage.out
    t0 = time.time()
    stats = ReadStats()
    docs = read_documents(cfg, stats)
    # Streamed: the trainer only counts words, so memory stays that of the word counts.
    tok = train_bpe((d.text for d in docs), cfg.vocab_size, cfg.min_frequency)
    if stats.documents == 0:
        raise ArSliceError(
            f"no documents to train on in {', '.join(cfg.source)} (check --glob and --split-*)"
        )
    with atomic_path(out) as tmp:
        tok.save(str(tmp), pretty=True)
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
    meta = build_meta(
        "train-tokenizer",
        config=cfg,
        inputs=stage.plan["inputs"],
        counts=stats.as_counts(),
        wall_time_s=summary["wall_time_s"],
        skipped={"bad_records": stats.bad_records, "empty": stats.empty},
        fingerprint=summary["fingerprint"],
        vocab_size=summary["vocab_size"],
        eos_id=summary["eos_id"],
    )
    line = (
        f"train-tokenizer: vocabulary {summary['vocab_size']} from {stats.documents:,} docs "
        f"({stats.bytes / 1e6:.1f} MB) -> {out} (fingerprint {summary['fingerprint'][:12]}) "
        f"in {summary['wall_time_s']:.1f}s"
    )
    return Finished(meta, [line], summary)


# ---- in a pipeline config: [tokenizer] ---------------------------------------------------------


def corpus_of_the_training_store(run: Run) -> dict:
    """What [tokenize] reads into the training store (its sources, patterns, split): what a
    trained [tokenizer] that names no corpus of its own learns from."""
    values = dict(run.config.get("tokenize", {}))
    tokenize = Fanned(run.config, run.path, run.layout, "tokenize", values)
    (train,) = [t.values for t in per_store(tokenize) if t.name == "train"]
    keys = ("source", *(k for k in READER_FIELDS if k != "split_part"))
    out = {k: train[k] for k in keys if k in train}
    if "split_fraction" in out:
        out["split_part"] = "train"
    return out


def _defaults(run: Run, table: Table) -> dict:
    defaults = {"out": run.layout.tokenizer}
    if "source" not in table.values:
        defaults.update(corpus_of_the_training_store(run))
    return defaults


def _copy_or_train(table: Table, where: str):
    """`[tokenizer] pretrained = NAME` copies a tokenizer instead of training one."""
    from pipeline import copy_tokenizer

    return copy_tokenizer.COMMAND if copy_tokenizer.pretrained_table(table.values, where) else None


COMMAND = Command(
    TrainTokenizerConfig,
    run_train_tokenizer,
    validate=validate_train_tokenizer,
    plan_settings=train_tokenizer_settings,
    summary="train a byte-level BPE tokenizer on text sources",
    examples="""
  STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  arslice train-tokenizer --source "$STDLIB" --glob '*.py' --split-fraction 0.1 \\
      --split-part train --vocab-size 2048 --out runs/demo/tokenizer.json
  arslice train-tokenizer --source train.jsonl.zst --vocab-size 50257 --max-docs 100000 --out tokenizer.json""",
    pipeline=Wiring(
        table="tokenizer", writes=TOKENIZER, defaults=_defaults, variant=_copy_or_train
    ),
)
