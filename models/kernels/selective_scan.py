"""Mamba-1's selective scan and its short causal convolution as Triton kernels (Gu & Dao, 2023,
arXiv:2312.00752, Algorithm 2), beside `reference`, the paper's equations in plain PyTorch.

For channel e and state n, with Δ_t = softplus(dt_t + dt_bias) and A = -exp(A_log):

    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,        y_t = (C_t . h_t + D u_t) silu(z_t)

`selective_scan_triton` gives each program one sequence and a block of channels, whose (BLOCK_E, N)
state stays in registers while the program steps through the tokens: per token it loads u, dt,
z (BLOCK_E) and B, C (N), forms the decay exp(Δ A) and input Δ B u, updates the state, and writes
the readout with C, the D skip and the gate applied. The softplus of dt + bias is fused in (as
mamba_ssm's `delta_bias`/`delta_softplus`), so no (B, T, E) fp32 Δ, decay or input is ever
written: the kernel reads each input once and writes y once. Every factor is at most 1, so
nothing overflows at any decay, as in models/mixers/mamba.py's chunked form. The eval's batches
(128 windows) give thousands of programs, enough to fill a GPU without splitting the time axis
(a scan inside chunks of tokens, as mamba_ssm's kernel does, would pay off at small batches).

The convolution is a kernel of its own (`causal_conv1d_silu_triton`), not fused into the scan:
x_proj reads the convolved u of every channel to make dt, B and C, so u must reach memory before
the scan can start anyway, and recomputing it inside the scan would read the W-token window
instead of one value per token. Its kernel reads the strided half of in_proj's output in place
and writes u once (the PyTorch path pads, convolves, slices, applies SiLU and transposes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Block sizes (untuned on a GPU: chosen by register arithmetic and ptxas's count, to be measured
# with `make bench-gpu`). A program holds the (BLOCK_E, N) state of 64 channels (N = 16: 1024
# fp32 values) across 2 warps, 16 a thread; ptxas for sm_90 gives 94 registers a thread and no
# spills (4 warps took 144, so fewer programs fit an SM). A token's loads of u, dt and z are
# 128-byte rows. The grid is (batch, E / 64): 3072 programs for a batch of 128 at Mamba-130M's
# E = 1536, about ten resident per SM, whose arithmetic hides each other's load latency.
SCAN_BLOCK_E = 64
SCAN_WARPS = 2
# The convolution is elementwise work: (64 tokens, 64 channels) tiles, 32 values a thread.
CONV_BLOCK_T = 64
CONV_BLOCK_E = 64


def reference(x, conv_weight, conv_bias, dt, dt_bias, A, B, C, D, z):
    """The fused pair's result from the paper's equations, in fp64, one token at a time:
    u = silu(causal depthwise conv(x)), then y = (C . h + D u) silu(z) with the recurrence above.

    x, dt, z (B, T, E); conv_weight (E, 1, W); conv_bias, dt_bias, D (E,); A (E, N);
    B, C (B, T, N); conv_bias, dt_bias, D and z may be None. Returns (u, y), (B, T, E) fp64 each.
    """
    import torch.nn.functional as F

    from models.mixers.mamba import selective_scan_sequential

    f64 = torch.float64
    T, W = x.shape[1], conv_weight.shape[-1]

    def f64_or_none(t):
        return None if t is None else t.to(f64)

    conv = F.conv1d(
        x.to(f64).transpose(1, 2), conv_weight.to(f64), f64_or_none(conv_bias), padding=W - 1,
        groups=x.shape[-1],
    )[..., :T]  # fmt: skip
    u = F.silu(conv).transpose(1, 2)  # (B, T, E)
    delta = F.softplus(dt.to(f64) if dt_bias is None else dt.to(f64) + dt_bias.to(f64))
    y = selective_scan_sequential(u, delta, A.to(f64), B.to(f64), C.to(f64), f64_or_none(D), z)
    return u, y


@triton.jit
def _scan_inputs(u_p, dt_p, b_p, c_p, z_p, t, su_t, sdt_t, sb_t, sc_t, sz_t, e_ok, n_ok,
                 HAS_Z: tl.constexpr):  # fmt: skip
    # token t's u, dt, z (BLOCK_E,) and B, C (BLOCK_N,) in fp32 (t < T: the caller clamps it)
    u = tl.load(u_p + t * su_t, mask=e_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_p + t * sdt_t, mask=e_ok, other=0.0).to(tl.float32)
    Bt = tl.load(b_p + t * sb_t, mask=n_ok, other=0.0).to(tl.float32)
    Ct = tl.load(c_p + t * sc_t, mask=n_ok, other=0.0).to(tl.float32)
    z = u
    if HAS_Z:
        z = tl.load(z_p + t * sz_t, mask=e_ok, other=0.0).to(tl.float32)
    return u, dt, Bt, Ct, z


@triton.jit(do_not_specialize=["T", "su_b", "sdt_b", "sb_b", "sc_b", "sz_b", "so_b"])
def _selective_scan_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr,
    T, E, N,
    su_b, su_t, su_e, sdt_b, sdt_t, sdt_e, sb_b, sb_t, sb_n, sc_b, sc_t, sc_n,
    sz_b, sz_t, sz_e, so_b, so_t,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)  # (64-bit: b times a batch stride passes 2^31 at scale)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    e_ok = e < E
    n_ok = n < N
    A = tl.load(A_ptr + e[:, None] * N + n[None, :], mask=e_ok[:, None] & n_ok[None, :], other=0.0)
    D = tl.zeros((BLOCK_E,), dtype=tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_E,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    u_p = u_ptr + b * su_b + e * su_e
    dt_p = dt_ptr + b * sdt_b + e * sdt_e
    b_p = B_ptr + b * sb_b + n * sb_n
    c_p = C_ptr + b * sc_b + n * sc_n
    z_p = z_ptr + b * sz_b + e * sz_e
    o_p = out_ptr + b * so_b + e
    h = tl.zeros((BLOCK_E, BLOCK_N), dtype=tl.float32)  # (BLOCK_E, BLOCK_N): the state
    u_n, dt_n, B_n, C_n, z_n = _scan_inputs(
        u_p, dt_p, b_p, c_p, z_p, 0, su_t, sdt_t, sb_t, sc_t, sz_t, e_ok, n_ok, HAS_Z
    )
    for t in range(T):
        u, dt, Bt, Ct, z = u_n, dt_n, B_n, C_n, z_n
        # the next token's loads are issued before this token's arithmetic, which hides their
        # latency (after the last token they read it again, unused)
        t_next = tl.minimum(t + 1, T - 1)
        u_n, dt_n, B_n, C_n, z_n = _scan_inputs(
            u_p, dt_p, b_p, c_p, z_p, t_next, su_t, sdt_t, sb_t, sc_t, sz_t, e_ok, n_ok, HAS_Z
        )
        dt = dt + bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # softplus
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1) + D * u  # (BLOCK_E,)
        if HAS_Z:
            y = y * (z / (1.0 + tl.exp(-z)))
        tl.store(o_p + t * so_t, y, mask=e_ok)


def selective_scan_triton(u, dt, A, B, C, D=None, z=None, dt_bias=None, chunk_size: int = 16):
    """The gated selective scan (module docstring) on the kernel: u, dt, z (B, T, E), dt before
    its bias and softplus; A (E, N) fp32; B, C (B, T, N), views of one tensor or not; D, dt_bias
    (E,). Any strides. Returns (B, T, E) in u's dtype. `chunk_size` is the PyTorch path's (the
    kernel steps through tokens one at a time)."""
    Bsz, T, E = u.shape
    N = A.shape[1]
    out = torch.empty(Bsz, T, E, device=u.device, dtype=u.dtype)
    if T == 0 or Bsz == 0:
        return out
    A = A.float().contiguous()
    dummy = u  # the pointer of an absent tensor (never read: its HAS_* is False)
    grid = (Bsz, triton.cdiv(E, SCAN_BLOCK_E))
    _selective_scan_kernel[grid](
        u, dt, A, B, C, dummy if D is None else D, dummy if z is None else z,
        dummy if dt_bias is None else dt_bias, out, T, E, N,
        *u.stride(), *dt.stride(), *B.stride(), *C.stride(),
        *(z.stride() if z is not None else (0, 0, 0)), out.stride(0), out.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
        BLOCK_E=SCAN_BLOCK_E, BLOCK_N=triton.next_power_of_2(N),
        num_warps=SCAN_WARPS,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["T", "sx_b"])
def _causal_conv1d_silu_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, T, E, sx_b, sx_t, so_b, so_t,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)  # (BLOCK_E,)
    e_ok = e < E
    if HAS_BIAS:
        acc = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        acc = tl.broadcast_to(acc, (BLOCK_T, BLOCK_E))
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k in tl.static_range(W):  # tap k reads token t - (W - 1 - k); before 0 is the padding
        src = t - (W - 1 - k)
        ok = ((src >= 0) & (src < T))[:, None] & e_ok[None, :]
        xs = tl.load(x_ptr + b * sx_b + src[:, None] * sx_t + e[None, :], mask=ok, other=0.0)
        w = tl.load(w_ptr + e * W + k, mask=e_ok, other=0.0).to(tl.float32)
        acc += xs.to(tl.float32) * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    keep = (t < T)[:, None] & e_ok[None, :]
    tl.store(out_ptr + b * so_b + t[:, None] * so_t + e[None, :], y, mask=keep)


def causal_conv1d_silu_triton(x, weight, bias=None):
    """silu(depthwise causal conv1d(x)) on the kernel: x (B, T, E), channels contiguous (a view of
    in_proj's output is fine); weight (E, 1, W), bias (E,) or None. Returns (B, T, E) contiguous
    in x's dtype."""
    Bsz, T, E = x.shape
    W = weight.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(Bsz, T, E, device=x.device, dtype=x.dtype)
    if T == 0 or Bsz == 0:
        return out
    weight = weight.reshape(E, W).contiguous()
    grid = (Bsz, triton.cdiv(T, CONV_BLOCK_T), triton.cdiv(E, CONV_BLOCK_E))
    _causal_conv1d_silu_kernel[grid](
        x, weight, weight if bias is None else bias, out, T, E, x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), W=W, HAS_BIAS=bias is not None, BLOCK_T=CONV_BLOCK_T,
        BLOCK_E=CONV_BLOCK_E,
    )  # fmt: skip
    return out
