"""`arslice eval`: per-token losses of one model over the tagged windows.

Reads the tag stage's window table and the validation token store it names, runs batched forward
passes and writes `losses-NNNNN.parquet` (`window_id int32, pos int32, nll float32`, natural log)
with exactly one row per tag row, then `meta.json`.

How it runs:
  * Windows are processed in chunks of `chunk_windows` consecutive windows; chunk `c` is written
    atomically to `losses-{c:05d}.parquet` as soon as it is done, so an interrupted run resumes at
    the first missing chunk and ends with the same files as an uninterrupted one. Every chunk
    records the settings that produced it (parquet schema metadata); resuming with different
    settings is refused.
  * Inside a chunk, sequences are batched longest first; the forward pass runs under
    `torch.inference_mode`, with bf16/fp16 autocast when asked (the default on CUDA and on CPUs
    with native bf16) while the cross-entropy stays fp32 and chunked (`models.nll.per_token_nll`).
  * `--batch-size auto` starts from a guess for the device and, on CUDA out-of-memory, halves the
    batch and retries it, keeping the smaller size for the rest of the run.
  * `--max-windows N` evaluates windows `0..N-1` only; its meta.json says `"partial": true` and
    `windows_evaluated`, `files` lists the loss files of those windows, and a later run on the
    same `--out` covering more windows resumes it instead of skipping.

Windowing:
  * `fixed` (default, the paper's): the model reads the tag windows themselves, `S[w*L : w*L+n]`,
    so a target's context is every earlier token of its window, across document boundaries.
  * `rolling`: lm-evaluation-harness `loglikelihood_rolling` per document (`ar_slicing.algorithms.rolling`):
    each document is read on its own, after one prefix token, in windows of at most `L`
    predictions. The prefix is lm-eval's `prefix_token_id`: the model tokenizer's BOS when it
    declares one, else its EOS (the store's when the model's tokenizer declares neither);
    `--prefix-token` overrides it, and meta.json records it and where it came from.
    A row keeps the `(window_id, pos)` of the tag row whose target is the same stream token. The
    EOS that ends each document in the stream (a tag row, never scored by lm-eval) is scored as
    one more prediction with the at most `L` tokens of its document before it as context; the
    sum over a document's other rows is exactly lm-eval's rolling loglikelihood (negated). The
    first token of the stream has no tag row, so the first document's first prediction is
    computed but not written.
"""

from __future__ import annotations

from models.precision import cpu_has_native_bf16, resolve_dtype
from pipeline.eval.config import EvalConfig
from pipeline.eval.forward import BatchRunner, make_forward, resolve_batch_size
from pipeline.eval.inputs import (
    Sequence,
    TagsInput,
    fixed_sequences,
    open_tags,
    rolling_sequences,
)
from pipeline.eval.stage import COMMAND, run_eval

__all__ = [
    "COMMAND",
    "BatchRunner",
    "EvalConfig",
    "Sequence",
    "TagsInput",
    "cpu_has_native_bf16",
    "fixed_sequences",
    "make_forward",
    "open_tags",
    "resolve_batch_size",
    "resolve_dtype",
    "rolling_sequences",
    "run_eval",
]
