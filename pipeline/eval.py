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
  * `rolling`: lm-evaluation-harness `loglikelihood_rolling` per document (`ar_slicing.rolling`):
    each document is read on its own, after an EOS prefix, in windows of at most `L` predictions.
    A row keeps the `(window_id, pos)` of the tag row whose target is the same stream token. The
    EOS that ends each document in the stream (a tag row, never scored by lm-eval) is scored as
    one more prediction with the at most `L` tokens of its document before it as context; the
    sum over a document's other rows is exactly lm-eval's rolling loglikelihood (negated). The
    first token of the stream has no tag row, so the first document's first prediction is
    computed but not written.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ar_slicing.errors import ArSliceError, BadInput
from ar_slicing.io import (
    META_NAME,
    atomic_path,
    build_meta,
    is_complete,
    read_json,
    write_meta,
)
from ar_slicing.tokenizer import require_same_fingerprint
from ar_slicing.windows import WINDOWS_NAME
from pipeline.config import Command

log = logging.getLogger(__name__)

LOSSES_GLOB = "losses-*.parquet"
PLAN_KEY = b"ar_slicing.eval_plan"
# On CPU a few windows per batch amortise per-op overhead; more only grows memory.
CPU_TOKENS_PER_BATCH = 8192
# A first guess on CUDA (back-off halves it when it does not fit): 128 windows of 2048 tokens.
CUDA_TOKENS_PER_BATCH = 1 << 18
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


