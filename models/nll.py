"""Per-token negative log-likelihood without building a (B, T, V) fp32 log-probability tensor.

The final projection and the fp32 cross-entropy run over `chunk_size` tokens at a time, so peak
extra memory is `chunk_size * V * 4` bytes (about 200 MB at V = 50 304 and 1 024 tokens) however
long the batch is; a full `log_softmax` of a 16 x 2048 batch would need 6.6 GB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_nll(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """NLL (natural log) of `targets` under `softmax(hidden @ head_weight.T + head_bias)`.

    hidden (B, T, D), head_weight (V, D), head_bias (V,) or None, targets (B, T) long with -1 for
    positions to ignore (their NLL is 0). Returns (B, T) float32. The projection runs in the
    ambient dtype (bf16 under autocast), the softmax in fp32.
    """
    B, T, D = hidden.shape
    if targets.shape != (B, T):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden {(B, T)}")
    flat_h = hidden.reshape(B * T, D)  # (N, D)
    flat_t = targets.reshape(B * T)
    out = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    for start in range(0, B * T, chunk_size):
        stop = min(start + chunk_size, B * T)
        logits = F.linear(flat_h[start:stop], head_weight, head_bias)  # (n, V)
        out[start:stop] = F.cross_entropy(
            logits.float(), flat_t[start:stop], reduction="none", ignore_index=-1
        )
        del logits
    return out.view(B, T)


def per_token_nll(loaded, input_ids: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024):
    """Per-token NLL (B, T) float32 of `targets` given `input_ids` for a `models.LoadedModel`.

    `input_ids` and `targets` are (B, T) long on the model's device; `targets[:, t]` is the token
    that follows `input_ids[:, t]`. Runs under `torch.no_grad`; works in fp32 on CPU and under
    `torch.autocast("cuda", dtype=torch.bfloat16)` on GPU.
    """
    with torch.no_grad():
        hidden, weight, bias = loaded.hidden_and_head(input_ids)
        return chunked_nll(hidden, weight, bias, targets, chunk_size=chunk_size)
