"""RWKV-4's WKV as a Triton kernel (Peng et al., 2023, arXiv:2305.13048, eq. 16-17), gated by
sigmoid(receptance), beside `reference`, the paper's sum written out in fp64.

For channel d with w = exp(time_decay) > 0 and u = time_first:

    wkv_t = (sum_{i<t} e^{k_i - (t-1-i) w} v_i + e^{u + k_t} v_t)
          / (sum_{i<t} e^{k_i - (t-1-i) w}     + e^{u + k_t})

The kernel carries the state as models/mixers/rwkv.py's `wkv_sequential` and BlinkDL's CUDA
kernel do: numerator a and denominator b scaled by e^{-p}, p the running maximum exponent, so no
exponent it takes is positive and nothing overflows at any decay or key. One program holds a
block of channels of one sequence and steps through its tokens; the eval's batches (128 windows)
give thousands of programs, enough to fill a GPU without splitting the time axis. The output is
multiplied by sigmoid(r) and written in r's dtype while it is in registers, so the (B, T, D)
fp32 WKV never reaches memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 128 channels a program: one per thread at 4 warps, so each token's loads of k, v and r are
# 512-byte coalesced rows; (batch, D / 128) programs, 768 for a batch of 128 at d_model 768.
# Untuned: to be measured with `make bench-gpu`.
WKV_BLOCK_D = 128
WKV_WARPS = 4


def reference(time_decay, time_first, k, v, r=None):
    """The WKV as the paper's sums, each output formed from scratch in fp64 (O(T^2)):
    time_decay, time_first (D,); k, v, r (B, T, D). Returns (B, T, D) fp64, times sigmoid(r)
    when r is given."""
    f64 = torch.float64
    w = torch.exp(time_decay.to(f64))  # (D,)
    k, v = k.to(f64), v.to(f64)
    T = k.shape[1]
    out = torch.empty_like(k)
    for t in range(T):
        i = torch.arange(t, dtype=f64, device=k.device)[:, None]  # (t, 1): earlier tokens
        logw = torch.cat([k[:, :t] - (t - 1 - i) * w, (time_first.to(f64) + k[:, t])[:, None]], 1)
        m = logw.amax(1, keepdim=True)  # (B, 1, D): only for range, the ratio is exact
        weights = torch.exp(logw - m)  # (B, t + 1, D)
        out[:, t] = (weights * v[:, : t + 1]).sum(1) / weights.sum(1)
    return out if r is None else out * torch.sigmoid(r.to(f64))


@triton.jit
def _wkv_inputs(k_p, v_p, r_p, t, sk_t, sv_t, sr_t, d_ok, HAS_R: tl.constexpr):
    # token t's k, v, r (BLOCK_D,) in fp32 (t < T: the caller clamps it)
    k = tl.load(k_p + t * sk_t, mask=d_ok, other=0.0).to(tl.float32)
    v = tl.load(v_p + t * sv_t, mask=d_ok, other=0.0).to(tl.float32)
    r = k
    if HAS_R:
        r = tl.load(r_p + t * sr_t, mask=d_ok, other=0.0).to(tl.float32)
    return k, v, r


@triton.jit(do_not_specialize=["T", "sk_b", "sv_b", "sr_b", "so_b"])
def _wkv_kernel(
    decay_ptr, first_ptr, k_ptr, v_ptr, r_ptr, out_ptr, T, D,
    sk_b, sk_t, sv_b, sv_t, sr_b, sr_t, so_b, so_t,
    HAS_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)  # (64-bit: b times a batch stride passes 2^31 at scale)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < D
    w = -tl.exp(tl.load(decay_ptr + d, mask=d_ok, other=0.0).to(tl.float32))  # log decay, < 0
    u = tl.load(first_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    k_p, v_p, r_p = k_ptr + b * sk_b + d, v_ptr + b * sv_b + d, r_ptr + b * sr_b + d
    o_p = out_ptr + b * so_b + d
    num = tl.zeros((BLOCK_D,), dtype=tl.float32)  # the state: (num, den) e^p
    den = tl.zeros((BLOCK_D,), dtype=tl.float32)
    p = tl.full((BLOCK_D,), -1e38, dtype=tl.float32)  # "log of zero" that stays finite
    k_n, v_n, r_n = _wkv_inputs(k_p, v_p, r_p, 0, sk_t, sv_t, sr_t, d_ok, HAS_R)
    for t in range(T):
        k, v, r = k_n, v_n, r_n
        # the next token's loads go out before this token's arithmetic (after the last token they
        # read it again, unused)
        t_next = tl.minimum(t + 1, T - 1)
        k_n, v_n, r_n = _wkv_inputs(k_p, v_p, r_p, t_next, sk_t, sv_t, sr_t, d_ok, HAS_R)
        q = tl.maximum(p, u + k)
        a, e = tl.exp(p - q), tl.exp(u + k - q)
        y = (a * num + e * v) / (a * den + e)
        if HAS_R:
            y = y / (1.0 + tl.exp(-r))
        tl.store(o_p + t * so_t, y, mask=d_ok)
        q = tl.maximum(p + w, k)
        a, e = tl.exp(p + w - q), tl.exp(k - q)
        num, den, p = a * num + e * v, a * den + e, q


def wkv_triton(time_decay, time_first, k, v, r=None, chunk_size: int = 16):
    """sigmoid(r) * WKV on the kernel (module docstring): time_decay, time_first (D,); k, v, r
    (B, T, D) with contiguous channels, r before its sigmoid or None. Returns (B, T, D) in r's
    dtype (fp32 without r). `chunk_size` is the PyTorch path's (the kernel steps token by token)."""
    Bsz, T, D = k.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if r is not None and r.stride(-1) != 1:
        r = r.contiguous()
    out = torch.empty(Bsz, T, D, device=k.device, dtype=torch.float32 if r is None else r.dtype)
    if T == 0 or Bsz == 0:
        return out
    grid = (Bsz, triton.cdiv(D, WKV_BLOCK_D))
    rr = k if r is None else r  # (never read without r)
    _wkv_kernel[grid](
        time_decay.contiguous(), time_first.contiguous(), k, v, rr, out, T, D,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), rr.stride(0), rr.stride(1),
        out.stride(0), out.stride(1), HAS_R=r is not None, BLOCK_D=WKV_BLOCK_D,
        num_warps=WKV_WARPS,
    )  # fmt: skip
    return out
