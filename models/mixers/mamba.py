"""Mamba-1 selective state-space mixer and LM (Gu & Dao, 2023, arXiv:2312.00752), in pure PyTorch.

Parameter names follow state-spaces/mamba `mamba_ssm/modules/mamba_simple.py` (`in_proj`,
`conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`), which transformers' `MambaMixer` shares;
the LM follows `mamba_ssm/models/mixer_seq_simple.py` (`backbone.embedding`,
`backbone.layers.{i}.norm` / `.mixer`, `backbone.norm_f`, `lm_head`). `models/checkpoints/mamba_ssm.py`
maps both published layouts onto these modules.

The selective scan of channel d and state n, with Δ_t = softplus(dt_t) and A = -exp(A_log):

    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t,        y_t = sum_n C_t h_t + D u_t

mamba_ssm runs it in a CUDA kernel; without one, transformers (and mamba_ssm's
`selective_scan_ref`) materialise exp(Δ A) and Δ B u for every (token, channel, state) and step
through them one token at a time: ~8 passes over a (B, D, T, N) tensor in main memory plus T
small ops. `selective_scan_chunked` runs the same recurrence in chunks of C tokens over a block
of sequences that stays in cache: per chunk, the decays (one exp2 pass) and inputs are computed
for all C tokens at once, the state steps through the chunk in place (one fused multiply-add per
token), is contracted with C_t for the whole chunk in one batched matmul (the D skip and the
SiLU gate applied while the chunk is in cache), and the chunk's last state is carried into the
next. The decays multiply the state as in the recurrence and never divide it: every factor is at
most 1, so no decay, however fast, can overflow, and no channel needs an accuracy check or a
fallback; the result is the recurrence's up to fp32 rounding (exp2 of Δ A log2(e) for exp of
Δ A). Factorising a chunk's decays into prefix sums, as models/mixers/rwkv.py does for the WKV, would
add a division and per-channel range checks to the same exp pass, and measured slower on a CPU.
`selective_scan_sequential` is the plain recurrence (one step per token) the tests hold it to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import run_op
from models.mixers.base import Mixer

_LOG2E = 1.4426950408889634
# elements of one (C, sequences, N, D) block of decays on a CPU: a few MB, so a chunk's passes
# stay in cache (a 768-wide Mamba, N = 16, C = 16: one sequence per block)
_CPU_BLOCK_ELEMENTS = 1 << 19
# on a GPU bigger blocks are better: fewer, larger kernels (256 MB per fp32 buffer)
_GPU_BLOCK_ELEMENTS = 1 << 26


def selective_scan_sequential(u, delta, A, B, C, D=None, z=None):
    """Reference recurrence, one step per token: h = exp(Δ A) h + Δ B u, y = C . h + D u, gated
    by silu(z).

    u, delta, z (B, T, E) with delta already softplus'ed; A (E, N); B, C (B, T, N); D (E,).
    Computes in fp32 (fp64 if u is fp64) and returns (B, T, E) in that dtype.
    """
    Bsz, T, E = u.shape
    dt = torch.promote_types(u.dtype, torch.float32)
    u, delta, A, B, C = (t.to(dt) for t in (u, delta, A, B, C))
    h = torch.zeros(Bsz, E, A.shape[1], dtype=dt, device=u.device)  # (B, E, N)
    out = torch.empty(Bsz, T, E, dtype=dt, device=u.device)
    for t in range(T):
        decay = torch.exp(delta[:, t, :, None] * A)  # (B, E, N)
        h = decay * h + (delta[:, t] * u[:, t])[..., None] * B[:, t, None, :]
        out[:, t] = (h * C[:, t, None, :]).sum(-1)
    if D is not None:
        out = out + u * D.to(dt)
    if z is not None:
        out = out * F.silu(z.to(dt))
    return out


def selective_scan_chunked(
    u, delta, A, B, C, D=None, z=None, chunk_size: int = 16, block_elements=None
):
    """The selective scan for all T tokens, in chunks of `chunk_size` (see the module docstring).

    Arguments as `selective_scan_sequential`, any float dtype; returns (B, T, E) float32.
    Sequences are processed in blocks of at most `block_elements` (C, sequences, N, E) decays
    (default: a few MB on a CPU, 256 MB on a GPU). With autograd it runs
    `selective_scan_sequential`, whose every operation is differentiable.
    """
    args = (u, delta, A, B, C, D, z)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return selective_scan_sequential(*args).float()
    with torch.no_grad():
        return _scan_in_chunks(*args, chunk_size, block_elements)


def _scan_in_chunks(u, delta, A, B, C, D, z, chunk_size, block_elements):
    Bsz, T, E = u.shape
    N = A.shape[1]
    dev = u.device
    out = torch.empty(Bsz, T, E, device=dev)
    if T == 0 or Bsz == 0:
        return out
    Cn = max(1, min(chunk_size, T))
    if block_elements is None:
        block_elements = _CPU_BLOCK_ELEMENTS if dev.type == "cpu" else _GPU_BLOCK_ELEMENTS
    G = max(1, min(Bsz, block_elements // (Cn * N * E)))  # sequences per block
    a2 = (A.float().t() * _LOG2E).contiguous()  # (N, E): log2 of the decay per unit of Δ
    # (B, T, .) row-major, whatever the callers' strides: every slice below is then a block
    u = u.float().contiguous()
    delta = delta.float().contiguous()
    x = delta * u  # (B, T, E): Δ u
    B, C = B.float().contiguous(), C.float().contiguous()
    D = None if D is None else D.float()
    if z is not None and z.stride(-1) != 1:  # the gate is read a chunk of rows at a time
        z = z.contiguous()
    for b0 in range(0, Bsz, G):
        g = min(G, Bsz - b0)
        if b0 == 0 or g != G:  # the chunk's decays, and two state buffers used in turn, so
            # that a chunk's last state is still there for the next chunk
            decays = torch.empty(Cn, g, N, E, device=dev)
            states = [torch.empty(Cn, g, N, E, device=dev) for _ in range(2)]
        h = torch.zeros(g, N, E, device=dev)  # (g, N, E): the state entering the chunk
        for k, t0 in enumerate(range(0, T, Cn)):
            c = min(Cn, T - t0)
            sl = (slice(b0, b0 + g), slice(t0, t0 + c))
            P, H = decays[:c], states[k % 2][:c]  # (c, g, N, E)
            # decays 2^{Δ A log2 e} of every token of the chunk: (c, g, 1, E) x (N, E)
            torch.mul(delta[sl].transpose(0, 1)[:, :, None, :], a2, out=P)
            P.exp2_()
            # inputs Δ_t u_t B_t: (c, g, 1, E) x (c, g, N, 1)
            torch.mul(x[sl].transpose(0, 1)[:, :, None, :], B[sl].transpose(0, 1)[..., None], out=H)
            for j in range(c):  # h <- decay h + input, in place over the inputs
                H[j].addcmul_(P[j], h)
                h = H[j]
            # y_t = C_t . h_t for the whole chunk: (c g, 1, N) @ (c g, N, E), then D u and the gate
            Ct = C[sl].transpose(0, 1).reshape(c * g, 1, N)  # (c g, 1, N)
            y = torch.bmm(Ct, H.view(c * g, N, E)).view(c, g, E).transpose(0, 1)  # (g, c, E)
            o = out[sl]
            if D is None:
                o.copy_(y)
            else:
                torch.addcmul(y, u[sl], D, out=o)
            if z is not None:
                o.mul_(F.silu(z[sl].float()))
    return out


def causal_conv1d_silu(x, weight, bias=None):
    """silu(depthwise causal conv1d(x)), the PyTorch path of models/kernels' "causal_conv1d":
    x (B, T, E), weight (E, 1, W), bias (E,). One conv1d padded on both sides with the tail
    dropped. Returns (B, T, E) contiguous."""
    T, W = x.shape[1], weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight, bias, padding=W - 1, groups=x.shape[-1])[..., :T]
    return F.silu(y).transpose(1, 2).contiguous()  # (B, T, E)


def selective_scan_gated(u, dt, A, B, C, D=None, z=None, dt_bias=None, chunk_size: int = 16):
    """The selective scan with Δ = softplus(dt + dt_bias) made here, the PyTorch path of
    models/kernels' "selective_scan" (`selective_scan_chunked`). dt (B, T, E) before its bias and
    softplus, the rest as `selective_scan_sequential`. Returns (B, T, E) in u's dtype."""
    delta = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    y = selective_scan_chunked(u, F.softplus(delta), A, B, C, D, z, chunk_size)
    return y.to(u.dtype)


