"""`arslice tokenize` as a stage: text sources or pre-tokenized files, and the command."""

from __future__ import annotations

from ar_slicing.errors import ArSliceError
from ar_slicing.readers import check_sources, check_split_options, is_pretokenized
from pipeline.config import Command
from pipeline.tokenize.config import PARTS_FORMAT, PLAN_KEYS, TokenizeConfig
from pipeline.tokenize.imports import run_import
from pipeline.tokenize.shards import source_identity
from pipeline.tokenize.text import run_text


def validate_tokenize(cfg: TokenizeConfig) -> None:
    """Everything checkable before reading a source: the options, and that every local source
    exists (an empty `--source ""` would otherwise mean the current directory)."""
    sources = list(cfg.source)
    check_sources(sources)
    kinds = {is_pretokenized(s, cfg.source_format) for s in sources}
    if len(kinds) > 1:
        raise ArSliceError(
            "cannot mix text sources and pre-tokenized files in one store; tokenize them into "
            "separate stores"
        )
    if cfg.shard_docs < 1 or cfg.shard_mb <= 0:
        raise ArSliceError("--shard-docs and --shard-mb must be positive")
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise ArSliceError(f"--max-docs {cfg.max_docs}: must be at least 1")
    if cfg.workers < 0:
        raise ArSliceError(f"--workers must be >= 0 (0 = all cores), got {cfg.workers}")
    check_split_options(cfg.split_fraction, cfg.split_part)


def tokenize_settings(cfg: TokenizeConfig) -> dict:
    """What decides the store's bytes besides the sources' contents and the tokenizer.

    `on_bad_record` is left out on purpose: the shards finished before a run stopped at a bad
    record hold the same documents under `--on-bad-record skip`, so that rerun resumes."""
    keys = (*PLAN_KEYS, "source_format", "eos_token", "vocab_size", "eos_id", "shard_by_file")
    return {
        "sources": [str(s) for s in cfg.source],
        **{k: getattr(cfg, k) for k in keys},
        "parts_format": PARTS_FORMAT,
    }


def run_tokenize(cfg: TokenizeConfig) -> dict:
    from ar_slicing.plan import StagePlan, open_stage

    validate_tokenize(cfg)

    def open_store_stage(tokenizer_info: dict):
        """The stage plan once the tokenizer is known (its fingerprint decides the ids)."""
        plan = StagePlan(
            "tokenize",
            settings=tokenize_settings(cfg),
            inputs={
                "tokenizer": tokenizer_info["fingerprint"],
                "sources": [source_identity(s, cfg.glob) for s in cfg.source],
            },
        )
        return open_stage(cfg.out, plan, overwrite=cfg.overwrite)

    if is_pretokenized(cfg.source[0], cfg.source_format):
        return run_import(cfg, open_store_stage)
    return run_text(cfg, open_store_stage)


COMMAND = Command(
    TokenizeConfig,
    run_tokenize,
    validate=validate_tokenize,
    plan_settings=tokenize_settings,
    summary="text sources or pre-tokenized data -> token store",
    examples="""
  arslice tokenize --source val.jsonl.zst --tokenizer gpt2 --out runs/pile/tokens/val
  arslice tokenize --source 00.jsonl.zst 01.jsonl.zst --tokenizer tokenizer.json --out runs/pile/tokens/train --workers 16
  arslice tokenize --source /shared/pile/train --glob '*.jsonl.zst' --tokenizer gpt2 --out /shared/pile/tokens/train --executor ray --ray-address auto --shard-by-file
  arslice tokenize --source /usr/lib/python3.11 --glob '**/*.py' --split-fraction 0.1 --split-part val \\
      --tokenizer runs/demo/tokenizer.json --out runs/demo/tokens/val
  arslice tokenize --source data.parquet --text-field content --on-bad-record skip --tokenizer t.json --out store
  arslice tokenize --source hf://monology/pile-uncopyrighted@validation --tokenizer gpt2 --out val --max-docs 10000
  arslice tokenize --source pile_0.87_deduped_text_document.bin --tokenizer EleutherAI/pythia-160m --out pythia
  arslice tokenize --source train.bin --source-format raw-uint16 --vocab-size 50257 --eos-id 50256 --out store""",
)
