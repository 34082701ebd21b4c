"""Per-token negative log-likelihood without building a (B, T, V) fp32 log-probability tensor.

Two exact forms of `-log softmax(h W^T + b)[target]`, computed in fp32:

  * `chunked_nll`: the final projection and the cross-entropy over `chunk_size` tokens at a time,
    so peak extra memory is `chunk_size * V * 4` bytes (about 200 MB at V = 50 304 and 1 024
    tokens) however long the batch is; a full `log_softmax` of a 16 x 2048 batch would need 6.6 GB.
    One large matrix product per chunk suits a GPU, and it supports autograd (training uses it).
  * `tiled_nll`: for inference on a CPU. The logits are made in tiles of `rows x vocab_block`
    (4 MB at the defaults) that stay in cache while each is reduced to its log-sum-exp, and the
    tiles' log-sum-exps are combined per token. A product with a few thousand output columns runs
    about twice as fast on a CPU as one over the whole vocabulary (the small inner dimension of a
    language-model head leaves a single large product limited by memory traffic), and no logit
    makes a second trip through main memory.

`per_token_nll` picks the form for the device. Both can also return, per token, the id the head
ranks first (`with_argmax=True`: the first of equal maxima, as `torch.argmax`), which the probes
score as a prediction (docs/design.md, "Probes of a checkpoint") at the cost of one max per tile.
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
    with_argmax: bool = False,
):
    """NLL (natural log) of `targets` under `softmax(hidden @ head_weight.T + head_bias)`.

    hidden (B, T, D), head_weight (V, D), head_bias (V,) or None, targets (B, T) long with -1 for
    positions to ignore (their NLL is 0). Returns (B, T) float32, and with `with_argmax` also the
    (B, T) int64 argmax of the logits. The projection runs in the ambient dtype (bf16 under
    autocast), the softmax in fp32.
    """
    B, T, D = hidden.shape
    _check_targets(hidden, targets)
    flat_h = hidden.reshape(B * T, D)  # (N, D)
    flat_t = targets.reshape(B * T)
    out = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    top = torch.empty(B * T, dtype=torch.int64, device=hidden.device) if with_argmax else None
    for start in range(0, B * T, chunk_size):
        stop = min(start + chunk_size, B * T)
        logits = F.linear(flat_h[start:stop], head_weight, head_bias)  # (n, V)
        out[start:stop] = F.cross_entropy(
            logits.float(), flat_t[start:stop], reduction="none", ignore_index=-1
        )
        if top is not None:
            top[start:stop] = logits.argmax(dim=-1)
        del logits
    if top is not None:
        return out.view(B, T), top.view(B, T)
    return out.view(B, T)


def tiled_nll(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: int = 1024,
    vocab_block: int = 1024,
    with_argmax: bool = False,
):
    """`chunked_nll`'s result, computed tile by tile (inference only: no autograd).

    For a tile x = logits[r0:r1, v0:v1], `log_softmax` (one fused fp32 pass) gives
    y = x - lse_tile, so lse_tile = x[:, 0] - y[:, 0]; a token's log-sum-exp is the log-sum-exp of
    its tiles' values. The target's logit is its own dot product h . W[target] (+ b[target]),
    accumulated in fp32. The products run in autocast's dtype when autocast is on (bf16), else in
    the dtype of `hidden`. With `with_argmax`, each tile's largest logit and its column are kept
    where they beat the earlier tiles' (strictly: a tie keeps the lower id, as `torch.argmax`).
    """
    B, T, D = hidden.shape
    _check_targets(hidden, targets)
    V = head_weight.shape[0]
    n_tokens = B * T
    flat_h = hidden.reshape(n_tokens, D)
    flat_t = targets.reshape(n_tokens)
    # under autocast the products run in its dtype: cast the head once, not once per tile
    on_autocast = torch.is_autocast_enabled(hidden.device.type)
    mm_dtype = torch.get_autocast_dtype(hidden.device.type) if on_autocast else flat_h.dtype
    flat_h = flat_h.to(mm_dtype)
    weight_t = head_weight.to(mm_dtype).T.contiguous()  # (D, V): tiles are column slices
    bias = None if head_bias is None else head_bias.to(mm_dtype)
    blocks = [(v0, min(v0 + vocab_block, V)) for v0 in range(0, V, vocab_block)]
    out = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    tile_lse = torch.empty(min(rows, n_tokens), len(blocks), dtype=torch.float32)
    top = torch.zeros(n_tokens, dtype=torch.int64, device=hidden.device) if with_argmax else None
    with torch.no_grad():
        for r0 in range(0, n_tokens, rows):
            r1 = min(r0 + rows, n_tokens)
            h = flat_h[r0:r1]  # (n, D)
            if top is not None:
                best = torch.full((r1 - r0,), -torch.inf, dtype=mm_dtype)
            for j, (v0, v1) in enumerate(blocks):
                x = h @ weight_t[:, v0:v1]  # (n, vb)
                if bias is not None:
                    x += bias[v0:v1]
                y = torch.log_softmax(x, dim=-1, dtype=torch.float32)
                tile_lse[: r1 - r0, j] = x[:, 0].float() - y[:, 0]
                if top is not None:
                    value, column = x.max(dim=-1)  # (n,)
                    beats = value > best
                    best = torch.where(beats, value, best)
                    top[r0:r1] = torch.where(beats, column + v0, top[r0:r1])
            lse = torch.logsumexp(tile_lse[: r1 - r0], dim=-1)  # (n,)
            t = flat_t[r0:r1]
            picked = t.clamp(min=0)
            target_logit = (h.float() * head_weight[picked].to(mm_dtype).float()).sum(-1)
            if head_bias is not None:
                target_logit += head_bias[picked].float()
            out[r0:r1] = torch.where(t >= 0, lse - target_logit, 0.0)
    if top is not None:
        return out.view(B, T), top.view(B, T)
    return out.view(B, T)


def _check_targets(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    B, T, _ = hidden.shape
    if targets.shape != (B, T):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match hidden {(B, T)}")


def per_token_nll(
    loaded,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    with_argmax: bool = False,
):
    """Per-token NLL (B, T) float32 of `targets` given `input_ids` for a `models.LoadedModel`
    (with `with_argmax`: and the (B, T) int64 id the head ranks first at each position).

    `input_ids` and `targets` are (B, T) long on the model's device; `targets[:, t]` is the token
    that follows `input_ids[:, t]`. Runs under `torch.no_grad`; works in fp32 on CPU and under
    `torch.autocast("cuda", dtype=torch.bfloat16)` on GPU. On a CPU the head runs as
    `tiled_nll` (`chunk_size` rows per tile), elsewhere as `chunked_nll`.
    """
    with torch.no_grad():
        hidden, weight, bias = loaded.hidden_and_head(input_ids)
        if hidden.device.type == "cpu":
            return tiled_nll(
                hidden, weight, bias, targets, rows=chunk_size, with_argmax=with_argmax
            )
        return chunked_nll(hidden, weight, bias, targets, chunk_size, with_argmax)
