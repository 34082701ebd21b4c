"""The batch order and the learning-rate schedule: pure functions of the step (what makes
resuming exact), the same for every architecture."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.train.config import Recipe

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchOrder:
    """Which rows of the training stream make up each batch (see the module docstring).

    >>> order = BatchOrder(n_tokens=11, seq_len=4, batch_size=2, seed=0)
    >>> order.n_rows        # rows start at 0, 4 (tokens 0..4, 4..8); a row at 8 would need token 12
    2
    """

    n_tokens: int
    seq_len: int
    batch_size: int
    seed: int

    @property
    def n_rows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def epoch_order(self, epoch: int) -> np.ndarray:
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)

    def rows(self, step: int) -> np.ndarray:
        """Row indices of batch `step` (int64, length batch_size)."""
        import numpy as np

        k = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)
        epochs, within = np.divmod(k, self.n_rows)
        out = np.empty_like(k)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.epoch_order(int(epoch))[within[sel]]
        return out

    def digest(self, steps: int) -> str:
        """sha256 of the rows of batches 0..steps-1: equal digests, same tokens in the same order."""
        h = hashlib.sha256(f"{self.n_tokens}:{self.seq_len}:{self.batch_size}".encode())
        for step in range(steps):
            h.update(self.rows(step).astype("<i8").tobytes())
        return h.hexdigest()

    def batch(self, tokens: np.ndarray, step: int) -> np.ndarray:
        """(batch_size, seq_len + 1) int64 array of the rows of batch `step`."""
        import numpy as np

        starts = self.rows(step) * self.seq_len
        return np.stack(
            [np.asarray(tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        )


def learning_rate(step: int, cfg: Recipe) -> float:
    """Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to lr*min_lr_ratio."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def validation_rows(n_tokens: int, seq_len: int, n_rows: int) -> np.ndarray:
    """Start indices of `n_rows` rows spread evenly over a held-out stream (fixed across runs)."""
    import numpy as np

    available = max(0, (n_tokens - 1) // seq_len)
    if available == 0:
        return np.zeros(0, dtype=np.int64)
    picks = np.unique(
        np.linspace(0, available - 1, num=min(n_rows, available)).round().astype(np.int64)
    )
    return picks * seq_len
