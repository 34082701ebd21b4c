"""RWKV-4 time mixing and channel mixing (Peng et al., 2023, arXiv:2305.13048), in pure PyTorch.

Parameter names follow HazyResearch/zoology `zoology/mixers/rwkv.py` (`time_decay`, `time_first`,
`time_mix_{k,v,r}`, `key`, `value`, `receptance`, `output`). Zoology and BlinkDL run the WKV
recurrence in a custom CUDA kernel and transformers' `RwkvForCausalLM` falls back to a per-token
Python loop elsewhere; here `wkv_chunked` computes all tokens at once in pure PyTorch: inside
chunks of C tokens the decayed sums factorise into prefix sums, a scan over chunks carries the
state, and channels that decay too fast to factorise take a short window over past tokens.
Inference runs this in fp32 and base 2 (`_wkv_chunks_fp32`, `_wkv_window_fp32`) with per-channel
accuracy checks; a channel that fails them is recomputed by the exact log-space form
(`_wkv_log_matrix`). With autograd the fp64 factorised form runs instead. `wkv_sequential` is
the plain recurrence (one step per token) that the tests hold all of them to.

The WKV of channel d at time t, with w = exp(time_decay) > 0 and u = time_first:

    wkv_t = (sum_{i<t} e^{k_i - (t-1-i) w} v_i + e^{u + k_t} v_t)
          / (sum_{i<t} e^{k_i - (t-1-i) w}     + e^{u + k_t})

`FastRwkv` is transformers' `RwkvForCausalLM` (e.g. RWKV-4-Pile) over these mixers, with its module
names (`rwkv.embeddings`, `rwkv.blocks.{i}.{pre_ln,ln1,ln2,attention,feed_forward}`, `rwkv.ln_out`,
`head`), as models/mixers/mamba.py holds mamba_ssm's LM; models/checkpoints/hf_rwkv.py fills it
from a loaded transformers model.

(Longer than the other mixer files on purpose: one file per mixer, and the WKV's inference
forms, its exact fallback and the recurrence they are checked against belong together.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import run_op
from models.mixers.base import Mixer, StateMixer

log = logging.getLogger(__name__)

# exp() arguments the factorised form may reach (fp64 overflows past ~709)
_EXP_BUDGET = 600.0
# ~32 M fp32 elements (128 MB) per slab of the (B, chunks, C, C, D) intra-chunk weights
_SLAB_ELEMENTS = 1 << 25
_NEG = -1e38  # "log of zero" that stays finite, so max/subtract never meet inf - inf


def wkv_sequential(time_decay, time_first, k, v):
    """Reference recurrence (one step per token), stable via a running maximum exponent.

    time_decay, time_first (D,); k, v (B, T, D). Computes in fp32 (fp64 if k is fp64) and returns
    that dtype.
    """
    B, T, D = k.shape
    dt = torch.promote_types(k.dtype, torch.float32)
    w = -torch.exp(time_decay.to(dt))  # (D,) log decay per step, < 0
    u = time_first.to(dt)
    k, v = k.to(dt), v.to(dt)
    num = torch.zeros(B, D, device=k.device, dtype=dt)
    den = torch.zeros(B, D, device=k.device, dtype=dt)
    p = torch.full((B, D), _NEG, device=k.device, dtype=dt)  # state = (num, den) * e^p
    out = torch.empty(B, T, D, device=k.device, dtype=dt)
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        q = torch.maximum(p, u + kt)
        a, b = torch.exp(p - q), torch.exp(u + kt - q)
        out[:, t] = (a * num + b * vt) / (a * den + b)
        q = torch.maximum(p + w, kt)
        a, b = torch.exp(p + w - q), torch.exp(kt - q)
        num, den, p = a * num + b * vt, a * den + b, q
    return out


def _intra_chunk_bias(w, u, C: int):
    """(C, C, D) log-weight offsets: row j (output), column i (input) of one chunk.

    -(j-1-i) w for i < j (decay since token i), u for i == j (the current-token bonus),
    "-inf" for i > j (the future).
    """
    j = torch.arange(C, device=w.device)
    steps = (j[:, None] - 1 - j[None, :]).float()  # (C, C)
    bias = -steps[..., None] * w  # (C, C, D)
    diag = torch.eye(C, dtype=torch.bool, device=w.device)[..., None]
    future = (j[None, :] > j[:, None])[..., None]
    bias = torch.where(diag, u.expand(C, C, -1), bias)
    return bias.masked_fill(future, _NEG)


def _wkv_log_matrix(time_decay, time_first, k, v, chunk_size: int = 16):
    """WKV with every intra-chunk weight in log space and a per-row max: exact for any decay and
    key range, O(B T C D) work. Used for the channels that decay too fast to factorise.

    time_decay, time_first (D,); k, v (B, T, D). Returns (B, T, D) float32.
    """
    B, T, D = k.shape
    C = max(1, min(chunk_size, T))
    w = torch.exp(time_decay.float())  # (D,) decay per step, > 0
    u = time_first.float()
    N = -(-T // C)
    pad = N * C - T
    k, v = k.float(), v.float()
    if pad:  # padding goes after the last token, so it never reaches a real output
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    k = k.view(B, N, C, D)  # (B, N, C, D)
    v = v.view(B, N, C, D)  # (B, N, C, D)

    # 1. each chunk on its own: rows j attend to i <= j inside the chunk
    bias = _intra_chunk_bias(w, u, C)  # (C, C, D)
    m_in = torch.empty(B, N, C, D, device=k.device)
    num_in = torch.empty_like(m_in)
    den_in = torch.empty_like(m_in)
    step = max(1, _SLAB_ELEMENTS // max(1, B * C * C * D))
    for s in range(0, N, step):
        ks, vs = k[:, s : s + step], v[:, s : s + step]  # (B, n, C, D)
        logw = ks[:, :, None, :, :] + bias  # (B, n, C_out, C_in, D)
        m = logw.amax(dim=3)  # (B, n, C, D)
        e = torch.exp(logw - m[:, :, :, None, :])
        m_in[:, s : s + step] = m
        num_in[:, s : s + step] = (e * vs[:, :, None, :, :]).sum(dim=3)
        den_in[:, s : s + step] = e.sum(dim=3)
        del logw, e

    # 2. each chunk's total contribution to the state at the next chunk's start, then a scan
    c = torch.arange(C, device=k.device, dtype=torch.float32)
    q = k - (C - 1 - c)[:, None] * w  # (B, N, C, D): k_i - (C-1-i) w
    qm = q.amax(dim=2)  # (B, N, D)
    eq = torch.exp(q - qm[:, :, None])
    sa, sb = (eq * v).sum(dim=2), eq.sum(dim=2)  # (B, N, D)
    p = torch.full((B, D), _NEG, device=k.device)
    a = torch.zeros(B, D, device=k.device)
    b = torch.zeros(B, D, device=k.device)
    ps, as_, bs = [], [], []
    decay_chunk = C * w
    for n in range(N):
        ps.append(p), as_.append(a), bs.append(b)
        pd = p - decay_chunk
        p_new = torch.maximum(pd, qm[:, n])
        e1, e2 = torch.exp(pd - p_new), torch.exp(qm[:, n] - p_new)
        a, b, p = e1 * a + e2 * sa[:, n], e1 * b + e2 * sb[:, n], p_new
    p0 = torch.stack(ps, 1)[:, :, None]  # (B, N, 1, D): state at each chunk start
    a0 = torch.stack(as_, 1)[:, :, None]
    b0 = torch.stack(bs, 1)[:, :, None]

    # 3. combine: the carried state decays by j w to reach row j of its chunk
    sl = p0 - c[:, None] * w  # (B, N, C, D)
    M = torch.maximum(m_in, sl)
    e_in, e_st = torch.exp(m_in - M), torch.exp(sl - M)
    out = (e_in * num_in + e_st * a0) / (e_in * den_in + e_st * b0)
    return out.view(B, N * C, D)[:, :T]  # (B, T, D)


def _wkv_factorised(time_decay, time_first, k, v, C: int):
    """WKV with the intra-chunk weights factorised as e^{k_i + i w} e^{-(j-1) w}: prefix sums inside
    each chunk and a scan over chunks, O(B T C D) multiply-adds done as small matmuls. fp64 and keys shifted so max_t k = 0 keep every
    factor in range while C w <= _EXP_BUDGET and keys spread over less than ~100.
    """
    B, T, D = k.shape
    f64 = torch.float64
    w = torch.exp(time_decay.to(f64))  # (D,) decay per step
    u = time_first.to(f64)
    k = k.to(f64)
    v = v.to(f64)
    # wkv is a ratio of weighted sums: shifting all keys of a channel by one constant leaves it unchanged
    k = k - k.amax(dim=1, keepdim=True).detach()
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padding goes after the last token and carries ~zero weight
        k = F.pad(k, (0, 0, 0, pad), value=-1e4)
        v = F.pad(v, (0, 0, 0, pad))
    k = k.view(B, N, C, D)  # (B, N, C, D)
    v = v.view(B, N, C, D)  # (B, N, C, D)
    j = torch.arange(C, device=k.device, dtype=f64)[:, None]  # (C, 1) position inside the chunk
    ek = torch.exp(k + j * w)  # (B, N, C, D): e^{k_i + i w}
    ekv = ek * v
    # exclusive prefix sums over i < j as one small matmul with a strictly lower-triangular 0/1
    # matrix: no shifted copies, and never "inclusive minus the i = j term", which carries an
    # extra e^{w} and would swamp the others for fast channels
    before = torch.ones(C, C, dtype=f64, device=k.device).tril(-1)  # (C_out, C_in)
    cum_k = torch.matmul(before, ek)  # (B, N, C, D)
    cum_kv = torch.matmul(before, ekv)

    # state at each chunk start: earlier chunks' sums, decayed by C w per chunk (a scan of N steps)
    to_next_start = torch.exp(-(C - 1) * w)  # (D,)
    chunk_kv = (cum_kv[:, :, -1] + ekv[:, :, -1]) * to_next_start  # (B, N, D)
    chunk_k = (cum_k[:, :, -1] + ek[:, :, -1]) * to_next_start
    per_chunk = torch.exp(-C * w)
    states_kv, states_k = (
        [torch.zeros(B, D, dtype=f64, device=k.device)],
        [torch.zeros(B, D, dtype=f64, device=k.device)],
    )
    for n in range(1, N):
        states_kv.append(states_kv[-1] * per_chunk + chunk_kv[:, n - 1])
        states_k.append(states_k[-1] * per_chunk + chunk_k[:, n - 1])
    # the state reaches row j after j steps: e^{-j w} = e^{-(j-1) w} e^{-w}, so it joins the sums
    step = torch.exp(-w)
    cum_kv = cum_kv + (torch.stack(states_kv, 1) * step)[:, :, None]
    cum_k = cum_k + (torch.stack(states_k, 1) * step)[:, :, None]

    decay_to_row = torch.exp(-(j - 1) * w)  # (C, D): e^{-(j-1) w}
    bonus = ek * torch.exp(u - j * w)  # (B, N, C, D): the current token's e^{u + k_j}
    num = torch.addcmul(cum_kv * decay_to_row, bonus, v)
    den = torch.addcmul(bonus, cum_k, decay_to_row)
    return (num / den).view(B, N * C, D)[:, :T].float()  # (B, T, D)


# Fast fp32 paths (inference). Everything below runs in base 2: exp2 is several times cheaper than
# exp on CPUs and every factor is computed from fp64 tables, so the only rounding in an exponent is
# that of k - s itself, as in the recurrence.
_LOG2E = 1.4426950408889634
# a chunk of C tokens factorises in fp32 while C w stays below this many nats: its factors
# e^{(j - (C-1)/2) w} span e^{+-32} around the chunk's centre, leaving ~60 bits of fp32's range
# below for the keys' spread inside a block and time_first, and ~80 above for the sums and values
_CHUNK_DECAY_BUDGET = 64.0
# smaller chunk sizes tried, in turn, for channels that decay too fast for the requested one
_SMALL_CHUNKS = (4,)
# the windowed form for the fastest channels keeps at most this many past tokens; channels that need
# more (huge key ranges) go to the exact log-space form
_MAX_WINDOW = 32
# a dropped tail of the windowed form weighs at most e^{-_WINDOW_TAIL_NATS} of the denominator
_WINDOW_TAIL_NATS = 28.0
# every denominator must stay above 2^-90: the terms that matter to fp32 rounding are then normal
# floats (>= 2^-126) and anything flushed or underflowed is below 2^-30 of the result
_MIN_DEN_LOG2 = -90.0
# time_first beyond this many nats could overflow the bonus e^{u} E v in fp32
_MAX_BONUS_NATS = 20.0
# elements of one (C, 2, B, chunks, D) block: a few MB, so the block's passes stay in cache
_BLOCK_ELEMENTS = 1 << 20


def _chunk_tables(w64, u64, C: int):
    """fp64-exact per-channel factors for chunks of C tokens around the centre r = (C-1)/2,
    rounded once to fp32: (C, D) e^{(j-r) w}, and (D,) beta = e^{u-w}, e^{-C w}, e^{-(r+1) w}
    (block start to row 0's scale) and e^{-(C-1-r) w} (last row's scale to the block end)."""
    j = torch.arange(C, device=w64.device, dtype=torch.float64)[:, None]  # (C, 1)
    r = (C - 1) / 2
    return (
        torch.exp((j - r) * w64).float(),
        torch.exp(u64 - w64).float(),
        torch.exp(-C * w64).float(),
        torch.exp(-(r + 1) * w64).float(),
        torch.exp(-(C - 1 - r) * w64).float(),
    )


def _wkv_chunks_fp32(w64, u64, k, v, out, C: int, block_elements: int = _BLOCK_ELEMENTS):
    """WKV in chunks of C tokens, fp32, no autograd; the fast path of `wkv_chunked`.

    w64, u64 (D,) fp64 decay e^{time_decay} and time_first; k, v (B, T, D) fp32, any strides;
    writes out (B, T, D). Returns (D,) bool: channels whose result is proven accurate (every
    denominator, the carried state's included, >= 2^-90 and every output finite); the caller
    recomputes the others exactly.

    Per chunk and channel, with s the block's largest key and r = (C-1)/2 the chunk's centre,
    E_j = e^{k_j - s} e^{(j - r) w}; dividing numerator and denominator of row j by the common
    e^{s + (r - j + 1) w} leaves

        wkv_j = (sum_{i<j} E_i v_i + beta E_j v_j + tau_A) / (sum_{i<j} E_i + beta E_j + tau_B)

    with beta = e^{u-w} and tau the state carried into the chunk, which a scan over the block's
    chunks updates as tau <- e^{-C w} (tau + sum_j E_j (v_j, 1)) (a doubling scan, log2 steps).
    Blocks carry the state between them as (log2 scale, value). The prefix sums run as C-1 adds
    over (2, B, chunks, D) slices of a (C, 2, B, chunks, D) layout, so every pass is contiguous
    and each block stays in cache.
    """
    B, T, D = k.shape
    dev = k.device
    w2 = (w64 * _LOG2E).float()
    den_min = torch.full((D,), math.inf, device=dev)
    num_sum = torch.zeros(D, device=dev)
    n_full = T // C
    nbb = max(1, min(n_full, block_elements // max(1, 2 * B * C * D)))
    blocks = [(t0, C, min(nbb, n_full - t0 // C)) for t0 in range(0, n_full * C, nbb * C)]
    if T > n_full * C:  # the last T mod C tokens: one chunk of their own size
        blocks.append((n_full * C, T - n_full * C, 1))
    tables, powers = {}, {}
    sp = st = None  # state after the previous block: S = 2^sp (A, B_den); (B,), (2, B, D)
    for t0, Cb, nb in blocks:
        if Cb not in tables:
            tables[Cb] = _chunk_tables(w64, u64, Cb)
        etab, beta, decay, from_start, to_end = tables[Cb]
        beta_le1 = beta.clamp(max=1.0)
        t1 = t0 + nb * Cb
        kb = k[:, t0:t1]  # (B, nb Cb, D)
        s = kb.amax(dim=1) * _LOG2E  # (B, D): block shift, log2 units
        if st is not None:  # keep the carried state's scale below the shift as well
            s = torch.maximum(s, sp + torch.log2(st[1]) - (Cb + 1) / 2 * w2)
        kj = kb.view(B, nb, Cb, D).permute(2, 0, 1, 3)  # (Cb, B, nb, D)
        vj = v[:, t0:t1].view(B, nb, Cb, D).permute(2, 0, 1, 3)  # (Cb, B, nb, D)
        X = torch.empty(Cb, 2, B, nb, D, device=dev)  # [:, 0] E v, [:, 1] E
        E = X[:, 1]
        torch.add(-s[:, None, :], kj, alpha=_LOG2E, out=E)  # (k - s) in log2 units
        E.exp2_()
        E.mul_(etab[:, None, None, :])
        torch.mul(E, vj, out=X[:, 0])
        Y = torch.empty(Cb, 2, B, nb, D, device=dev)
        tau = Y[0]  # (2, B, nb, D): state entering each chunk, the row-0 prefix
        # tau_n = e^{-C w} (tau_{n-1} + sum_j X_j of chunk n-1): seed tau_0 with the carried state
        # and the rest with each chunk's decayed sums, then a doubling scan (log2 nb steps)
        if nb > 1:
            torch.mul(X[:, :, :, : nb - 1].sum(0), decay, out=tau[:, :, 1:])
        if st is None:
            tau[:, :, 0] = 0
        else:
            torch.mul(st, (torch.exp2(sp - s) * from_start)[None], out=tau[:, :, 0])
        step = 1
        while step < nb:
            if (Cb, step) not in powers:
                powers[Cb, step] = torch.exp(-step * Cb * w64).float()
            shifted = torch.mul(tau[:, :, : nb - step], powers[Cb, step])
            tau[:, :, step:] += shifted
            step *= 2
        for j in range(1, Cb):
            torch.add(Y[j - 1], X[j - 1], out=Y[j])
        # the state at the block's end relative to 2^s: (2, B, D); the next block scales it up by
        # as much as 1 / st[1], so its denominator must clear 2^-90 as every row's does
        st = (Y[Cb - 1, :, :, nb - 1] + X[Cb - 1, :, :, nb - 1]) * to_end
        den_min = torch.minimum(den_min, st[1].amin(0))
        sp = s
        Y.addcmul_(X, beta[None, None, None, :])
        torch.div(Y[:, 0], Y[:, 1], out=out[:, t0:t1].view(B, nb, Cb, D).permute(2, 0, 1, 3))
        # every row's denominator is >= tau_B + min(1, beta) E_0 (the prefix only grows), a bound
        # on 1/C of the data; the exact minimum is taken only where the bound is too low
        low = torch.addcmul(tau[1], X[0, 1], beta_le1).view(-1, D).amin(0)  # (D,)
        if bool((low < 2.0**_MIN_DEN_LOG2).any()):
            low = torch.maximum(low, Y[:, 1].amin(0).view(-1, D).amin(0))
        den_min = torch.minimum(den_min, low)
        num_sum += Y[:, 0].sum(0).view(-1, D).sum(0)
    return (den_min >= 2.0**_MIN_DEN_LOG2) & torch.isfinite(num_sum)


def _wkv_window_fp32(w64, u64, k, v, out):
    """WKV for fast-decaying channels as a short window over past tokens, fp32, no autograd.

    Token t-l weighs e^{k_{t-l} - (l-1) w} against the current token's e^{u + k_t}; once
    (l-1) w exceeds the keys' range plus _WINDOW_TAIL_NATS, everything further back weighs less
    than e^{-28} of the denominator, so the window stops there (a bound far below fp32 rounding).
    Returns (D,) bool: channels proven accurate (window within _MAX_WINDOW, denominators >= 2^-90,
    outputs finite); the caller recomputes the others exactly.
    """
    B, T, D = k.shape
    kmin, kmax = k.amin(dim=1), k.amax(dim=1)  # (B, D)
    spread = (kmax - kmin).amax(0).double()  # (D,) key range over the sequence, nats
    # tail after L tokens <= e^{spread - u - L w} / (1 - e^{-w}) of the current token's weight
    need = (spread - u64 + _WINDOW_TAIL_NATS - torch.log1p(-torch.exp(-w64))) / w64
    window = int(min(max(1.0, float(need.max().ceil())), T - 1 if T > 1 else 1))
    ok = (
        (need <= _MAX_WINDOW) & (u64 <= _MAX_BONUS_NATS) & (spread - u64 <= -_MIN_DEN_LOG2 / _LOG2E)
    )
    window = min(window, _MAX_WINDOW)
    X = torch.empty(2, B, T, D, device=k.device)
    E = X[1]
    torch.add(-(kmax * _LOG2E)[:, None, :], k, alpha=_LOG2E, out=E)
    E.exp2_()
    torch.mul(E, v, out=X[0])
    acc = X * torch.exp(u64).float()
    for lag in range(1, min(window, T - 1) + 1):
        coef = torch.exp(-(lag - 1) * w64).float()
        acc[:, :, lag:].addcmul_(X[:, :, :-lag], coef)
    torch.div(acc[0], acc[1], out=out)
    den_min = acc[1].amin(dim=1).amin(0)  # (D,)
    return ok & (den_min >= 2.0**_MIN_DEN_LOG2) & torch.isfinite(acc[0].sum(dim=1).sum(0))


def _channel_groups(mask):
    """Indices of the True channels as a slice when they are contiguous (a view, no copy)."""
    idx = mask.nonzero().flatten()
    if len(idx) and int(idx[-1] - idx[0]) + 1 == len(idx):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _wkv_fast(time_decay, time_first, k, v, C: int):
    """Inference WKV: chunked fp32 for slow and medium channels, a window for the fastest, and
    the exact log-space form for any channel whose accuracy checks fail. Returns (B, T, D) fp32."""
    B, T, D = k.shape
    if T == 0:
        return torch.empty(B, T, D, device=k.device)
    k, v = k.float(), v.float()
    w64 = torch.exp(time_decay.detach().double())
    u64 = time_first.detach().double()
    out = torch.empty(B, T, D, device=k.device)
    ok = torch.zeros(D, dtype=torch.bool, device=k.device)
    todo = u64 <= _MAX_BONUS_NATS
    sizes = [C] + [c for c in _SMALL_CHUNKS if c < C]
    groups = []
    for size in sizes:
        mask = todo & (size * w64 <= _CHUNK_DECAY_BUDGET)
        todo &= ~mask
        groups.append((mask, size))
    groups.append((todo, None))  # the fastest channels: the window form
    for mask, size in groups:
        if not bool(mask.any()):
            continue
        g = _channel_groups(mask)
        kg, vg, wg, ug = k[..., g], v[..., g], w64[g], u64[g]
        Dg = kg.shape[-1]
        in_place = isinstance(g, slice) and 2 * Dg >= D
        if in_place:  # wide enough to run on the strided views, written straight into out
            part = out[..., g]
        else:  # scattered or narrow rows: copy them, with the batch folded into the channels
            # ((B, T, Dg) -> (1, T, B Dg)) so that every vector pass runs over long rows
            kg = kg.transpose(0, 1).reshape(1, T, B * Dg)  # (1, T, B Dg)
            vg = vg.transpose(0, 1).reshape(1, T, B * Dg)
            wg, ug = wg.repeat(B), ug.repeat(B)
            part = torch.empty_like(kg)
        if size is None:
            good = _wkv_window_fp32(wg, ug, kg, vg, part)
        else:
            good = _wkv_chunks_fp32(wg, ug, kg, vg, part, size)
        if not in_place:
            out[..., g] = part.view(T, B, Dg).transpose(0, 1)  # (B, T, Dg)
            good = good.view(B, Dg).all(0)  # (Dg,)
        ok[g] = good
    bad = ~ok
    if bool(bad.any()):
        out[..., bad] = _wkv_log_matrix(time_decay[bad], time_first[bad], k[..., bad], v[..., bad])
    return out


def wkv_chunked(time_decay, time_first, k, v, chunk_size: int = 16):
    """WKV for all T tokens at once, in chunks of `chunk_size`: the parallel form.

    time_decay, time_first (D,); k, v (B, T, D), any float dtype. Returns (B, T, D) float32.

    Without autograd (inference) it runs `_wkv_fast`: fp32 chunks for every channel that
    factorises (C w <= 32 nats, with smaller chunks for faster channels), a short exact window for
    the fastest, and accuracy checks whose failures send a channel to the exact log-space form.
    With autograd it runs the fp64 factorised form (`_wkv_factorised`), whose every operation is
    differentiable. Should keys ever spread so far that a factorised sum under- or overflows, the
    result falls back to `wkv_sequential`, so the answer is always the recurrence's.
    """
    B, T, D = k.shape
    C = max(1, min(chunk_size, T))
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (time_decay, time_first, k, v)
    )
    if not needs_grad:  # every channel is checked or recomputed exactly inside
        return _wkv_fast(time_decay, time_first, k, v, C)
    fast = torch.exp(time_decay.detach().float()) * C > _EXP_BUDGET  # (D,)
    if not bool(fast.any()):
        out = _wkv_factorised(time_decay, time_first, k, v, C)
    else:
        slow = ~fast
        out = torch.empty(B, T, D, device=k.device, dtype=torch.float32)
        out[..., fast] = _wkv_log_matrix(
            time_decay[fast], time_first[fast], k[..., fast], v[..., fast], C
        )
        if bool(slow.any()):
            out[..., slow] = _wkv_factorised(
                time_decay[slow], time_first[slow], k[..., slow], v[..., slow], C
            )
    if not bool(torch.isfinite(out).all()):
        log.warning(
            "WKV: factorised sums out of range (extreme keys); using the sequential recurrence"
        )
        out = wkv_sequential(time_decay, time_first, k, v).float()
    return out


def wkv_gated(time_decay, time_first, k, v, r=None, chunk_size: int = 16):
    """sigmoid(r) * `wkv_chunked(...)`, the PyTorch path of models/kernels' "wkv": r (B, T, D)
    the receptance before its sigmoid, or None. Returns (B, T, D) in r's dtype (fp32 without r)."""
    wkv = wkv_chunked(time_decay, time_first, k, v, chunk_size)
    return wkv if r is None else (torch.sigmoid(r) * wkv).to(r.dtype)


def _time_shift(x: torch.Tensor) -> torch.Tensor:
    """x shifted one step later in time, zeros at t = 0: (B, T, D) -> (B, T, D)."""
    return F.pad(x, (0, 0, 1, -1))


def _depth_ratios(layer_idx: int | None, n_layers: int) -> tuple[float, float]:
    """RWKV-4's initialisation ratios of a layer (as in Zoology / BlinkDL): one rises from 0 at
    the first layer to 1 at the last, the other falls from 1 towards 0."""
    layer = layer_idx or 0
    return layer / max(1, n_layers - 1), 1.0 - layer / n_layers


def _channel_ramp(d_model: int) -> torch.Tensor:
    """(1, 1, D): channel i at i / D, the base of the token-shift mixing ratios `time_mix_*`."""
    return (torch.arange(d_model, dtype=torch.float32) / d_model)[None, None]


@dataclass
class RWKVTimeMixerOptions:
    d_attn: int | None = None  # attention width; None = d_model, as in RWKV-4
    chunk_size: int = 16  # 16 balances the O(C) intra-chunk work against the scan's steps
    mode: str = "chunked"  # or "sequential": the reference recurrence

    def __post_init__(self):
        if self.mode not in ("chunked", "sequential"):
            raise ValueError(f"mode {self.mode!r}: choose chunked or sequential")


class RWKVTimeMixer(Mixer):
    """RWKV-4 time mixing: token shift, k/v/r projections, WKV, `output(sigmoid(r) ⊙ wkv)`."""

    Options = RWKVTimeMixerOptions
    mixer_name = "rwkv"

    def build(self, opts: RWKVTimeMixerOptions) -> None:
        d_model = self.d_model
        d_attn = opts.d_attn or d_model
        self.chunk_size = opts.chunk_size
        self.mode = opts.mode
        ratio_0_to_1, ratio_1_to_almost0 = _depth_ratios(self.layer_idx, self.n_layers)
        with torch.no_grad():  # RWKV-4's initialisation (as in Zoology / BlinkDL)
            h = torch.arange(d_attn, dtype=torch.float32)
            decay_speed = -5 + 8 * (h / max(1, d_attn - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
            self.time_decay = nn.Parameter(decay_speed)
            zigzag = torch.tensor([(i + 1) % 3 - 1 for i in range(d_attn)]) * 0.5
            self.time_first = nn.Parameter(torch.ones(d_attn) * math.log(0.3) + zigzag)
            x = _channel_ramp(d_model)  # (1, 1, D)
            self.time_mix_k = nn.Parameter(x.pow(ratio_1_to_almost0))
            self.time_mix_v = nn.Parameter(x.pow(ratio_1_to_almost0) + 0.3 * ratio_0_to_1)
            self.time_mix_r = nn.Parameter(x.pow(0.5 * ratio_1_to_almost0))
        self.key = nn.Linear(d_model, d_attn, bias=False)
        self.value = nn.Linear(d_model, d_attn, bias=False)
        self.receptance = nn.Linear(d_model, d_attn, bias=False)
        self.output = nn.Linear(d_attn, d_model, bias=False)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        xx = _time_shift(x)  # (B, T, D)
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))  # (B, T, A)
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r))
        if self.mode == "sequential":
            wkv = wkv_sequential(self.time_decay, self.time_first, k, v)
            return self.output((torch.sigmoid(r) * wkv).to(r.dtype))
        gated = run_op("wkv", self.time_decay, self.time_first, k, v, r, self.chunk_size)
        return self.output(gated)  # sigmoid(r) * wkv, in r's dtype


