"""Benchmark: the chunked Mamba-1 forward (models/mixers/mamba.py) against transformers' CPU
reference path.

    .venv/bin/python benchmarks/bench_mamba.py           # T = 2048, d_model 768 (~5 min, 1 thread)
    .venv/bin/python benchmarks/bench_mamba.py --quick   # smoke run

A randomly initialised `transformers.MambaForCausalLM` (d_model 768, state 16, inner width 1536,
2 layers, the GPT-NeoX vocabulary of `state-spaces/mamba-*-hf`) and the `MambaLM` built from the
same weights (what `load_model("hf:<dir>")` runs) read T = 2048 tokens, 1 and 8 sequences:

* whole model: the backbone forward (the LM head is the same matmul for both); max |Δnll| is the
  largest difference of the per-token NLL that the two hidden states give through that head;
* selective scan alone, on one layer's inputs, each in the layout its own mixer makes
  ((B, E, T) and (B, T, E)): transformers' `mamba_selective_scan` (its sequential fallback when
  `mamba_ssm` is absent) against `models.mixers.mamba.selective_scan_chunked`, both with the softplus
  of Δ, the D skip and the gate, and their largest output difference.

Times are the minimum CPU time of interleaved repeats (one thread by default, `--threads`),
printed with the load average. The closing lines check the target: the chunked scan at least
10x transformers' at 1 and at 8 sequences. In the whole model the input and output projections
(about 0.2 s per layer and sequence here, the same matmuls for both) bound the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench_models import best_times

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 10.0
VOCAB = 50280  # state-spaces/mamba-*-hf: GPT-NeoX's 50 277 tokens padded to a multiple of 8


def build(d_model: int, layers: int):
    import torch
    import transformers

    from models.checkpoints.mamba_ssm import mamba_from_transformers

    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=d_model, state_size=16, num_hidden_layers=layers
    )
    hf = transformers.MambaForCausalLM(cfg).eval()
    with torch.no_grad():  # decays from slow to fast, as in a trained model
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.add_(torch.randn_like(p))
    return hf, mamba_from_transformers(hf)


def scan_inputs(hf, ids):
    """One layer's scan inputs, laid out as transformers' MambaMixer passes them: (B, E, T)."""
    import torch
    import torch.nn.functional as F

    mixer = hf.backbone.layers[0].mixer
    T = ids.shape[1]
    x = mixer.in_proj(hf.backbone.embeddings(ids)).transpose(1, 2)  # (B, 2E, T)
    xs, z = x.chunk(2, dim=1)
    u = F.silu(mixer.conv1d(xs)[..., :T])  # (B, E, T)
    sizes = [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size]
    dt, B, C = torch.split(mixer.x_proj(u.transpose(1, 2)), sizes, dim=-1)  # (B, T, .)
    dt = mixer.dt_proj.weight @ dt.transpose(1, 2)  # (B, E, T); the scan adds the bias
    A = -torch.exp(mixer.A_log.float())  # (E, N)
    return {
        "u": u, "dt": dt, "A": A, "B": B.transpose(1, 2), "C": C.transpose(1, 2),
        "D": mixer.D.float(), "z": z.contiguous(), "bias": mixer.dt_proj.bias.float(),
    }  # fmt: skip


def transformers_scan(s):
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    return mamba_selective_scan(
        s["u"], s["dt"], s["A"], s["B"], s["C"], D=s["D"], z=s["z"], delta_bias=s["bias"],
        delta_softplus=True,
    )  # fmt: skip


def own_layout(s):
    """The same inputs laid out as models/mixers/mamba.py's mixer makes them: (B, T, X) row-major."""
    return {k: v.transpose(1, 2).contiguous() if v.dim() == 3 else v for k, v in s.items()}


def chunked_scan(s):
    """models.mixers.mamba's scan (softplus, scan, D skip, gate) on `own_layout` inputs: (B, T, E)."""
    import torch.nn.functional as F

    from models.mixers.mamba import selective_scan_chunked

    delta = F.softplus(s["dt"] + s["bias"])
    return selective_scan_chunked(s["u"], delta, s["A"], s["B"], s["C"], s["D"], s["z"])


def bench(hf, fast, batch: int, seq: int, repeats: int) -> dict:
    import torch

    from models.nll import tiled_nll

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        ref = hf.backbone(input_ids=inputs, use_cache=False).last_hidden_state
        ours = fast.backbone(inputs)
        head = fast.lm_head.weight
        dnll = (tiled_nll(ref, head, None, targets) - tiled_nll(ours, head, None, targets)).abs()
        t = best_times(
            {
                "hf": lambda: hf.backbone(input_ids=inputs, use_cache=False),
                "ours": lambda: fast.backbone(inputs),
            },
            repeats,
        )
        s = scan_inputs(hf, inputs)
        own = own_layout(s)
        diff = transformers_scan(s) - chunked_scan(own).transpose(1, 2)
        scan_diff = diff.abs().max().item()
        ts = best_times(
            {"hf": lambda: transformers_scan(s), "ours": lambda: chunked_scan(own)}, repeats
        )
    return {
        "batch": batch, "model_hf_s": t["hf"], "model_ours_s": t["ours"],
        "model_speedup": t["hf"] / t["ours"], "max_dnll": dnll.max().item(),
        "scan_hf_s": ts["hf"], "scan_ours_s": ts["ours"], "scan_speedup": ts["hf"] / ts["ours"],
        "scan_max_diff": scan_diff,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.quick:
        d_model, layers, seq, batches, repeats = 128, 1, 256, (1, 2), args.repeats or 1
    else:
        d_model, layers, seq, batches, repeats = 768, 2, 2048, (1, 8), args.repeats or 3
    hf, fast = build(d_model, layers)
    print(
        f"Mamba-1, d_model {d_model} (inner {2 * d_model}, state 16), {layers} layers, T = {seq}: "
        f"transformers' CPU path vs models/mixers/mamba.py, min CPU time of {repeats} interleaved "
        f"rounds, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f} at the start"
    )
    rows = [bench(hf, fast, batch, seq, repeats) for batch in batches]
    print(f"{'':22} {'batch':>5} | {'hf s':>8} {'ours s':>8} {'ratio':>7} | max |diff|")
    for r in rows:
        print(
            f"{'whole model (backbone)':22} {r['batch']:>5} | {r['model_hf_s']:>8.2f} "
            f"{r['model_ours_s']:>8.2f} {r['model_speedup']:>6.1f}x | "
            f"{r['max_dnll']:.1e} nll"
        )
    for r in rows:
        print(
            f"{'selective scan alone':22} {r['batch']:>5} | {r['scan_hf_s']:>8.2f} "
            f"{r['scan_ours_s']:>8.2f} {r['scan_speedup']:>6.1f}x | {r['scan_max_diff']:.1e}"
        )
    for r in rows:
        verdict = "met" if r["scan_speedup"] >= TARGET else "NOT met"
        print(
            f"target: chunked scan >= {TARGET:.0f}x transformers' at {r['batch']} sequence(s): "
            f"{verdict} ({r['scan_speedup']:.1f}x; whole model {r['model_speedup']:.1f}x)"
        )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
