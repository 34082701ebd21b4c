"""H3, "Hungry Hungry Hippos" (Fu, Dao et al., ICLR 2023, arXiv:2212.14052), as HazyResearch/H3
`src/models/ssm/h3.py` and Zoology's `zoology/mixers/h3/h3.py` define it, with their key names.

    q, k, v = q_proj(u), k_proj(u), v_proj(u)                      # (B, D, L) each
    k  = shift_ssm * k + ssm_k_D ⊙ k                              # a learned shift (taps 0..N-1)
    kv = k_h ⊗ v_h per head                                        # (B, hd, hd, H, L)
    y  = diag_ssm * kv + D ⊙ kv                                    # S4D, one kernel per head
    out = output_linear(Σ_d1 q_h[d1] · y[d1])                      # channels ordered (d2, h)

The diagonal SSM is S4D (`SSKernelDiag`): `A = -exp(inv_A_real) + i A_imag`, `dt = exp(log_dt)`,
`N/2` complex conjugate pairs, its kernel `K[l] = 2 Re Σ_n C'_n dA_n^l` computed as upstream's
pure-PyTorch Vandermonde fallback computes it (`exp(l · log dA)`), discretised bilinearly (the
upstream default; `zoh` too). The shift SSM (`SSKernelShift`) is the cross-correlation of its `B`
and `C`, `N` taps long. Both convolutions run by FFT in fp32 (`fft_causal_conv`); no pykeops, no
CUDA extension. The SSM parameters upstream registers through `OptimModule.register` (`log_dt`,
`B`, `inv_A_real`, `A_imag`, the shift's `B`) carry no weight decay; the `C`s do, as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.mixers.base import Mixer
from models.mixers.hyena import fft_causal_conv

MEASURES = ("diag-lin", "diag-inv")  # S4D-Lin, S4D-Inv: how A's imaginary parts start
DISCRETISATIONS = ("bilinear", "zoh")


def no_weight_decay(*params: nn.Parameter) -> None:
    """Mark SSM parameters as upstream's `OptimModule.register` does: trained without weight
    decay (the trainer's optimizer reads the mark)."""
    for p in params:
        p._no_weight_decay = True


class ShiftSSM(nn.Module):
    """`SSKernelShift`: a discrete SSM whose state is a shift register, so its kernel is the
    cross-correlation `k[j] = Σ_n B[n] C[n + j]` of two learned (d_model, N) rows, N taps long."""

    def __init__(self, d_model: int, d_state: int):
        super().__init__()
        B = torch.zeros(d_model, d_state)
        B[:, 0] = 1.0  # e_1: the kernel starts as C itself
        C = torch.empty(d_model, 1, d_state)
        nn.init.kaiming_uniform_(C, a=math.sqrt(5))  # as torch's Conv1d initialises its taps
        self.B = nn.Parameter(B)  # (H, N)
        self.C = nn.Parameter(C.transpose(0, 1).contiguous())  # (1, H, N), decayed as upstream
        no_weight_decay(self.B)

    def forward(self, L: int) -> torch.Tensor:
        """The first L taps, (H, L), fp32 (zeros past N)."""
        N = self.B.shape[-1]
        B_f = torch.fft.rfft(self.B.float(), n=2 * N)  # (H, N+1)
        C_f = torch.fft.rfft(self.C.float(), n=2 * N)  # (1, H, N+1)
        k = torch.fft.irfft(B_f.conj() * C_f, n=2 * N)[..., : min(N, L)]  # (1, H, min(N, L))
        return F.pad(k, (0, L - k.shape[-1]))[0]  # (H, L)


class DiagonalSSM(nn.Module):
    """`SSKernelDiag` (S4D) with `real_type='exp'`: the (H, L) kernel of H independent diagonal
    SSMs of N/2 complex modes each."""

    def __init__(self, H: int, d_state: int, opts: H3Options):
        super().__init__()
        n = d_state // 2
        log_dt = torch.rand(H) * (math.log(opts.dt_max) - math.log(opts.dt_min))
        pi = torch.tensor(math.pi)
        if opts.measure == "diag-lin":
            imag = pi * torch.arange(n).float().repeat(H, 1)
        else:  # diag-inv, from the asymptotics of the HiPPO-LegS matrix
            imag = 1 / pi * d_state * (d_state / (1 + 2 * torch.arange(n).float().repeat(H, 1)) - 1)
        B = torch.ones(H, n, dtype=torch.cfloat)
        C = torch.randn(1, H, n, dtype=torch.cfloat) * B
        self.disc = opts.disc
        # (1, H, n, 2); a plain parameter upstream (weight decay applies), the others registered
        self.C = nn.Parameter(torch.view_as_real(C.conj().resolve_conj()))
        self.log_dt = nn.Parameter(log_dt + math.log(opts.dt_min))  # (H,)
        self.B = nn.Parameter(torch.view_as_real(B))  # (H, n, 2)
        self.inv_A_real = nn.Parameter(torch.full((H, n), math.log(0.5)))  # A's real part -1/2
        self.A_imag = nn.Parameter(imag)  # (H, n)
        no_weight_decay(self.log_dt, self.B, self.inv_A_real, self.A_imag)

    def forward(self, L: int) -> torch.Tensor:
        """The first L taps, (H, L), fp32: upstream's `log_vandermonde_naive`."""
        dt = torch.exp(self.log_dt.float())  # (H,)
        C = torch.view_as_complex(self.C.float())  # (1, H, n)
        A = -torch.exp(self.inv_A_real.float()) + 1j * self.A_imag.float()  # (H, n)
        B = torch.view_as_complex(self.B.float())  # (H, n)
        dtA = A * dt[:, None]  # (H, n)
        C = B[None] * C  # (1, H, n)
        if self.disc == "bilinear":
            C = C * (1.0 - dtA / 2).reciprocal() * dt[:, None]
            log_dA = ((1.0 + dtA / 2) / (1.0 - dtA / 2)).log()  # (H, n)
        else:  # zoh
            C = C * (torch.exp(dtA) - 1.0) / A
            log_dA = dtA
        powers = torch.exp(log_dA[..., None] * torch.arange(L, device=A.device).to(log_dA))
        return 2 * torch.einsum("chn,hnl->chl", C, powers).real[0]  # (H, L)


class SSKernel(nn.Module):
    """Upstream's wrapper around a kernel: it keeps the `.kernel.` level of the state-dict keys
    (`kernel.kernel.log_dt`, `ssm_k_kernel.kernel.B`)."""

    def __init__(self, kernel: nn.Module):
        super().__init__()
        self.kernel = kernel

    def forward(self, L: int) -> torch.Tensor:
        return self.kernel(L)


@dataclass
class H3Options:
    d_state: int = 64  # N: the shift SSM's taps and twice the diagonal SSM's complex modes
    head_dim: int = 1  # 1 as in the published H3 LMs; > 1 is the multi-head form (H = d / hd)
    measure: str = "diag-lin"  # the initialisation of A (S4D-Lin, upstream's LMs), or diag-inv
    disc: str = "bilinear"  # discretisation of the diagonal SSM: upstream's default, or zoh
    dt_min: float = 0.001  # log_dt starts uniform in [log dt_min, log dt_max]
    dt_max: float = 0.1
    dropout: float = 0.0  # accepted as upstream accepts it: its H3 never applies it
    # True: at most l_max taps of either SSM kernel, as Zoology's H3 (given its l_max) computes
    # them; False: kernels as long as the input, as HazyResearch/H3's LMs build them (l_max None)
    truncate_kernel: bool = False

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"measure {self.measure!r}: choose one of {', '.join(MEASURES)}")
        if self.disc not in DISCRETISATIONS:
            raise ValueError(f"disc {self.disc!r}: choose one of {', '.join(DISCRETISATIONS)}")
        if self.d_state < 2 or self.d_state % 2:
            raise ValueError(f"d_state must be even and >= 2 (conjugate pairs), not {self.d_state}")