@dataclass
class RWKVChannelMixerOptions:
    d_hidden: int | None = None  # None = 4 d_model, as in RWKV-4


class RWKVChannelMixer(StateMixer):
    """RWKV-4 channel mixing: `sigmoid(receptance(xr)) ⊙ value(relu(key(xk))^2)` (Zoology's
    `RWKVStateMixer`)."""

    Options = RWKVChannelMixerOptions
    mixer_name = "rwkv"

    def build(self, opts: RWKVChannelMixerOptions) -> None:
        d_model = self.d_model
        d_hidden = opts.d_hidden or 4 * d_model
        _, ratio_1_to_almost0 = _depth_ratios(self.layer_idx, self.n_layers)
        with torch.no_grad():
            x = _channel_ramp(d_model)  # (1, 1, D)
            self.time_mix_k = nn.Parameter(x.pow(ratio_1_to_almost0))
            self.time_mix_r = nn.Parameter(x.pow(ratio_1_to_almost0))
        self.key = nn.Linear(d_model, d_hidden, bias=False)
        self.receptance = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xx = _time_shift(x)
        k = torch.square(torch.relu(self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        return r * self.value(k)


RWKVStateMixer = RWKVChannelMixer  # Zoology's name


class FastRwkvBlock(nn.Module):
    def __init__(self, d_model, d_attn, d_hidden, layer_id, n_layers, eps, chunk_size):
        super().__init__()
        self.layer_id = layer_id
        if layer_id == 0:
            self.pre_ln = nn.LayerNorm(d_model, eps=eps)
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.attention = RWKVTimeMixer(
            d_model, layer_idx=layer_id, n_layers=n_layers, d_attn=d_attn, chunk_size=chunk_size
        )
        self.feed_forward = RWKVChannelMixer(
            d_model, layer_idx=layer_id, n_layers=n_layers, d_hidden=d_hidden
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer_id == 0:
            x = self.pre_ln(x)
        x = x + self.attention(self.ln1(x))
        return x + self.feed_forward(self.ln2(x))


class FastRwkvModel(nn.Module):
    def __init__(self, config, chunk_size: int = 16):
        super().__init__()
        self.rescale_every = config.rescale_every
        d, n_layers = config.hidden_size, config.num_hidden_layers
        d_attn = config.attention_hidden_size or d
        d_hidden = config.intermediate_size or 4 * d
        self.embeddings = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList(
            FastRwkvBlock(d, d_attn, d_hidden, i, n_layers, config.layer_norm_epsilon, chunk_size)
            for i in range(n_layers)
        )
        self.ln_out = nn.LayerNorm(d)  # transformers builds ln_out with the default epsilon

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)  # (B, T, D)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.rescale_every > 0 and (i + 1) % self.rescale_every == 0:
                x = x / 2  # transformers' inference rescaling (the weights are rescaled to match)
        return self.ln_out(x)


class FastRwkv(nn.Module):
    """`RwkvForCausalLM`'s function with the chunked WKV, for a transformers `RwkvConfig`
    (filled by models.checkpoints.hf_rwkv.rwkv_from_transformers)."""

    def __init__(self, config, chunk_size: int = 16):
        super().__init__()
        self.config = config
        self.rwkv = FastRwkvModel(config, chunk_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def hidden_and_head(self, input_ids: torch.Tensor):
        return self.rwkv(input_ids), self.head.weight, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rwkv(input_ids))  # (B, T, V) logits