@dataclass(frozen=True)
class EvalConfig:
    model: str = field(
        metadata={
            "help": "model spec: hf:<hub id or dir>, native:<dir>, safari:<ckpt>, zoology:<ckpt>"
        }
    )
    tags: str = field(metadata={"help": "tag directory written by `arslice tag` (windows.parquet)"})
    out: str = field(metadata={"help": "output directory for losses-*.parquet and meta.json"})
    name: str | None = field(
        default=None, metadata={"help": "model name recorded in meta.json (default: from the spec)"}
    )
    device: str = field(
        default="auto",
        metadata={"help": "auto = cuda when available", "choices": ["auto", "cpu", "cuda"]},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "autocast dtype of the forward pass; auto = bf16 on CUDA (fp16 without bf16 "
            "support) and on CPUs with native bf16 (AVX512-BF16, AMX, Arm BF16), else fp32. "
            "The cross-entropy is always fp32; --dtype fp32 for exact fp32 losses",
            "choices": ["auto", "bf16", "fp16", "fp32"],
        },
    )
    batch_size: str = field(
        default="auto",
        metadata={"help": "sequences per forward pass, or auto (backs off on CUDA out-of-memory)"},
    )
    max_windows: int | None = field(
        default=None,
        metadata={"help": "evaluate only the first N windows (a partial run, resumable)"},
    )
    windowing: str = field(
        default="fixed",
        metadata={
            "help": "fixed = the tag windows as they are (the paper's); rolling = per-document "
            "windows with an EOS prefix (lm-eval loglikelihood_rolling)",
            "choices": ["fixed", "rolling"],
        },
    )
    tokens: str | None = field(
        default=None,
        metadata={
            "help": "validation token store (default: the one recorded in the tags' meta.json)"
        },
    )
    skip_tokenizer_check: bool = field(
        default=False,
        metadata={
            "help": "evaluate even if the model's tokenizer differs from the store's (recorded)"
        },
    )
    chunk_windows: int = field(
        default=256, metadata={"help": "windows per output file (the unit of resuming)"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output directory"})
    executor: str = field(
        default="local",
        metadata={
            "help": "local = this process; ray = chunks spread over Ray actors, one per GPU of the "
            "cluster (every node must see --tags, the store and --out under the same paths)",
            "choices": ["local", "ray"],
        },
    )
    ray_address: str | None = field(
        default=None,
        metadata={"help": "Ray cluster to join (default: RAY_ADDRESS, else a local cluster)"},
    )
    ray_actors: int = field(
        default=0,
        metadata={"help": "Ray actors (0 = one per GPU of the cluster; one per CPU without GPUs)"},
    )


# ---- inputs -------------------------------------------------------------------------------------


@dataclass
class TagsInput:
    """The tag directory's window table and the token store it was made from."""

    dir: Path
    meta: dict
    window: int  # L
    starts: np.ndarray  # (W,) int64
    n_targets: np.ndarray  # (W,) int64
    store: object  # ar_slicing.store.TokenStore
    n_tag_rows: int

    @property
    def n_windows(self) -> int:
        return len(self.starts)


def open_tags(tags_dir: str | Path, tokens: str | None = None) -> TagsInput:
    """Read and check a tag directory: complete, window table as DESIGN.md defines it, tag rows
    one per target, and a token store of the same tokenizer and length."""
    import pyarrow.parquet as pq

    from ar_slicing.store import TokenStore

    tags_dir = Path(tags_dir)
    if not tags_dir.is_dir():
        raise BadInput(f"tags {tags_dir}: no such directory (run `arslice tag` first)")
    if not is_complete(tags_dir):
        raise BadInput(
            f"tags {tags_dir}: incomplete (no meta.json); rerun `arslice tag` to finish it"
        )
    meta = read_json(tags_dir / META_NAME)
    for key in ("window", "fingerprint"):
        if key not in meta:
            raise BadInput(f"{tags_dir / META_NAME}: has no `{key}`; rerun `arslice tag`")
    store_path = tokens or meta.get("tokens")
    if not store_path:
        raise BadInput(f"{tags_dir / META_NAME}: names no token store; pass --tokens")
    store = TokenStore.open(store_path)
    require_same_fingerprint(
        meta["fingerprint"], f"tags {tags_dir}", store.fingerprint, f"token store {store.path}"
    )
    window = int(meta["window"])
    path = tags_dir / WINDOWS_NAME
    try:
        table = pq.read_table(path, columns=["window_id", "start", "n_targets"])
    except Exception as e:
        raise BadInput(f"{path}: cannot read the window table ({e}); rerun `arslice tag`") from None
    window_id = table.column("window_id").to_numpy().astype(np.int64)
    starts = table.column("start").to_numpy().astype(np.int64)
    n_targets = table.column("n_targets").to_numpy().astype(np.int64)
    expected_starts = np.arange(len(window_id), dtype=np.int64) * window
    expected_targets = np.minimum(window, store.n_tokens - 1 - expected_starts)
    for name, got, want in (
        ("window_id", window_id, np.arange(len(window_id))),
        ("start", starts, expected_starts),
        ("n_targets", n_targets, expected_targets),
    ):
        bad = np.flatnonzero(got != want)
        if bad.size:
            i = int(bad[0])
            raise BadInput(
                f"{path}: row {i} has {name} {int(got[i])} but a {store.n_tokens}-token stream in "
                f"windows of {window} needs {int(want[i])}; the tags were made from another store "
                f"than {store.path} (pass --tokens) or are damaged (rerun `arslice tag --overwrite`)"
            )
    if int(n_targets.sum()) != max(store.n_tokens - 1, 0):
        raise BadInput(
            f"{path}: {len(window_id)} windows cover {int(n_targets.sum())} targets but the store "
            f"{store.path} has {store.n_tokens - 1}; rerun `arslice tag --overwrite`"
        )
    parts = sorted(tags_dir.glob("tags-*.parquet"))
    n_tag_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    if n_tag_rows != int(n_targets.sum()):
        raise BadInput(
            f"tags {tags_dir}: {len(parts)} tags-*.parquet files hold {n_tag_rows} rows but "
            f"{WINDOWS_NAME} has {int(n_targets.sum())} targets; rerun `arslice tag --overwrite`"
        )
    return TagsInput(tags_dir, meta, window, starts, n_targets, store, n_tag_rows)


def model_name_from_spec(spec: str) -> str:
    """`hf:EleutherAI/pythia-160m` -> `pythia-160m`, `native:runs/x/models/attn/` -> `attn`."""
    body = spec.split(":", 1)[1] if re.match(r"^[a-z]+:", spec) else spec
    last = [p for p in re.split(r"[/\\]", body) if p][-1:] or ["model"]
    name = last[0]
    for suffix in CHECKPOINT_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"


# ---- what gets computed -------------------------------------------------------------------------


@dataclass
class Sequence:
    """One model input: it reads `inputs`; outputs `score_from..` are scored against `targets`
    and land in rows `row0..` of the chunk's loss array."""

    inputs: np.ndarray  # (T,) int64
    targets: np.ndarray  # (T,) int64, targets[t] = the token output t predicts
    score_from: int
    row0: int


def chunk_bounds(n_windows: int, chunk_windows: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk_windows, n_windows)) for a in range(0, n_windows, chunk_windows)]