class H3(Mixer):
    """The H3 layer: shift-SSM-filtered keys times values, a diagonal SSM over their products,
    read out by the queries."""

    Options = H3Options
    mixer_name = "h3"

    def build(self, opts: H3Options) -> None:
        d_model = self.d_model
        if d_model % opts.head_dim:
            raise ValueError(f"d_model {d_model} is not divisible by head_dim {opts.head_dim}")
        self.head_dim = opts.head_dim
        self.H = d_model // opts.head_dim
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.ssm_k_kernel = SSKernel(ShiftSSM(d_model, opts.d_state))
        self.ssm_k_D = nn.Parameter(torch.randn(d_model))
        self.kernel = SSKernel(DiagonalSSM(self.H, opts.d_state, opts))
        self.D = nn.Parameter(torch.randn(self.H))
        self.output_linear = nn.Linear(d_model, d_model)
        self.truncate_kernel = opts.truncate_kernel

    def kernels(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift kernel (D, L), diagonal kernel (H, L)), zero past l_max when truncated."""
        taps = min(L, self.l_max) if self.truncate_kernel else L
        return tuple(F.pad(k(taps), (0, L - taps)) for k in (self.ssm_k_kernel, self.kernel))

    def forward(self, u: torch.Tensor, **kwargs) -> torch.Tensor:
        B, L, _ = u.shape
        hd, H = self.head_dim, self.H
        q, k, v = (proj(u).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        shift_kernel, ssm_kernel = self.kernels(L)
        k = fft_causal_conv(k, shift_kernel, self.ssm_k_D).float()  # (B, D, L)
        # kv[b, d1, d2, h] = k[b, h·hd + d1] · v[b, h·hd + d2]
        kv = k.view(B, H, hd, 1, L).permute(0, 2, 3, 1, 4) * v.float().view(B, H, 1, hd, L).permute(
            0, 2, 3, 1, 4
        )  # (B, hd, hd, H, L)
        y = fft_causal_conv(kv, ssm_kernel, self.D)  # (B, hd, hd, H, L)
        q = q.float().view(B, H, hd, 1, L).permute(0, 2, 3, 1, 4)  # (B, hd, 1, H, L)
        y = (y * q).sum(dim=1)  # (B, hd, H, L): summed over d1
        y = y.reshape(B, hd * H, L).transpose(1, 2)  # (B, L, D), channels ordered (d2, h)
        return self.output_linear(y.to(self.output_linear.weight.dtype))
