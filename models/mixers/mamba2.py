"""Mamba-2: the SSD layer (Dao & Gu, 2024, arXiv:2405.21060) and its scan, in pure PyTorch.

The mixer follows state-spaces/mamba `mamba_ssm/modules/mamba2.py` (`Mamba2`): one `in_proj` to
[z0, x0, z, xBC, dt] (z0, x0: an optional gated MLP on d_inner - d_ssm channels), a depthwise
causal conv + SiLU on xBC = [x, B, C], the multi-head scalar-A state space on x (heads of `headdim`
channels, B and C shared by the heads of each of `ngroups` groups), the D skip, a gated RMSNorm
(per group, `norm_before_gate` as upstream) and `out_proj`. transformers' `Mamba2Mixer` has the
same parameter names (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm.weight`, `out_proj`).

The scan of head h, channel p and state n, with Δ_t = clamp(softplus(dt_t + dt_bias)) and the
scalar A_h = -exp(A_log_h):

    h_t = exp(Δ_t A_h) h_{t-1} + Δ_t x_t B_t,        y_t = C_t . h_t + D x_t

`ssd_sequential` is that recurrence, one token at a time. `ssd_chunked` computes the same thing
by the block decomposition of the paper's Listing 1 (mamba_ssm `modules/ssd_minimal.py`): cut the
sequence into chunks of Q tokens; inside a chunk the output is a masked Q x Q "attention"
(C_l . B_s) exp(sum_{s<r<=l} Δ_r A) Δ_s x_s (the diagonal block); each chunk's last state is
(sum_s exp(sum_{s<r<=end} Δ_r A) Δ_s x_s B_s) plus the entering state decayed over the chunk; the
entering state reaches every token of the chunk as exp(sum_{r<=l} Δ_r A) C_l . h (the off-diagonal
blocks). Every step is a batched matmul; only the chunk-to-chunk state passing is a loop (T / Q
steps). The decays are exponentials of differences of one cumulative sum of Δ A, taken in fp64:
two fp32 partial sums in the thousands would lose the small differences near the diagonal that
matter most, and an fp64 cumsum keeps them to fp32 precision for any length.

Shapes are mamba_ssm's (`mamba_chunk_scan_combined`): x (b, l, h, p), dt (b, l, h), A (h,),
B and C (b, l, g, n), D (h,) or (h, p), z (b, l, h, p), initial_state (b, h, p, n).

The mixer's convolution and chunked scan go through models/kernels' dispatch (ops
"causal_conv1d" and "ssd"): `ssd_chunked` is the scan's PyTorch path, and on CUDA a fused kernel
(models/kernels/ssd.py, or mamba_ssm's) takes its place with the same arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import run_op
from models.mixers.base import Mixer

NO_DT_LIMIT = (0.0, math.inf)  # mamba_ssm's default: Δ unclamped
# tokens per chunk that the checkpoint loaders choose: any chunk size gives the same result up to
# fp32 rounding, and on a CPU the Q x Q diagonal blocks outgrow the state work above Q ~ 64
# (d_state 128, headdim 64, T 2048: chunks of 32-64 run the scan 4-5x faster than mamba_ssm's 256)
LOADED_CHUNK_SIZE = 64


def discretized_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=NO_DT_LIMIT):
    """Δ as mamba_ssm's kernels compute it: dt (+ dt_bias), softplus (the identity above 20, as
    its Triton softplus and F.softplus both do), clamped to dt_limit; in fp32 (fp64 stays fp64)."""
    dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _skip_and_gate(y, x, D, z):
    """y + D x, then gated by silu(z) (mamba_chunk_scan_combined's `D` and `z`)."""
    if D is not None:
        D = D.to(y.dtype)
        y = y + x.to(y.dtype) * (D[:, None] if D.dim() == 1 else D)  # (h, 1) or (h, p)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def ssd_sequential(
    x, dt, A, B, C, D=None, z=None, initial_state=None, *, dt_bias=None, dt_softplus=False,
    dt_limit=NO_DT_LIMIT, return_final_state=False,
):  # fmt: skip
    """The reference recurrence, one token at a time (module docstring; shapes as mamba_ssm's).

    Computes in fp32, or fp64 when x is fp64; returns y (b, l, h, p) in that dtype (and the
    final state (b, h, p, n) with `return_final_state`)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    dtype = torch.promote_types(x.dtype, torch.float32)
    dt = discretized_dt(dt, dt_bias, dt_softplus, dt_limit).to(dtype)  # (b, T, H)
    x, A = x.to(dtype), A.to(dtype)
    B = B.to(dtype).repeat_interleave(H // G, dim=2)  # (b, T, H, N): each head its group's
    C = C.to(dtype).repeat_interleave(H // G, dim=2)
    h = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.to(dtype).clone()
    y = x.new_empty(b, T, H, P)
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # (b, H, 1, 1)
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        y[:, t] = (h * C[:, t, :, None, :]).sum(-1)
    y = _skip_and_gate(y, x, D, z)
    return (y, h) if return_final_state else y


def ssd_chunked(
    x, dt, A, B, C, chunk_size, D=None, z=None, initial_state=None, *, dt_bias=None,
    dt_softplus=False, dt_limit=NO_DT_LIMIT, return_final_state=False,
):  # fmt: skip
    """The SSD scan by chunks of `chunk_size` tokens (module docstring), equal to
    `ssd_sequential` up to fp32 rounding for any length (a last chunk may be short).

    Arguments and result as `ssd_sequential`; computes in fp32 (fp64 when x is fp64)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G  # heads per group
    dtype = torch.promote_types(x.dtype, torch.float32)
    dt = discretized_dt(dt, dt_bias, dt_softplus, dt_limit).to(dtype)  # (b, T, H)
    xdt = (x.to(dtype) * dt[..., None]).transpose(1, 2)  # (b, H, T, P): Δ_s x_s
    # ... B and C per group: (b, G, T, N)
    Bg, Cg = B.to(dtype).transpose(1, 2), C.to(dtype).transpose(1, 2)
    # cumulative Δ A per head in fp64 (see the module docstring): (b, H, T)
    cum = (dt.double() * A.double()).transpose(1, 2).cumsum(-1)
    state = x.new_zeros(b, H, P, N, dtype=dtype) if initial_state is None else initial_state
    state = state.to(dtype)
    y = x.new_empty(b, H, T, P, dtype=dtype)
    Q = max(1, int(chunk_size))
    for t0 in range(0, T, Q):
        t1 = min(T, t0 + Q)
        q = t1 - t0
        # the chunk's cumulative decays, from its start: (b, H, q), relative to the token before it
        start = cum[..., t0 - 1 : t0] if t0 else torch.zeros_like(cum[..., :1])
        cs = cum[..., t0:t1] - start  # (b, H, q) fp64
        # diagonal block: (C_l . B_s) exp(cs_l - cs_s) for s <= l, times Δ_s x_s
        seg = cs[..., :, None] - cs[..., None, :]  # (b, H, q, q)
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        L = torch.exp(seg.masked_fill(~causal, -math.inf).to(dtype))  # (b, H, q, q)
        CB = Cg[:, :, t0:t1] @ Bg[:, :, t0:t1].transpose(-1, -2)  # (b, G, q, q)
        M = (L.view(b, G, R, q, q) * CB[:, :, None]).view(b, H, q, q)
        yc = M @ xdt[:, :, t0:t1]  # (b, H, q, P)
        # the entering state reaches token l decayed by exp(cs_l), read by C_l of its group
        Cs = Cg[:, :, None, t0:t1] @ state.reshape(b, G, R, P, N).transpose(-1, -2)  # (b,G,R,q,P)
        yc = yc + Cs.reshape(b, H, q, P) * torch.exp(cs.to(dtype))[..., None]
        y[:, :, t0:t1] = yc
        # the state leaving the chunk: the entering one decayed over the whole chunk, plus
        # sum_s exp(cs_end - cs_s) Δ_s x_s B_s^T
        to_end = torch.exp((cs[..., -1:] - cs).to(dtype))  # (b, H, q)
        xs = (xdt[:, :, t0:t1] * to_end[..., None]).transpose(-1, -2)  # (b, H, P, q)
        added = xs.view(b, G, R, P, q) @ Bg[:, :, None, t0:t1]  # (b, G, R, P, N)
        decay = torch.exp(cs[..., -1].to(dtype))[..., None, None]  # (b, H, 1, 1)
        state = decay * state + added.reshape(b, H, P, N)
    y = _skip_and_gate(y.transpose(1, 2), x, D, z)  # (b, T, H, P)
    return (y, state) if return_final_state else y