@dataclass
class MambaMixerOptions:
    d_state: int = 16  # N, the state size per channel (every published Mamba-1)
    d_conv: int = 4  # width of the short causal convolution
    expand: int = 2  # inner width E = expand * d_model
    dt_rank: int | None = None  # None: ceil(d_model / 16), mamba_ssm's "auto"
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj biases
    chunk_size: int = 16  # tokens per chunk of the scan: 16 keeps a block in cache
    mode: str = "chunked"  # or "sequential": the reference recurrence


class MambaMixer(Mixer):
    """Mamba-1 mixer: in_proj -> causal depthwise conv + SiLU -> selective scan, gated by
    SiLU(z) -> out_proj (mamba_ssm `Mamba`, transformers `MambaMixer`)."""

    Options = MambaMixerOptions
    mixer_name = "mamba"

    def build(self, opts: MambaMixerOptions) -> None:
        d_model, d_state = self.d_model, opts.d_state
        self.d_state = d_state
        self.d_inner = int(opts.expand * d_model)
        self.dt_rank = opts.dt_rank or math.ceil(d_model / 16)
        self.chunk_size = opts.chunk_size
        self.mode = opts.mode
        E = self.d_inner
        self.in_proj = nn.Linear(d_model, 2 * E, bias=opts.bias)
        self.conv1d = nn.Conv1d(
            E, E, opts.d_conv, groups=E, padding=opts.d_conv - 1, bias=opts.conv_bias
        )
        self.x_proj = nn.Linear(E, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, E, bias=True)
        # S4D-real initialisation, as mamba_ssm: A = -(1..N) for every channel
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(E, 1)  # (E, N)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, d_model, bias=opts.bias)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        xz = self.in_proj(x)  # (B, T, 2E)
        xs, z = xz.chunk(2, dim=-1)  # (B, T, E) views
        conv = self.conv1d
        u = run_op("causal_conv1d", xs, conv.weight, conv.bias)  # (B, T, E): silu(conv(xs))
        dt, Bm, Cm = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        A = -torch.exp(self.A_log.float())  # (E, N)
        if self.mode == "sequential":
            delta = F.softplus(self.dt_proj(dt).float())  # (B, T, E)
            y = selective_scan_sequential(u, delta, A, Bm, Cm, self.D, z)
        else:  # dt_proj's bias and the softplus go into the scan, as in mamba_ssm's kernel
            dt = F.linear(dt, self.dt_proj.weight)  # (B, T, E)
            y = run_op(
                "selective_scan", u, dt, A, Bm, Cm, self.D, z, self.dt_proj.bias, self.chunk_size
            )
        return self.out_proj(y.to(xz.dtype))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the norm computed in fp32 (mamba_ssm `RMSNorm`, transformers
    `MambaRMSNorm`)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
        return self.weight * y


