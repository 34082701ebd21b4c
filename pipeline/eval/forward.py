"""The forward pass: batch sizes, the per-token NLL (and argmax) of a batch, and batching with
out-of-memory back-off, for the eval stage's windows and for the probes' token rows."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ar_slicing.errors import ArSliceError
from pipeline.eval.config import CPU_TOKENS_PER_BATCH, CUDA_TOKENS_PER_BATCH
from pipeline.eval.inputs import Sequence

log = logging.getLogger(__name__)


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
        raise ArSliceError(f'--batch-size {text}: must be a positive integer or "auto"')
    return value


def make_forward(
    loaded,
    device: str,
    dtype: str,
    kernels: str = "auto",
    kernels_taken: dict | None = None,
    with_argmax: bool = False,
) -> Callable[[np.ndarray, np.ndarray], np.ndarray | tuple | PendingNll]:
    """`forward(inputs (B,T) int64, targets (B,T) int64)` -> the NLL (B,T) float32 of a batch: an
    array on a CPU; on CUDA a `PendingNll`, whose copy back to the host runs while the caller
    queues the next batch. With `with_argmax`, `(nll, argmax (B,T) int64)`, the id the head ranks
    first (on CUDA, a `PendingNll` of both).

    On CUDA in bf16 the model's linear weights are held in bf16 first (`hold_linear_weights`:
    the same losses, without autocast casting them on every forward). `kernels` is the
    models/kernels preference the forward runs under; the path each fused op took is added to
    `kernels_taken` ({op: set of paths}).
    """
    import torch

    from models.kernels import use_kernels
    from models.nll import per_token_nll
    from models.precision import autocast, hold_linear_weights, weights_dtype

    on_cuda = device.startswith("cuda")
    hold_linear_weights(loaded.model, weights_dtype(device, dtype))
    taken = {} if kernels_taken is None else kernels_taken

    def to_device(a: np.ndarray):
        t = torch.from_numpy(a)
        if on_cuda:
            # From pinned memory (torch caches the pinned blocks) the copy is a DMA the host does not
            # wait for: it goes on queueing the forward's kernels, which the stream orders after it.
            return t.pin_memory().to(device, non_blocking=True)
        return t

    def forward(inputs: np.ndarray, targets: np.ndarray):
        with torch.inference_mode(), autocast(device, dtype), use_kernels(kernels) as paths:
            out = per_token_nll(
                loaded, to_device(inputs), to_device(targets), with_argmax=with_argmax
            )
            for op, ways in paths.items():
                taken.setdefault(op, set()).update(ways)
            outs = out if with_argmax else (out,)
            if on_cuda:
                return PendingNll(*outs)
        arrays = tuple(o.float().numpy() if o.is_floating_point() else o.numpy() for o in outs)
        return arrays if with_argmax else arrays[0]

    return forward


class PendingNll:
    """A batch's outputs on their way back from the GPU (its NLL, and the argmax when asked): a
    copy of each into pinned host memory that the host does not wait for, and the event recorded
    after them on the stream."""

    def __init__(self, *tensors):
        import torch

        self.host = []
        for t in tensors:  # the NLL as float32, an argmax as it is (int64)
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self.host.append(host)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def result(self) -> np.ndarray | tuple[np.ndarray, ...]:
        """(B, T) float32 (and (B, T) int64 argmax, as a tuple), once the copy has landed."""
        self.copied.synchronize()
        arrays = tuple(h.numpy() for h in self.host)
        return arrays if len(arrays) > 1 else arrays[0]


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

    def run(self, seqs: list[Sequence], nll_out: np.ndarray, progress=None, argmax_out=None) -> int:
        """Fill `nll_out[row0 + j]` for every scored output of every sequence (and `argmax_out`
        likewise, when given: `forward` then returns `(nll, argmax)`). Returns the number of
        input tokens read (padding excluded).

        One batch is kept in flight: batch i+1 is queued on the device before batch i's NLL is
        taken back and scattered, so on CUDA the GPU computes while the host pads, copies and
        scatters (a forward that returns an array has simply finished already)."""
        order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i].inputs), i))
        i = 0
        read = 0
        in_flight = None  # (batch, its outputs: arrays, or a PendingNll still on its way)
        while i < len(order):
            batch = [seqs[j] for j in order[i : i + self.batch_size]]
            out = None
            try:
                out = self.forward(*self._pad(batch))
            except Exception as err:  # torch raises OutOfMemoryError (RuntimeError before 2.1)
                if not _is_out_of_memory(err):
                    raise
            if out is None:
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
            if in_flight is not None:
                read += self._scatter(*in_flight, nll_out, argmax_out, progress)
            in_flight = (batch, out)
            i += len(batch)
        if in_flight is not None:
            read += self._scatter(*in_flight, nll_out, argmax_out, progress)
        return read

    @staticmethod
    def _scatter(batch: list[Sequence], out, nll_out: np.ndarray, argmax_out, progress) -> int:
        """Write a finished batch's scored outputs into `nll_out` (and its argmax into
        `argmax_out`, when given); returns its input tokens."""
        if isinstance(out, PendingNll):
            out = out.result()
        nll, top = out if argmax_out is not None else (out, None)
        n_scored = read = 0
        for row, s in enumerate(batch):
            scored = nll[row, s.score_from : len(s.inputs)]
            nll_out[s.row0 : s.row0 + len(scored)] = scored
            if top is not None:
                argmax_out[s.row0 : s.row0 + len(scored)] = top[row, s.score_from : len(s.inputs)]
            n_scored += len(scored)
            read += len(s.inputs)
        if progress is not None:
            progress(n_scored)
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


def score_rows(
    loaded, rows: np.ndarray, device: str, dtype: str, batch_size: str | int = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Per-position NLL and argmax of token rows (N, T) of one length (the probes' sequences):
    `nll[i, j] = -log p(rows[i, j+1] | rows[i, :j+1])` and `argmax[i, j]` the id the model ranks
    first there, both (N, T-1), float32 and int64; through the eval stage's forward and batching
    (`batch_size` rows at a time; auto: as many as the eval stage's token budget holds)."""
    import torch

    rows = np.asarray(rows, dtype=np.int64)
    n, width = rows.shape
    seqs = [Sequence(r[:-1], r[1:], 0, i * (width - 1)) for i, r in enumerate(rows)]
    nll = np.full(n * (width - 1), np.nan, dtype=np.float32)
    top = np.full(n * (width - 1), -1, dtype=np.int64)
    forward = make_forward(loaded, device, dtype, with_argmax=True)
    runner = BatchRunner(
        forward, resolve_batch_size(batch_size, device, width - 1), on_oom=torch.cuda.empty_cache
    )
    runner.run(seqs, nll, argmax_out=top)
    return nll.reshape(n, width - 1), top.reshape(n, width - 1)
