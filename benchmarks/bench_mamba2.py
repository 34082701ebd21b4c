"""Benchmark: the Mamba-2 forward (models/mixers/mamba2.py's chunked SSD in models/mixer_model.py's
`MixerLM`) against transformers' own CPU path (`Mamba2ForCausalLM`'s pure-PyTorch SSD).

    .venv/bin/python benchmarks/bench_mamba2.py           # T = 2048, state-spaces/mamba2-130m's widths
    .venv/bin/python benchmarks/bench_mamba2.py --quick   # smoke run

A randomly initialised `transformers.Mamba2ForCausalLM` with the layer of state-spaces/mamba2-130m
(d_model 768, 24 heads of 64, state 128, one group, transformers' chunk of 256), 2 layers, the
GPT-NeoX vocabulary, and the `MixerLM` built from the same weights (what
`load_model("hf:<dir>")` runs, scanning in chunks of 64) read T = 2048 tokens, 1 and 4 sequences:

* whole model: the backbone forward (the LM head is the same matmul for both); max |Δnll| is the
  largest difference of the per-token NLL the two hidden states give through that head;
* the SSD scan alone on one layer's inputs: transformers' `mamba2_chunk_scan` (its fallback when
  `mamba_ssm` is absent) against `models.mixers.mamba2.ssd_chunked`, and their largest output
  difference.

Times are the minimum CPU time of interleaved repeats (one thread by default, `--threads`),
printed with the load average; the closing line says whether the whole model is faster than
transformers' at every batch. In the whole model the projections (the same matmuls for both)
bound the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench_models import best_times

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 50288  # state-spaces/mamba2-*: GPT-NeoX's 50 277 tokens padded to a multiple of 16


def build(d_model: int, layers: int, heads: int, state: int):
    import torch
    import transformers

    from models.checkpoints.mamba_ssm import mamba2_from_transformers

    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=d_model, num_heads=heads, head_dim=2 * d_model // heads,
        state_size=state, n_groups=1, num_hidden_layers=layers, chunk_size=256,
    )  # fmt: skip
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    return hf, mamba2_from_transformers(hf)


def scan_inputs(hf, ids) -> dict:
    """One layer's scan inputs, as transformers' Mamba2Mixer hands them to its scan."""
    import torch
    import torch.nn.functional as F

    m = hf.backbone.layers[0].mixer
    b, T = ids.shape
    zxbcdt = m.in_proj(hf.backbone.embeddings(ids))
    _, xBC, dt = zxbcdt.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    xBC = F.silu(m.conv1d(xBC.transpose(1, 2))[..., :T].transpose(1, 2))
    G, N = m.n_groups, m.ssm_state_size
    x, B, C = torch.split(xBC, [m.intermediate_size, G * N, G * N], dim=-1)
    return {
        "x": x.reshape(b, T, m.num_heads, m.head_dim), "dt": dt, "A": -torch.exp(m.A_log.float()),
        "B": B.reshape(b, T, G, N), "C": C.reshape(b, T, G, N), "D": m.D.float(),
        "dt_bias": m.dt_bias.float(), "chunk": m.chunk_size,
    }  # fmt: skip


def transformers_scan(s):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return mamba2_chunk_scan(
        s["x"], s["dt"], s["A"], s["B"], s["C"], s["chunk"], D=s["D"], dt_bias=s["dt_bias"],
        dt_softplus=True,
    )  # fmt: skip


def chunked_scan(s):
    from models.mixers.mamba2 import LOADED_CHUNK_SIZE, ssd_chunked

    return ssd_chunked(
        s["x"], s["dt"], s["A"], s["B"], s["C"], LOADED_CHUNK_SIZE, D=s["D"],
        dt_bias=s["dt_bias"], dt_softplus=True,
    )  # fmt: skip


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
        scan_diff = (transformers_scan(s) - chunked_scan(s)).abs().max().item()
        ts = best_times(
            {"hf": lambda: transformers_scan(s), "ours": lambda: chunked_scan(s)}, repeats
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
    import logging

    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)  # its "falling back" notices
    torch.set_num_threads(args.threads)
    if args.quick:
        d_model, layers, heads, state, seq, batches = 128, 1, 4, 32, 512, (1,)
        repeats = args.repeats or 1
    else:
        d_model, layers, heads, state, seq, batches = 768, 2, 24, 128, 2048, (1, 4)
        repeats = args.repeats or 3
    hf, fast = build(d_model, layers, heads, state)
    print(
        f"Mamba-2, d_model {d_model} ({heads} heads of {2 * d_model // heads}, state {state}), "
        f"{layers} layers, T = {seq}: transformers' CPU path vs models/mixers/mamba2.py, min CPU "
        f"time of {repeats} interleaved rounds, {args.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.2f} at the start"
    )
    rows = [bench(hf, fast, batch, seq, repeats) for batch in batches]
    print(f"{'':22} {'batch':>5} | {'hf s':>8} {'ours s':>8} {'ratio':>7} | max |diff|")
    for r in rows:
        print(
            f"{'whole model (backbone)':22} {r['batch']:>5} | {r['model_hf_s']:>8.2f} "
            f"{r['model_ours_s']:>8.2f} {r['model_speedup']:>6.1f}x | {r['max_dnll']:.1e} nll"
        )
    for r in rows:
        print(
            f"{'SSD scan alone':22} {r['batch']:>5} | {r['scan_hf_s']:>8.2f} "
            f"{r['scan_ours_s']:>8.2f} {r['scan_speedup']:>6.1f}x | {r['scan_max_diff']:.1e}"
        )
    faster = all(r["model_speedup"] > 1.0 for r in rows)
    ratios = ", ".join(f"{r['model_speedup']:.1f}x" for r in rows)
    print(
        "target: whole model faster than transformers' at every batch: "
        f"{'met' if faster else 'NOT met'} ({ratios})"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
