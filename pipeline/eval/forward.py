"""The forward pass: batch sizes, the per-token NLL of a batch, and batching with out-of-memory back-off."""

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


def make_forward(loaded, device: str, dtype: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """`forward(inputs (B,T) int64, targets (B,T) int64) -> nll (B,T) float32` on the device."""
    import torch

    from models.nll import per_token_nll
    from models.precision import autocast

    on_cuda = device.startswith("cuda")

    def to_device(a: np.ndarray):
        t = torch.from_numpy(a)
        if on_cuda:
            # From pinned memory (torch caches the pinned blocks) the copy is a DMA the host does not
            # wait for: it goes on queueing the forward's kernels, which the stream orders after it.
            return t.pin_memory().to(device, non_blocking=True)
        return t

    def forward(inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
        with torch.inference_mode(), autocast(device, dtype):
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
