"""Adapters to the field's CUDA kernels, with the signatures of models/kernels' dispatch:
mamba_ssm's `selective_scan_fn` and causal-conv1d's `causal_conv1d_fn` (as transformers' Mamba
CUDA path calls them), mamba_ssm's `mamba_chunk_scan_combined` (Mamba-2's SSD scan, as its
`Mamba2` calls it) and flash-linear-attention's RWKV-4 `fused_recurrent_rwkv4`.

Each package is imported inside its adapter (they compile CUDA at install, so none is a
dependency; the dispatch offers them only when they import). The field's kernels read
channel-major (B, E, T) tensors where this project's mixers keep token-major (B, T, E), so the
adapters transpose in and out; mamba_ssm's kernel takes dt before its bias and softplus, as the
dispatch's selective scan does.
"""

from __future__ import annotations

import torch

from models.mixers.mamba2 import NO_DT_LIMIT

# mamba_ssm's Mamba2 default, which its Triton kernels' autotuned block sizes were chosen for (a
# chunk changes nothing but rounding, models/mixers/mamba2.py)
FIELD_SSD_CHUNK = 256


def causal_conv1d_silu(x, weight, bias=None):
    """silu(depthwise causal conv1d(x)) by causal-conv1d: x (B, T, E); weight (E, 1, W); bias
    (E,). Returns (B, T, E) in x's dtype (a transposed view of the kernel's (B, E, T) output)."""
    from causal_conv1d import causal_conv1d_fn

    w = weight.reshape(weight.shape[0], -1).to(x.dtype)  # (E, W): the kernel wants x's dtype
    b = None if bias is None else bias.to(x.dtype)
    y = causal_conv1d_fn(x.transpose(1, 2).contiguous(), w, b, activation="silu")  # (B, E, T)
    return y.transpose(1, 2)


def selective_scan(u, dt, A, B, C, D=None, z=None, dt_bias=None, chunk_size: int = 16):
    """The gated selective scan by mamba_ssm's `selective_scan_fn` (arguments as
    models.kernels.selective_scan.selective_scan_triton's). Returns (B, T, E) in u's dtype."""
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    def channel_major(x):  # (B, T, X) -> (B, X, T) in u's dtype, as the kernel wants its inputs
        return x.to(u.dtype).transpose(1, 2)

    y = selective_scan_fn(
        channel_major(u), channel_major(dt), A.float(), channel_major(B), channel_major(C),
        None if D is None else D.float(), None if z is None else channel_major(z),
        delta_bias=None if dt_bias is None else dt_bias.float(), delta_softplus=True,
    )  # fmt: skip
    return y.transpose(1, 2).to(u.dtype)  # (B, T, E)


def wkv(time_decay, time_first, k, v, r=None, chunk_size: int = 16):
    """sigmoid(r) * WKV by flash-linear-attention's RWKV-4 kernel, from the empty state (arguments
    as models.kernels.wkv.wkv_triton's). Returns (B, T, D) in r's dtype (fp32 without r)."""
    from fla.ops.rwkv4.fused_recurrent import fused_recurrent_rwkv4

    Bsz, T, D = k.shape
    # (B, 3, 1, D): numerator, denominator and their log scale, which starts at "log of zero"
    state = torch.zeros(Bsz, 3, 1, D, device=k.device)
    state[:, 2] = -1e38
    out, _ = fused_recurrent_rwkv4(
        time_decay.float(), time_first.float(), k.float().contiguous(), v.float().contiguous(),
        state,
    )  # fmt: skip
    out = out.float()
    return out if r is None else (torch.sigmoid(r) * out).to(r.dtype)


def ssd(
    x, dt, A, B, C, chunk_size, D=None, z=None, initial_state=None, *, dt_bias=None,
    dt_softplus=False, dt_limit=NO_DT_LIMIT, return_final_state=False,
):  # fmt: skip
    """Mamba-2's SSD scan by mamba_ssm's `mamba_chunk_scan_combined`, in chunks of
    FIELD_SSD_CHUNK (arguments and result as models.kernels.ssd.ssd_triton's; `chunk_size` is
    the PyTorch path's). Returns y (b, l, h, p) in x's dtype (and the final state in fp32)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    limit = {} if tuple(dt_limit) == NO_DT_LIMIT else {"dt_limit": tuple(dt_limit)}
    out = mamba_chunk_scan_combined(
        x, dt, A.float(), B, C, FIELD_SSD_CHUNK, D=D, z=z, dt_bias=dt_bias,
        initial_states=initial_state, dt_softplus=dt_softplus,
        return_final_states=return_final_state, **limit,
    )  # fmt: skip
    return (out[0], out[1].float()) if return_final_state else out
