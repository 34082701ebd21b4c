"""`arslice tokenize` as a stage: text sources or pre-tokenized files, and the command."""

from __future__ import annotations

from ar_slicing.errors import ArSliceError
from ar_slicing.readers import is_pretokenized
from pipeline.config import Command
from pipeline.tokenize.config import TokenizeConfig
from pipeline.tokenize.imports import run_import
from pipeline.tokenize.text import run_text


def run_tokenize(cfg: TokenizeConfig) -> dict:
    sources = list(cfg.source)
    if not sources:
        raise ArSliceError("give at least one --source")
    kinds = {is_pretokenized(s, cfg.source_format) for s in sources}
    if len(kinds) > 1:
        raise ArSliceError(
            "cannot mix text sources and pre-tokenized files in one store; tokenize them into "
            "separate stores"
        )
    if kinds == {True}:
        return run_import(cfg)
    return run_text(cfg)


COMMAND = Command(
    TokenizeConfig,
    run_tokenize,
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