@dataclass
class Mamba2Options:
    d_state: int = 128  # N per group (mamba_ssm's Mamba2 default, every state-spaces/mamba2-*)
    d_conv: int = 4  # width of the depthwise causal convolution on xBC
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # P, channels per head
    d_ssm: int | None = None  # channels of the SSM; None: all d_inner (the rest: a gated MLP)
    ngroups: int = 1  # groups of heads sharing B and C (like grouped-query attention)
    D_has_hdim: bool = False  # D per channel (d_ssm,) instead of per head
    rmsnorm: bool = True  # the gated RMSNorm before out_proj; False gates y by silu(z) instead
    norm_before_gate: bool = False  # True: norm(y) * silu(z); False: norm(y * silu(z))
    norm_eps: float = 1e-5  # mamba_ssm fixes 1e-5; transformers uses its layer_norm_epsilon
    dt_limit: tuple[float, float] = NO_DT_LIMIT  # Δ clamped to this range
    bias: bool = False  # in_proj / out_proj biases
    conv_bias: bool = True
    chunk_size: int = 256  # tokens per chunk of the scan (mamba_ssm's default)
    mode: str = "chunked"  # or "sequential": the reference recurrence

    def __post_init__(self):
        self.dt_limit = tuple(float(v) for v in self.dt_limit)
        if self.mode not in ("chunked", "sequential"):
            raise ValueError(f"mode must be 'chunked' or 'sequential', not {self.mode!r}")


