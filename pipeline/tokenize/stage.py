"""`arslice tokenize` as a stage: text sources or pre-tokenized files, and the command."""

from __future__ import annotations

import time

from ar_slicing.data.readers import check_sources, check_split_options, is_pretokenized
from ar_slicing.errors import ArSliceError
from pipeline.config import Command
from pipeline.tokenize.config import PARTS_FORMAT, PLAN_KEYS, TokenizeConfig
from pipeline.wiring import STORES, TOKENIZER, Run, Table, Wiring, per_store


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
    if kinds == {True} and (cfg.split_fraction is not None or cfg.max_docs is not None):
        raise ArSliceError("--split-fraction and --max-docs apply to text sources, not to imports")
    if kinds == {False} and cfg.tokenizer is None:
        raise ArSliceError(
            "text sources need --tokenizer (a tokenizer.json, directory or hub name)"
        )
    if cfg.shard_by_file and cfg.max_docs is not None:
        raise ArSliceError(
            "--max-docs counts documents across the sources in order; it does not go with "
            "--shard-by-file"
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
    from ar_slicing.machinery.plan import StagePlan
    from pipeline.stage import run_stage
    from pipeline.tokenize.imports import import_store, import_tokenizer_info
    from pipeline.tokenize.shards import load_tokenizer_info, source_identity
    from pipeline.tokenize.text import encode_store

    t0 = time.time()
    validate_tokenize(cfg)
    importing = is_pretokenized(cfg.source[0], cfg.source_format)
    tok, info = import_tokenizer_info(cfg) if importing else load_tokenizer_info(cfg)
    plan = StagePlan(
        "tokenize",
        settings=tokenize_settings(cfg),
        inputs={
            "tokenizer": info["fingerprint"],  # it decides the ids
            "sources": [source_identity(s, cfg.glob) for s in cfg.source],
        },
    )
    make = import_store if importing else encode_store
    return run_stage(
        "tokenize",
        cfg.out,
        plan,
        lambda stage, _: make(stage, cfg, tok, info, t0),
        overwrite=cfg.overwrite,
        skipped=lambda meta: {"out": str(cfg.out), "skipped": True},
        work_is_parts=not importing,  # a shard the ledger holds (the tokenizer copy is no work)
    )


def tokenize_inputs(cfg: TokenizeConfig) -> list[tuple[str, str]]:
    """The tokenizer, when it is a local file or folder (its sources `validate_tokenize`
    checks; one on the hub, `tokenize_hub_names`)."""
    from ar_slicing.machinery import hub

    return (
        [("--tokenizer", cfg.tokenizer)]
        if cfg.tokenizer and not hub.is_hub_name(cfg.tokenizer)
        else []
    )


def tokenize_hub_names(cfg: TokenizeConfig, where: str) -> list[tuple[str, str, str]]:
    """The tokenizer and the datasets a store would fetch from the hub."""
    from ar_slicing.data.readers import HF_PREFIX, parse_hf_spec
    from ar_slicing.machinery import hub

    names = []
    if cfg.tokenizer and hub.is_hub_name(cfg.tokenizer):
        names.append((f"tokenizer {cfg.tokenizer!r} ({where})", cfg.tokenizer, "model"))
    for source in cfg.source:
        if source.startswith(HF_PREFIX) and hub.is_hub_name(parse_hf_spec(source)[0]):
            names.append((f"dataset {source} ({where})", source, "dataset"))
    return names


def _defaults(run: Run, table: Table) -> dict:
    """A store per [tokenize.train]/[tokenize.val], with the run's tokenizer (and its part of a
    split)."""
    defaults = {"out": run.layout.store(table.name), "tokenizer": run.layout.tokenizer}
    if "split_fraction" in table.values:
        defaults["split_part"] = table.name
    return defaults


COMMAND = Command(
    TokenizeConfig,
    run_tokenize,
    validate=validate_tokenize,
    plan_settings=tokenize_settings,
    inputs=tokenize_inputs,
    summary="text sources or pre-tokenized data -> token store",
    examples="""
  arslice tokenize --source val.jsonl.zst --tokenizer gpt2 --out runs/pile/tokens/val  # needs the hub
  arslice tokenize --source 00.jsonl.zst 01.jsonl.zst --tokenizer tokenizer.json --out runs/pile/tokens/train --workers 16
  arslice tokenize --source /shared/pile/train --glob '*.jsonl.zst' --tokenizer gpt2 --out /shared/pile/tokens/train --executor ray --ray-address auto --shard-by-file  # needs a Ray cluster
  STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  arslice tokenize --source "$STDLIB" --glob '*.py' --split-fraction 0.1 --split-part val \\
      --tokenizer runs/demo/tokenizer.json --out runs/demo/tokens/val
  arslice tokenize --source data.parquet --text-field content --on-bad-record skip --tokenizer t.json --out store
  arslice tokenize --source hf://monology/pile-uncopyrighted@validation --tokenizer gpt2 --out val --max-docs 10000  # needs the hub
  arslice tokenize --source pythia/document.bin --vocab-size 50304 --eos-id 0 --out runs/pythia/tokens/train
  arslice tokenize --source train.bin --source-format raw-uint16 --vocab-size 50257 --eos-id 50256 --out store""",
    hub_names=tokenize_hub_names,
    pipeline=Wiring(
        table="tokenize", reads=(TOKENIZER,), writes=STORES, fan_out=per_store, defaults=_defaults
    ),
)