def fixed_sequences(tags: TagsInput, w0: int, w1: int) -> list[Sequence]:
    """The tag windows themselves: window w reads S[start : start+n] and predicts S[start+1 : start+n+1]."""
    out = []
    row = 0
    for w in range(w0, w1):
        start, n = int(tags.starts[w]), int(tags.n_targets[w])
        span = tags.store.slice(start, start + n + 1).astype(np.int64)
        out.append(Sequence(span[:-1], span[1:], 0, row))
        row += n
    return out


def rolling_sequences(tags: TagsInput, w0: int, w1: int) -> list[Sequence]:
    """Per-document rolling windows (ar_slicing.rolling) whose predictions fall in windows w0..w1-1.

    Rows of a chunk are its targets in stream order, so stream index `i` lands in row
    `i - (first target of the chunk)`. A rolling window that reaches past the chunk is cut
    after the chunk's last target (a causal model's earlier outputs do not depend on later
    inputs) and the part before the chunk is left unscored; the neighbouring chunk scores it.
    """
    from ar_slicing.rolling import rolling_windows

    store = tags.store
    lo = int(tags.starts[w0]) + 1  # first target stream index of the chunk
    hi = int(tags.starts[w1 - 1] + tags.n_targets[w1 - 1])  # last target stream index
    offsets = store.doc_offsets
    ends = np.append(offsets[1:], store.n_tokens)  # a document's segment: its tokens and its EOS
    first_doc = int(np.searchsorted(ends, lo, side="right"))  # the segment holding `lo`
    last_doc = int(np.searchsorted(offsets, hi, side="right")) - 1
    eos = store.eos_id
    out = []
    for d in range(first_doc, last_doc + 1):
        o, e = int(offsets[d]), int(ends[d])
        # The EOS after a document (appended by `tokenize`, or already in an imported stream)
        # gets the trailing-EOS rule; a segment without one is all document.
        trailing_eos = e > o and int(store.tokens[e - 1]) == eos
        n_doc = e - o - 1 if trailing_eos else e - o
        for a, b, k in rolling_windows(n_doc, tags.window, trailing_eos):
            # E[j] is stream index o + j - 1 (E[0] is the EOS prefix); outputs t predict E[a + 1 + t].
            first_scored = o + b - k  # stream index of the first scored target
            last_scored = o + b - 1
            s_lo, s_hi = max(first_scored, lo), min(last_scored, hi)
            if s_lo > s_hi:
                continue
            stop = b - (last_scored - s_hi)  # drop inputs only needed for targets after the chunk
            if a == 0:
                inputs = np.concatenate([[eos], store.slice(o, o + stop - 1)]).astype(np.int64)
            else:
                inputs = store.slice(o + a - 1, o + stop - 1).astype(np.int64)
            targets = store.slice(o + a, o + stop).astype(np.int64)
            out.append(Sequence(inputs, targets, s_lo - (o + a), s_lo - lo))
    return out