class GatedRMSNorm(nn.Module):
    """mamba_ssm's `RMSNormGated` (`ops/triton/layernorm_gated.py`, `rms_norm_ref`): an RMSNorm
    over each group of `group_size` channels, gated by silu(z) before or after it, in fp32."""

    def __init__(self, d: int, group_size: int, eps: float, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x, z = x.float(), z.float()
        if not self.norm_before_gate:
            x = x * F.silu(z)
        groups = x.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        x = F.rms_norm(groups, groups.shape[-1:], eps=self.eps).flatten(-2) * self.weight.float()
        if self.norm_before_gate:
            x = x * F.silu(z)
        return x.to(dtype)


class Mamba2Mixer(Mixer):
    """The Mamba-2 (SSD) mixer of mamba_ssm's `Mamba2`, its non-fused path (module docstring)."""

    Options = Mamba2Options
    mixer_name = "mamba2"

    def build(self, opts: Mamba2Options) -> None:
        self.d_inner = opts.expand * self.d_model
        self.d_ssm = self.d_inner if opts.d_ssm is None else opts.d_ssm
        if self.d_ssm % opts.headdim or self.d_ssm > self.d_inner:
            raise ValueError(
                f"d_ssm {self.d_ssm} must be a multiple of headdim {opts.headdim} and at most "
                f"d_inner {self.d_inner}"
            )
        self.nheads = self.d_ssm // opts.headdim
        if self.nheads % opts.ngroups or self.d_ssm % opts.ngroups:
            raise ValueError(f"{self.nheads} heads do not split into ngroups {opts.ngroups}")
        self.d_mlp = self.d_inner - self.d_ssm
        self.headdim, self.ngroups, self.d_state = opts.headdim, opts.ngroups, opts.d_state
        self.chunk_size, self.mode, self.dt_limit = opts.chunk_size, opts.mode, opts.dt_limit
        conv_dim = self.d_ssm + 2 * opts.ngroups * opts.d_state
        # order [z0, x0, z, xBC, dt], as mamba_ssm's in_proj
        d_in_proj = 2 * self.d_inner + 2 * opts.ngroups * opts.d_state + self.nheads
        self.in_proj = nn.Linear(self.d_model, d_in_proj, bias=opts.bias)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, opts.d_conv, groups=conv_dim, padding=opts.d_conv - 1,
            bias=opts.conv_bias,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads))
        # A = -(1..nheads), one of upstream's A_init_range draws; checkpoints overwrite it
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.nheads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.d_ssm if opts.D_has_hdim else self.nheads))
        self.norm = None
        if opts.rmsnorm:
            self.norm = GatedRMSNorm(
                self.d_ssm, self.d_ssm // opts.ngroups, opts.norm_eps, opts.norm_before_gate
            )
        self.out_proj = nn.Linear(self.d_inner, self.d_model, bias=opts.bias)

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        b, T, _ = u.shape
        G, N, P = self.ngroups, self.d_state, self.headdim
        zxbcdt = self.in_proj(u)  # (b, T, d_in_proj)
        z0, x0, z, xBC, dt = zxbcdt.split(
            [self.d_mlp, self.d_mlp, self.d_ssm, self.d_ssm + 2 * G * N, self.nheads], dim=-1
        )
        # silu(causal depthwise convolution), Mamba-1's fused op (models/kernels)
        xBC = run_op("causal_conv1d", xBC, self.conv1d.weight, self.conv1d.bias)  # (b, T, conv_dim)
        x, B, C = xBC.split([self.d_ssm, G * N, G * N], dim=-1)
        A = -torch.exp(self.A_log.float())  # (H,)
        D = self.D.view(self.nheads, P) if self.D.numel() == self.d_ssm else self.D
        heads = (self.nheads, P)
        x, B, C = x.unflatten(-1, heads), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
        gate = None if self.norm is not None else z.unflatten(-1, heads)  # (else gated in the norm)
        discretization = dict(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
        if self.mode == "sequential":
            y = ssd_sequential(x, dt, A, B, C, D, gate, **discretization)
        else:  # the chunked scan, or a fused kernel of it (models/kernels' "ssd")
            y = run_op("ssd", x, dt, A, B, C, self.chunk_size, D, gate, **discretization)
        y = y.flatten(-2)  # (b, T, d_ssm): fp32 from PyTorch, x's dtype from a kernel
        y = self.norm(y, z) if self.norm is not None else y
        y = y.to(u.dtype)
        if self.d_mlp:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)  # (b, T, d_inner)
        return self.out_proj(y)
