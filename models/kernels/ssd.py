"""Mamba-2's SSD scan as one Triton kernel (Dao & Gu, 2024, arXiv:2405.21060, §6 and Listing 1),
beside its reference, models/mixers/mamba2.py's `ssd_sequential` (the paper's recurrence one
token at a time, in fp64 when given fp64), which the tests hold it to.

For head h of group g, channel p and state n, with Δ_t = clamp(softplus(dt_t + dt_bias)) and the
scalar A_h < 0:

    h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t,        y_t = (C_t . h_t + D x_t) silu(z_t)

The kernel computes the paper's block decomposition, as `ssd_chunked` and mamba_ssm's
`mamba_chunk_scan_combined` do, but in one kernel where mamba_ssm launches five (chunk cumsum,
C B^T per chunk, chunk states, state passing, chunk scan). A program owns one sequence, one head
and a block of its channels; it walks the sequence a chunk of CHUNK tokens at a time, keeping the
(BLOCK_P, N) state in registers, and per chunk:

  * Δ (dt + bias, softplus, clamp: none of it is written to memory) and its cumulative sum
    cs = cumsum(Δ A) from the chunk's start, in fp32 (CHUNK terms: every decay is the
    exponential of a difference of two of them, <= 0, so nothing overflows at any decay);
  * the diagonal block: y_l = sum_{s<=l} (C_l . B_s) exp(cs_l - cs_s) Δ_s x_s;
  * the entering state: y_l += exp(cs_l) C_l . state; then D x and the silu(z) gate, and y is
    written once, in x's dtype;
  * the state leaving the chunk: state = exp(cs_end) state + sum_s exp(cs_end - cs_s) Δ_s x_s B_s.

Every sum is a tl.dot (tensor cores in bf16; in fp32 the dots are IEEE, as the reference needs),
each with the program's channels as its rows: y^T = x^T M^T + state C^T, state += (x w)^T B.
Written that way the (CHUNK, CHUNK) block M^T is a dot's right operand, which Triton stages
through shared memory; as a left operand (y = M x) it must stay in the registers of the warps
that computed it, and ptxas needed every register of a thread for it (253 at 8 warps).

Why one kernel: mamba_ssm's split writes every chunk's (P, N) state to memory in fp32 and reads
it back twice (at Mamba-2-130M's shapes, T 2048 and 128 windows a batch, 0.8 GB a layer), where
here the state never leaves registers and each input is read once. The price: a program's
chunks run in order, so the parallelism is batch x heads x channel blocks, which the eval's
batches make ample (128 windows x 24 heads: 3072 programs), and a single short sequence leaves a
GPU mostly idle; and C B^T is recomputed by every head of a group (mamba_ssm computes it once
per group), tensor-core work of the same order as the other three dots.

The chunk is the kernel's own (below); the `chunk_size` argument is the PyTorch path's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.mixers.mamba2 import NO_DT_LIMIT

# Launch configuration (untuned on a GPU: chosen by ptxas's figures for sm_90, compiled on a CPU,
# at Mamba-2-130M's shapes; to be measured with `make bench-gpu`). In bf16: chunks of 64 tokens
# (the 32 chunks of a 2048-token window are 32 steps of four 64-wide dots), 64 channels a program
# (one block for the published headdim 64), 4 warps and 2 pipeline stages: 228 registers a thread
# and no spills, 82 KB of shared memory, so two programs fit an SM (8 warps took 219 registers
# a thread and 3 stages 123 KB, one program an SM). In fp32 the IEEE dots are FMA loops that
# spill at any size; chunks of 32 keep their shared memory at 78 KB, under the 99 KB an sm_86/89
# GPU gives a program (fp32 on a GPU is the path for exact losses, not for speed).
SSD_CHUNK = 64
SSD_CHUNK_FP32 = 32
SSD_BLOCK_P = 64
SSD_BLOCK_P_WIDE_STATE = 32  # past 128 states the (P, N) state outgrows the registers: halve P
SSD_WARPS = 4
SSD_STAGES = 2


# (the strides are specialized: Triton vectorizes a load only where it knows a row's alignment,
# that is, every stride divisible by 16; the length is not, so windows of any length share one)
@triton.jit(do_not_specialize=["T"])
def _ssd_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr, out_ptr, hT_ptr,
    T, H, P, N, heads_per_group, dt_min, dt_max,
    sx_b, sx_t, sx_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g,
    sz_b, sz_t, sz_h, so_b, so_t, so_h,
    HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # program (head h, channel block), sequence b: the heads of one sequence are launched side by
    # side, so their group's B and C come from L2
    blocks_p = tl.cdiv(P, BLOCK_P)
    h = tl.program_id(0) // blocks_p
    p = (tl.program_id(0) % blocks_p) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    b = tl.program_id(1).to(tl.int64)  # (64-bit: b times a batch stride passes 2^31 at scale)
    g = h // heads_per_group
    n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    q = tl.arange(0, CHUNK)  # (CHUNK,): a token's place in its chunk
    p_ok = p < P
    n_ok = n < N
    A = tl.load(A_ptr + h).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    D = tl.zeros((BLOCK_P,), dtype=tl.float32)
    if HAS_D:
        if D_HAS_HDIM:
            D = tl.load(D_ptr + h * P + p, mask=p_ok, other=0.0).to(tl.float32)
        else:
            D = D + tl.load(D_ptr + h).to(tl.float32)
    x_p = x_ptr + b * sx_b + h * sx_h + p  # (BLOCK_P,) at token 0
    z_p = z_ptr + b * sz_b + h * sz_h + p
    o_p = out_ptr + b * so_b + h * so_h + p
    dt_p = dt_ptr + b * sdt_b + h * sdt_h
    b_p = B_ptr + b * sb_b + g * sb_g + n  # (BLOCK_N,)
    c_p = C_ptr + b * sc_b + g * sc_g + n
    pn = (b * H + h) * P * N + p[:, None] * N + n[None, :]  # (BLOCK_P, BLOCK_N) of (b, h, p, n)
    pn_ok = p_ok[:, None] & n_ok[None, :]
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)  # (BLOCK_P, BLOCK_N): h_t
    if HAS_H0:
        state = tl.load(h0_ptr + pn, mask=pn_ok, other=0.0).to(tl.float32)
    last = q == CHUNK - 1
    for t0 in range(0, T, CHUNK):
        t = t0 + q  # (CHUNK,)
        t_ok = t < T  # the last chunk may be short
        dt = tl.load(dt_p + t * sdt_t, mask=t_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            dt = dt + bias
        if DT_SOFTPLUS:  # softplus, the identity above 20 (as F.softplus)
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
        if HAS_DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dt = tl.where(t_ok, dt, 0.0)  # past the end: no decay, no input
        cs = tl.cumsum(dt * A, axis=0)  # (CHUNK,): log decay from the chunk's start
        pt_ok = p_ok[:, None] & t_ok[None, :]
        xT = tl.load(x_p[:, None] + t[None, :] * sx_t, mask=pt_ok, other=0.0)  # (BLOCK_P, CHUNK)
        nt_ok = t_ok[:, None] & n_ok[None, :]
        Bc = tl.load(b_p[None, :] + t[:, None] * sb_t, mask=nt_ok, other=0.0)  # (CHUNK, BLOCK_N)
        Cc = tl.load(c_p[None, :] + t[:, None] * sc_t, mask=nt_ok, other=0.0)
        # the diagonal block, transposed: [s, l] = (B_s . C_l) exp(cs_l - cs_s) Δ_s for s <= l
        BC = tl.dot(Bc, tl.trans(Cc), input_precision=DOT_PRECISION)  # (CHUNK, CHUNK)
        seg = tl.where(q[:, None] <= q[None, :], cs[None, :] - cs[:, None], float("-inf"))
        M = BC * tl.exp(seg) * dt[:, None]
        yT = tl.dot(xT, M.to(xT.dtype), input_precision=DOT_PRECISION)  # (BLOCK_P, CHUNK)
        # the entering state, read by C_l and decayed to token l
        hC = tl.dot(state.to(Cc.dtype), tl.trans(Cc), input_precision=DOT_PRECISION)
        yT += hC * tl.exp(cs)[None, :]
        yT += xT.to(tl.float32) * D[:, None]
        if HAS_Z:
            z = tl.load(z_p[:, None] + t[None, :] * sz_t, mask=pt_ok, other=0.0).to(tl.float32)
            yT = yT * (z / (1.0 + tl.exp(-z)))
        tl.store(o_p[:, None] + t[None, :] * so_t, yT, mask=pt_ok)
        # the state leaving the chunk: the entering one decayed over it, plus each token's
        # Δ_s x_s B_s decayed to the chunk's end (past the end Δ = 0: cs_end is the last token's)
        cs_end = tl.sum(tl.where(last, cs, 0.0), axis=0)
        xw = xT.to(tl.float32) * (tl.exp(cs_end - cs) * dt)[None, :]  # (BLOCK_P, CHUNK)
        added = tl.dot(xw.to(Bc.dtype), Bc, input_precision=DOT_PRECISION)
        state = state * tl.exp(cs_end) + added  # (BLOCK_P, BLOCK_N)
    if STORE_HT:
        tl.store(hT_ptr + pn, state, mask=pn_ok)


def ssd_triton(
    x, dt, A, B, C, chunk_size, D=None, z=None, initial_state=None, *, dt_bias=None,
    dt_softplus=False, dt_limit=NO_DT_LIMIT, return_final_state=False, kernel_chunk=None,
):  # fmt: skip
    """The SSD scan (module docstring) on the kernel, with the arguments of
    models.mixers.mamba2.ssd_chunked (shapes as mamba_ssm's): x, z (b, l, h, p); dt (b, l, h)
    before its bias, softplus and limit; A (h,); B, C (b, l, g, n); D (h,) or (h, p); dt_bias
    (h,); initial_state (b, h, p, n). Views of one projection are fine (any strides but the last).

    Returns y (b, l, h, p) in x's dtype (and the final state (b, h, p, n) in fp32 with
    `return_final_state`). `chunk_size` is the PyTorch path's; the kernel's is SSD_CHUNK
    (SSD_CHUNK_FP32 in fp32), or `kernel_chunk` (a power of two >= 16) when given."""
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if H % G:
        raise ValueError(f"{H} heads do not split into {G} groups")
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty(Bsz, T, H, P, device=x.device, dtype=x.dtype)
    final = None
    if return_final_state:
        final = torch.empty(Bsz, H, P, N, device=x.device, dtype=torch.float32)
    if Bsz == 0 or T == 0:
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return (out, final) if return_final_state else out
    A = A.float().contiguous()
    D = None if D is None else D.contiguous()
    dt_bias = None if dt_bias is None else dt_bias.contiguous()
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    BLOCK_N = max(16, triton.next_power_of_2(N))  # (tl.dot's smallest side is 16)
    block_p = SSD_BLOCK_P if BLOCK_N <= 128 else SSD_BLOCK_P_WIDE_STATE
    BLOCK_P = min(block_p, max(16, triton.next_power_of_2(P)))
    low, high = (float(v) for v in dt_limit)
    fp32 = torch.float32 in (x.dtype, B.dtype, C.dtype)  # (its dots in IEEE fp32, not TF32)
    chunk = kernel_chunk or (SSD_CHUNK_FP32 if fp32 else SSD_CHUNK)
    dummy = x  # the pointer of an absent tensor (never read: its HAS_* is False)
    grid = (H * triton.cdiv(P, BLOCK_P), Bsz)
    _ssd_kernel[grid](
        x, dt, A, B, C, dummy if D is None else D, dummy if z is None else z,
        dummy if dt_bias is None else dt_bias, dummy if initial_state is None else initial_state,
        out, dummy if final is None else final,
        T, H, P, N, H // G, low, high,
        x.stride(0), x.stride(1), x.stride(2), *dt.stride(), B.stride(0), B.stride(1),
        B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        *(z.stride()[:3] if z is not None else (0, 0, 0)), out.stride(0), out.stride(1),
        out.stride(2),
        HAS_D=D is not None, D_HAS_HDIM=D is not None and D.dim() == 2, HAS_Z=z is not None,
        HAS_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        HAS_DT_LIMIT=(low, high) != NO_DT_LIMIT, HAS_H0=initial_state is not None,
        STORE_HT=final is not None, DOT_PRECISION="ieee" if fp32 else "tf32",
        CHUNK=chunk, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=SSD_WARPS, num_stages=SSD_STAGES,
    )  # fmt: skip
    return (out, final) if return_final_state else out