@dataclass
class MambaLMConfig:
    d_model: int = 768
    n_layer: int = 24
    vocab_size: int = 50280  # rows of the embedding, already padded (mamba_ssm pads to 8)
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | None = None  # None: ceil(d_model / 16)
    conv_bias: bool = True
    bias: bool = False
    rms_norm: bool = True  # False: LayerNorm with a bias, mamba_ssm's other option
    norm_epsilon: float = 1e-5  # mamba_ssm's MixerModel default, fixed for its checkpoints
    residual_in_fp32: bool = True  # the residual stream in fp32 when the weights are not
    tie_embeddings: bool = True
    chunk_size: int = 16


class MambaBlock(nn.Module):
    """Pre-norm residual block `x + mixer(norm(x))`: mamba_ssm's `Block` without an MLP."""

    def __init__(self, cfg: MambaLMConfig, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = cfg.residual_in_fp32
        if cfg.rms_norm:
            self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_epsilon)
        else:
            self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_epsilon)
        self.mixer = MambaMixer(
            cfg.d_model, layer_idx=layer_idx, d_state=cfg.d_state, d_conv=cfg.d_conv,
            expand=cfg.expand, dt_rank=cfg.dt_rank, conv_bias=cfg.conv_bias, bias=cfg.bias,
            chunk_size=cfg.chunk_size,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)))


class MambaBackbone(nn.Module):
    def __init__(self, cfg: MambaLMConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MambaBlock(cfg, i) for i in range(cfg.n_layer))
        if cfg.rms_norm:
            self.norm_f = RMSNorm(cfg.d_model, eps=cfg.norm_epsilon)
        else:
            self.norm_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)  # (B, T, D)
        for layer in self.layers:
            x = layer(x)
        return self.norm_f(x.to(self.norm_f.weight.dtype))


class MambaLM(nn.Module):
    """Mamba-1 language model (mamba_ssm `MambaLMHeadModel`): embedding, blocks, final norm, head."""

    def __init__(self, cfg: MambaLMConfig):
        super().__init__()
        self.config = cfg
        self.backbone = MambaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def set_mode(self, mode: str) -> None:
        """Every layer's scan: "chunked" (the fast one) or "sequential" (the reference)."""
        for layer in self.backbone.layers:
            layer.mixer.mode = mode

    def hidden_and_head(self, input_ids: torch.Tensor):
        return self.backbone(input_ids), self.lm_head.weight, None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone(input_ids))  # (B, T, V) logits