# ---- the forward pass ---------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ArSliceError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    return device


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU multiplies bf16 matrices in hardware (x86 AVX512-BF16 or AMX-BF16,
    Arm BF16), where bf16 autocast runs the model's matrix products about twice as fast as fp32.
    CPUs without it emulate bf16 more slowly than fp32. `cpuinfo` is /proc/cpuinfo's text."""
    import torch

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
            return native and torch.backends.mkldnn.is_available()
    return False


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bf16 on CUDA (fp16 where the GPU has no bf16) and on CPUs with native bf16 matrix
    instructions, fp32 on other CPUs. The cross-entropy is fp32 whatever the dtype."""
    import torch

    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def resolve_batch_size(batch_size: str | int, device: str, window: int) -> int:
    text = str(batch_size).strip().lower()
    if text == "auto":
        budget = CUDA_TOKENS_PER_BATCH if device == "cuda" else CPU_TOKENS_PER_BATCH
        return max(1, budget // max(window, 1))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ArSliceError(f"--batch-size {batch_size!r}: give a positive integer or auto")
    return value


def _autocast_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[dtype]


def make_forward(loaded, device: str, dtype: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """`forward(inputs (B,T) int64, targets (B,T) int64) -> nll (B,T) float32` on the device."""
    import contextlib

    import torch

    from models.nll import per_token_nll

    amp = _autocast_dtype(dtype)
    on_cuda = device.startswith("cuda")

    def to_device(a: np.ndarray):
        t = torch.from_numpy(a)
        if on_cuda:
            # From pinned memory (torch caches the pinned blocks) the copy is a DMA the host does not
            # wait for: it goes on queueing the forward's kernels, which the stream orders after it.
            return t.pin_memory().to(device, non_blocking=True)
        return t

    def forward(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        autocast = (
            torch.autocast(device_type="cuda" if on_cuda else "cpu", dtype=amp)
            if amp is not None
            else contextlib.nullcontext()
        )
        with torch.inference_mode(), autocast:
            nll = per_token_nll(loaded, to_device(inputs), to_device(targets))
        return nll.float().cpu().numpy()

    return forward


def _is_out_of_memory(err: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(err, oom) or "out of memory" in str(err).lower()


class BatchRunner:
    """Runs sequences through `forward` in batches, longest first, halving the batch size on
    out-of-memory and keeping the smaller size afterwards."""

    def __init__(self, forward: Callable, batch_size: int, pad_id: int = 0, on_oom=None):
        self.forward = forward
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.on_oom = on_oom or (lambda: None)
        self.backoffs = 0

    def run(self, seqs: list[Sequence], nll_out: np.ndarray, progress=None) -> int:
        """Fill `nll_out[row0 + j]` for every scored output of every sequence. Returns the number
        of input tokens read (padding excluded)."""
        order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i].inputs), i))
        i = 0
        read = 0
        while i < len(order):
            batch = [seqs[j] for j in order[i : i + self.batch_size]]
            nll = None
            try:
                nll = self.forward(*self._pad(batch))
            except Exception as err:  # torch raises OutOfMemoryError (RuntimeError before 2.1)
                if not _is_out_of_memory(err):
                    raise
            if nll is None:
                # Handled outside the except block: the traceback it holds keeps the failed
                # batch's activations alive, and freeing them first is what makes the retry fit.
                if self.batch_size == 1:
                    raise ArSliceError(
                        f"out of memory with a single sequence of {len(batch[0].inputs)} tokens; "
                        "use --dtype bf16, a smaller model or a shorter window"
                    )
                self.batch_size = max(1, self.batch_size // 2)
                self.backoffs += 1
                log.warning("out of memory; retrying with batch size %d", self.batch_size)
                self.on_oom()
                continue
            n_scored = 0
            for row, s in enumerate(batch):
                scored = nll[row, s.score_from : len(s.inputs)]
                nll_out[s.row0 : s.row0 + len(scored)] = scored
                n_scored += len(scored)
                read += len(s.inputs)
            if progress is not None:
                progress(n_scored)
            i += len(batch)
        return read

    def _pad(self, batch: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        # Right padding: a causal model's outputs at real positions never see the pad tokens.
        width = max(len(s.inputs) for s in batch)
        inputs = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(batch), width), self.pad_id, dtype=np.int64)
        for row, s in enumerate(batch):
            inputs[row, : len(s.inputs)] = s.inputs
            targets[row, : len(s.targets)] = s.targets
        return inputs, targets


# ---- output -------------------------------------------------------------------------------------


def losses_schema(plan: dict | None = None):
    import json

    import pyarrow as pa

    # never null, like the tag table's keys (REQUIRED in Parquet)
    schema = pa.schema(
        [
            pa.field("window_id", pa.int32(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),
            pa.field("nll", pa.float32(), nullable=False),
        ]
    )
    if plan is not None:
        schema = schema.with_metadata({PLAN_KEY: json.dumps(plan, sort_keys=True).encode()})
    return schema


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return out_dir / f"losses-{chunk:05d}.parquet"


def chunk_keys(tags: TagsInput, w0: int, w1: int) -> tuple[np.ndarray, np.ndarray]:
    """(window_id, pos) of every target of windows w0..w1-1, in tag-row order."""
    n = tags.n_targets[w0:w1]
    window_id = np.repeat(np.arange(w0, w1, dtype=np.int32), n)
    first_row = np.repeat(np.cumsum(n) - n, n)
    pos = (np.arange(int(n.sum()), dtype=np.int64) - first_row + 1).astype(np.int32)
    return window_id, pos


def existing_chunk_ok(path: Path, n_rows: int, plan: dict) -> bool:
    """True when `path` is a finished chunk of this plan with the expected number of rows;
    raises when it was made with other settings."""
    import json

    import pyarrow.parquet as pq

    if not path.is_file():
        return False
    try:
        pf = pq.ParquetFile(path)
    except Exception:
        log.warning("%s: unreadable, recomputing it", path)
        return False
    raw = (pf.schema_arrow.metadata or {}).get(PLAN_KEY)
    old = json.loads(raw) if raw else None
    if old != plan:
        diff = sorted(k for k in set(plan) | set(old or {}) if (old or {}).get(k) != plan.get(k))
        detail = ", ".join(f"{k}: {(old or {}).get(k)!r} -> {plan.get(k)!r}" for k in diff)
        raise ArSliceError(
            f"{path} was written by an evaluation with other settings ({detail}); pass "
            f"--overwrite to redo {path.parent}, or another --out"
        )
    return pf.metadata.num_rows == n_rows


def write_chunk(path: Path, window_id, pos, nll: np.ndarray, plan: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = np.flatnonzero(~np.isfinite(nll))
    if bad.size:
        i = int(bad[0])
        raise ArSliceError(
            f"non-finite loss ({nll[i]}) at window {int(window_id[i])} pos {int(pos[i])} "
            f"({bad.size} such rows in {path.name}); the model overflows in this dtype — try "
            "--dtype fp32 — or its weights are broken. Nothing was written for this chunk."
        )
    table = pa.table(
        {"window_id": pa.array(window_id), "pos": pa.array(pos), "nll": pa.array(nll)},
        schema=losses_schema(plan),
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


class ChunkEvaluator:
    """Computes and writes loss chunks `(c, w0, w1)` with one model held for many chunks: in the
    driver of a local run, or in each Ray actor of `--executor ray` (which loads its own model
    and tags from the paths in `cfg`)."""

    def __init__(self, cfg: EvalConfig, plan: dict, batch_size: int, loaded=None, tags=None):
        import torch

        self.tags = tags if tags is not None else open_tags(cfg.tags, cfg.tokens)
        if loaded is None:
            from models import load_model

            loaded = load_model(cfg.model, device=plan["device"])
        self.out = Path(cfg.out)
        self.plan = plan
        forward = make_forward(loaded, plan["device"], plan["dtype"])
        self.runner = BatchRunner(forward, batch_size, on_oom=torch.cuda.empty_cache)
        self.make_sequences = rolling_sequences if cfg.windowing == "rolling" else fixed_sequences

    def __call__(self, task: tuple[int, int, int], progress=None) -> dict:
        c, w0, w1 = task
        t = time.time()
        rows = int(self.tags.n_targets[w0:w1].sum())
        nll = np.full(rows, np.nan, dtype=np.float32)
        read = self.runner.run(self.make_sequences(self.tags, w0, w1), nll, progress)
        window_id, pos = chunk_keys(self.tags, w0, w1)
        write_chunk(chunk_path(self.out, c), window_id, pos, nll, self.plan)
        return {
            "rows": rows,
            "read": read,
            "seconds": time.time() - t,
            "batch_size": self.runner.batch_size,
            "backoffs": self.runner.backoffs,
        }


# ---- checks -------------------------------------------------------------------------------------


def check_model_fits(loaded, tags: TagsInput, n_windows: int, cfg: EvalConfig) -> int:
    """Tokenizer, vocabulary and positional-limit checks. Returns the largest token id read."""
    store = tags.store
    model_fp = getattr(loaded, "tokenizer_fingerprint", None)
    if model_fp is not None and model_fp != store.fingerprint:
        if cfg.skip_tokenizer_check:
            log.warning(
                "model tokenizer %s… differs from the store's %s…; evaluating anyway "
                "(--skip-tokenizer-check)",
                model_fp[:12],
                store.fingerprint[:12],
            )
        else:
            require_same_fingerprint(
                model_fp,
                f"model {cfg.model}",
                store.fingerprint,
                f"token store {store.path} (tags {tags.dir})",
            )
    end = int(tags.starts[n_windows - 1] + tags.n_targets[n_windows - 1]) + 1 if n_windows else 0
    max_id = max_token_id(store, end)
    if cfg.windowing == "rolling":
        max_id = max(max_id, store.eos_id)
    if max_id >= loaded.vocab_size:
        raise ArSliceError(
            f"model {cfg.model} has a vocabulary of {loaded.vocab_size} ids but token store "
            f"{store.path} holds id {max_id}; the model was trained with another tokenizer "
            "(or a smaller vocabulary) than the one that made the store"
        )
    limit = loaded.max_positions
    if limit is not None and tags.window > limit:
        raise ArSliceError(
            f"windows of {tags.window} tokens (tags {tags.dir}) exceed model {cfg.model}'s "
            f"positional limit of {limit}; re-tag with `arslice tag --window {limit}` or less"
        )
    return max_id


def max_token_id(store, end: int, block: int = 1 << 24) -> int:
    """Largest id in stream[0:end], read in blocks so a large store is never loaded at once."""
    best = -1
    for a in range(0, end, block):
        part = store.tokens[a : min(end, a + block)]
        if len(part):
            best = max(best, int(np.max(part)))
    return best


# ---- the stage ----------------------------------------------------------------------------------


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate `cfg.model` on the windows of `cfg.tags`; write losses and meta.json to `cfg.out`."""
    t0 = time.time()
    out = Path(cfg.out)
    name = cfg.name or model_name_from_spec(cfg.model)
    if cfg.chunk_windows < 1:
        raise ArSliceError(f"--chunk-windows {cfg.chunk_windows}: must be at least 1")
    if cfg.max_windows is not None and cfg.max_windows < 1:
        raise ArSliceError(f"--max-windows {cfg.max_windows}: must be at least 1")
    tags = open_tags(cfg.tags, cfg.tokens)
    n_windows = tags.n_windows if cfg.max_windows is None else min(cfg.max_windows, tags.n_windows)
    partial = n_windows < tags.n_windows

    executor = None
    if cfg.executor != "local":
        from ar_slicing.executor import get_executor

        executor = get_executor(cfg.executor, address=cfg.ray_address)
        # the actors' device, not this process's: CUDA when the cluster has GPUs
        device = cfg.device if cfg.device != "auto" else "cuda" if executor.cluster_gpus else "cpu"
        # auto: bf16 on GPU actors; CPU actors get this machine's choice (a cluster's nodes are
        # taken to be alike; one without native bf16 still runs it, emulated), as a local run would
        on_gpus = cfg.dtype == "auto" and device == "cuda"
        dtype = "bf16" if on_gpus else resolve_dtype(cfg.dtype, "cpu")
    else:
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
    plan = {
        "spec": cfg.model,
        "tags": str(tags.dir.resolve()),
        "tokens_store": str(Path(tags.store.path).resolve()),
        "fingerprint": tags.store.fingerprint,
        "window": tags.window,
        "windowing": cfg.windowing,
        "chunk_windows": cfg.chunk_windows,
        "dtype": dtype,
        "device": device,
    }
    if cfg.overwrite:
        for p in [out / META_NAME, *out.glob(LOSSES_GLOB)]:
            p.unlink(missing_ok=True)
    elif is_complete(out):
        meta = read_json(out / META_NAME)
        for key, want in (("spec", cfg.model), ("windowing", cfg.windowing)):
            if meta.get(key) != want:
                raise ArSliceError(
                    f"{out} already holds losses with {key} {meta.get(key)!r}, not {want!r}; "
                    "pass --overwrite to replace them, or another --out"
                )
        if not (meta.get("partial") and n_windows > int(meta.get("windows_evaluated", 0))):
            print(f"eval {name}: {out} is already complete ({meta.get('tokens')} tokens); skipped")
            return {
                "out": str(out),
                "name": meta.get("name"),
                "tokens": meta.get("tokens"),
                "skipped": True,
            }
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob(".losses-*.tmp"):  # left by a run killed while writing a chunk
        tmp.unlink(missing_ok=True)

    chunks = chunk_bounds(n_windows, cfg.chunk_windows)
    chunk_rows = [int(tags.n_targets[w0:w1].sum()) for w0, w1 in chunks]
    todo = [
        c
        for c in range(len(chunks))
        if not existing_chunk_ok(chunk_path(out, c), chunk_rows[c], plan)
    ]
    reused = len(chunks) - len(todo)
    # A partial (--max-windows) result being extended is incomplete again until meta.json is rewritten.
    (out / META_NAME).unlink(missing_ok=True)
    if reused:
        log.info("resuming %s: %d of %d chunks already done", out, reused, len(chunks))

    from models import load_model

    # with Ray the model is loaded here only for the checks and meta.json; the actors load their own
    loaded = load_model(cfg.model, device=device if executor is None else "cpu")
    check_model_fits(loaded, tags, n_windows, cfg)
    batch_size = resolve_batch_size(cfg.batch_size, device, tags.window)
    scored = read = backoffs = 0
    t_compute = 0.0
    from tqdm import tqdm

    windows_done = sum(chunks[c][1] - chunks[c][0] for c in range(len(chunks)) if c not in todo)
    bar = tqdm(
        total=sum(chunk_rows[c] for c in todo),
        unit="tok",
        unit_scale=True,
        desc=f"eval {name}",
        dynamic_ncols=True,
    )
    tasks = [(c, *chunks[c]) for c in todo]
    t_loop = time.time()
    if executor is None:
        evaluator = ChunkEvaluator(cfg, plan, batch_size, loaded=loaded, tags=tags)
        results = ((task, evaluator(task, bar.update)) for task in tasks)
    else:
        make_evaluator = functools.partial(ChunkEvaluator, cfg, plan, batch_size)
        results = executor.map_actors(
            make_evaluator,
            tasks,
            n_actors=cfg.ray_actors or None,
            num_gpus=1 if device == "cuda" else 0,  # one GPU per actor; none for CPU evaluation
        )
    try:
        for (_c, w0, w1), result in results:
            if executor is not None:
                bar.update(result["rows"])
            read += result["read"]
            t_compute += result["seconds"]
            batch_size = min(batch_size, result["batch_size"])
            backoffs = max(backoffs, result["backoffs"])  # each evaluator counts its own
            scored += result["rows"]
            windows_done += w1 - w0
            bar.set_postfix_str(f"windows {windows_done}/{n_windows}")
    finally:
        bar.close()
    if executor is not None:  # actors work side by side: the rate is the whole loop's
        t_compute = time.time() - t_loop if tasks else 0.0

    total_rows = int(tags.n_targets[:n_windows].sum())
    wall = time.time() - t0
    tokens_per_s = scored / t_compute if t_compute > 0 else 0.0
    meta = build_meta(
        "eval",
        config=cfg,
        inputs={
            "tags": str(tags.dir.resolve()),
            "tags_meta": {
                k: tags.meta.get(k) for k in ("git_hash", "created_at", "window", "threshold")
            },
            "tokens": str(Path(tags.store.path).resolve()),
            "model": cfg.model,
        },
        counts={
            "windows": n_windows,
            "rows": total_rows,
            "chunks": len(chunks),
            "chunks_computed": len(todo),
            "chunks_reused": reused,
            "input_tokens_read": read,
            "oom_backoffs": backoffs,
        },
        skipped={"windows_beyond_max_windows": tags.n_windows - n_windows},
        wall_time_s=wall,
        throughput={"tokens_per_s": tokens_per_s},
        name=name,
        spec=cfg.model,
        architecture=loaded.architecture,
        n_params=int(loaded.n_params),
        dtype=dtype,
        device=device,
        batch_size=batch_size,
        batch_size_requested=str(cfg.batch_size),
        tokens=total_rows,
        tokens_store=str(Path(tags.store.path).resolve()),
        tokens_per_s=tokens_per_s,
        fingerprint=tags.store.fingerprint,
        model_tokenizer_fingerprint=getattr(loaded, "tokenizer_fingerprint", None),
        skip_tokenizer_check=cfg.skip_tokenizer_check,
        windowing=cfg.windowing,
        window=tags.window,
        partial=partial,
        windows_evaluated=n_windows,
        windows_total=tags.n_windows,
        files=[chunk_path(out, c).name for c in range(len(chunks))],
    )
    write_meta(out, meta)
    rate = f"{tokens_per_s:,.0f} tokens/s" if todo else "all chunks reused"
    print(
        f"eval {name}: {total_rows:,} losses over {n_windows:,} windows"
        f"{' (partial)' if partial else ''} -> {out} ({rate}, {wall:.1f} s)"
    )
    return {"out": str(out), "name": name, "tokens": total_rows, "tokens_per_s": tokens_per_s}


COMMAND = Command(
    EvalConfig,
    run_eval,
    summary="per-token losses of one model over the tagged windows",
    examples="""\
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-160m
  arslice eval --model native:runs/demo/models/attention --tags runs/demo/tags --out runs/demo/losses/attention
  arslice eval --model hf:RWKV/rwkv-4-169m-pile --tags runs/pile/tags --out runs/pile/losses/rwkv --dtype fp32
  arslice eval --model hf:./pythia-70m --tags runs/pile/tags --out /tmp/smoke --max-windows 8 --device cpu
  arslice eval --model hf:EleutherAI/pythia-160m --tags runs/pile/tags --out runs/pile/losses/pythia-rolling --windowing rolling""",
)
