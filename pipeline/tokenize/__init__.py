"""`arslice tokenize`: text sources (or pre-tokenized data) -> a token store (docs/design.md).

Text sources are read in order by `ar_slicing.data.readers` and cut into shards of consecutive
documents (at most `shard_docs` documents or `shard_mb` MB of text, so the cut points depend only
on the input). Worker processes encode each shard with the tokenizer's batched encoder and write
its tokens (EOS after every document) and document table to `<out>/.parts/` atomically, and the
driver records the shard in the stage's ledger (`ar_slicing.machinery.plan`). A final assembly concatenates the parts in shard
order into `tokens.bin` and `docs.parquet`, writes `tokenizer.json`, `meta.json` last, and removes
the parts. So the store's bytes do not depend on the worker count, and a killed run resumes at
shard granularity (it re-reads the sources but encodes only the shards not yet done).

Documents are encoded without the tokenizer's own added special tokens (no BOS); an EOS string
written literally in a document's text is encoded as the tokenizer encodes it (as EOS, for GPT-2
style tokenizers, as GPT-NeoX's preprocessing did) and counted in meta.json as `eos_in_text`.

Pre-tokenized sources (Megatron/GPT-NeoX `.bin` + `.idx`, raw uint16/uint32 files) are copied
into a store as they are, without appending anything (`eos_appended: false`).
"""

from pipeline.tokenize.config import TokenizeConfig
from pipeline.tokenize.stage import COMMAND, run_tokenize

__all__ = ["COMMAND", "TokenizeConfig", "run_tokenize"]
