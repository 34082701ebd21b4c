"""Benchmarks for models/: the chunked RWKV-4 WKV against transformers' CPU path, and the chunked
per-token NLL's peak memory against a full log_softmax.

    .venv/bin/python benchmarks/bench_models.py           # full sizes (a few minutes on 2 cores)
    .venv/bin/python benchmarks/bench_models.py --quick   # smoke run

1. RWKV: a randomly initialised `transformers.RwkvForCausalLM` and `models.mixers.rwkv.FastRwkv`
   built from the same weights (what `load_model("hf:<rwkv dir>")` runs) score one sequence of
   1024 tokens; tokens/s of the backbone forward (the LM head is the same matmul for both) and the
   WKV recurrence alone at batch 1 and 8 (transformers' `rwkv_linear_attention_cpu` vs
   `wkv_chunked`), min CPU time of several interleaved repeats, with closing lines on the WKV
   target (>= 5x at every width: for one sequence, and at every batch). The outputs are checked
   to agree.
2. NLL memory: per-token NLL of a (B, T, D) hidden state under a (50 304, D) head, computed by
   `models.nll.chunked_nll` and by a full fp32 `log_softmax` over (B, T, V); each in a fresh
   subprocess, reporting peak RSS above the inputs (VmHWM after a reset, Linux) and the largest
   NLL difference.

Timings use one thread by default (`--threads`): on a shared 2-core machine, two OpenMP threads
stall each other and make the vectorised side look arbitrarily slow.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def best_times(fns: dict, repeats: int) -> dict:
    """Min CPU time (time.process_time) of each function over `repeats` rounds, the functions
    interleaved within a round: a busy shared machine inflates CPU time less than wall time, and
    interleaving spreads any remaining drift over all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return best


def bench_rwkv(hidden: int, layers: int, seq: int, repeats: int, wkv_batches) -> dict:
    import torch
    import transformers
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    from models.checkpoints.hf_rwkv import rwkv_from_transformers
    from models.mixers.rwkv import wkv_chunked

    torch.manual_seed(0)
    cfg = transformers.RwkvConfig(
        vocab_size=50277, context_length=seq, hidden_size=hidden, num_hidden_layers=layers,
        rescale_every=0,
    )  # fmt: skip
    hf = transformers.RwkvForCausalLM(cfg).eval()
    fast = rwkv_from_transformers(hf)
    ids = torch.randint(0, 50277, (1, seq))
    with torch.no_grad():
        ref = hf.rwkv(input_ids=ids, use_cache=False).last_hidden_state
        ours = fast.rwkv(ids)
        max_diff = (ref - ours).abs().max().item()
        t = best_times(
            {"hf": lambda: hf.rwkv(input_ids=ids, use_cache=False), "ours": lambda: fast.rwkv(ids)},
            repeats,
        )
        t_hf, t_ours = t["hf"], t["ours"]
        att = hf.rwkv.blocks[-1].attention
        td, tf = att.time_decay.detach(), att.time_first.detach()
        wkv = {}
        for batch in wkv_batches:
            k, v = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
            ref, _ = rwkv_linear_attention_cpu(td, tf, k, v)
            wkv_diff = (ref - wkv_chunked(td, tf, k, v)).abs().max().item()
            t = best_times(
                {
                    "hf": lambda k=k, v=v: rwkv_linear_attention_cpu(td, tf, k, v),
                    "ours": lambda k=k, v=v: wkv_chunked(td, tf, k, v),
                },
                repeats,
            )
            w_hf, w_ours = t["hf"], t["ours"]
            wkv[batch] = {
                "tokens_per_s_transformers": batch * seq / w_hf,
                "tokens_per_s_chunked": batch * seq / w_ours,
                "speedup": w_hf / w_ours, "max_abs_diff": wkv_diff,
            }  # fmt: skip
    return {
        "hidden": hidden, "layers": layers, "seq": seq,
        "model_tokens_per_s_transformers": seq / t_hf, "model_tokens_per_s_chunked": seq / t_ours,
        "model_speedup": t_hf / t_ours, "max_abs_hidden_diff": max_diff, "wkv": wkv,
    }  # fmt: skip


def _proc_status_mib(key: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) / 1024


def nll_worker(mode: str, batch: int, seq: int, d: int, vocab: int) -> None:
    """Runs in a subprocess: prints JSON with peak RSS growth over the inputs and the NLLs."""
    import torch

    from models.nll import chunked_nll

    torch.manual_seed(0)
    hidden = torch.randn(batch, seq, d)
    weight = torch.randn(vocab, d) / d**0.5
    targets = torch.randint(0, vocab, (batch, seq))
    # reset the peak-RSS mark (Linux: writing 5 to clear_refs) so import-time peaks do not count
    Path("/proc/self/clear_refs").write_text("5")
    base = _proc_status_mib("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        if mode == "chunked":
            nll = chunked_nll(hidden, weight, None, targets, chunk_size=1024)
        else:
            logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)  # (B, T, V) fp32
            nll = -logp.gather(-1, targets[..., None])[..., 0]
    elapsed = time.perf_counter() - start
    peak = _proc_status_mib("VmHWM")
    print(json.dumps({"extra_peak_mib": peak - base, "seconds": elapsed, "nll": nll.tolist()}))


def bench_nll(batch: int, seq: int, d: int, vocab: int) -> dict:
    import numpy as np

    out = {}
    for mode in ("chunked", "full"):
        cmd = [
            sys.executable,
            __file__,
            "--nll-worker",
            mode,
            str(batch),
            str(seq),
            str(d),
            str(vocab),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    diff = float(np.abs(np.array(out["chunked"]["nll"]) - np.array(out["full"]["nll"])).max())
    return {
        "batch": batch, "seq": seq, "d_model": d, "vocab": vocab,
        "chunked_extra_peak_mib": out["chunked"]["extra_peak_mib"],
        "full_extra_peak_mib": out["full"]["extra_peak_mib"],
        "memory_ratio": out["full"]["extra_peak_mib"] / max(out["chunked"]["extra_peak_mib"], 1e-9),
        "chunked_s": out["chunked"]["seconds"], "full_s": out["full"]["seconds"],
        "max_abs_nll_diff": diff,
    }  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--nll-worker":
        mode, batch, seq, d, vocab = sys.argv[2], *map(int, sys.argv[3:7])
        nll_worker(mode, batch, seq, d, vocab)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    if args.quick:
        rwkv_sizes, seq, repeats = [(64, 2)], 256, 1
        nll_size = (1, 2048, 64, 50304)
    else:
        rwkv_sizes, seq, repeats = [(128, 4), (256, 4), (768, 2)], 1024, 5
        nll_size = (2, 2048, 256, 50304)

    batches = (1, 8)
    print(
        f"RWKV-4 at sequence length {seq}: transformers CPU path vs chunked WKV (min of {repeats})"
    )
    rows = [bench_rwkv(hidden, layers, seq, repeats, batches) for hidden, layers in rwkv_sizes]
    print("whole model, batch 1 (backbone forward):")
    print(f"{'width':>6} {'layers':>6} | {'tok/s hf':>9} {'chunked':>9} {'ratio':>6} | max |diff|")
    for r in rows:
        print(
            f"{r['hidden']:>6} {r['layers']:>6} | {r['model_tokens_per_s_transformers']:>9.0f} "
            f"{r['model_tokens_per_s_chunked']:>9.0f} {r['model_speedup']:>5.1f}x | "
            f"{r['max_abs_hidden_diff']:.1e}"
        )
    print("WKV alone (rwkv_linear_attention_cpu vs wkv_chunked, same inputs):")
    print(f"{'width':>6} {'batch':>6} | {'tok/s hf':>9} {'chunked':>9} {'ratio':>6} | max |diff|")
    for r in rows:
        for batch in batches:
            w = r["wkv"][batch]
            print(
                f"{r['hidden']:>6} {batch:>6} | {w['tokens_per_s_transformers']:>9.0f} "
                f"{w['tokens_per_s_chunked']:>9.0f} {w['speedup']:>5.1f}x | {w['max_abs_diff']:.1e}"
            )
    for label, among in (("one sequence (batch 1)", (1,)), ("every batch", batches)):
        worst = min((r["wkv"][b]["speedup"], r["hidden"], b) for r in rows for b in among)
        verdict = "met" if worst[0] >= 5 else "NOT met"
        print(
            f"target: WKV chunked >= 5x transformers at every width, {label}: {verdict} "
            f"(lowest {worst[0]:.1f}x at width {worst[1]}, batch {worst[2]})"
        )
    b, t, d, v = nll_size
    r = bench_nll(b, t, d, v)
    print(f"\nper-token NLL of {b}x{t} tokens, vocabulary {v}: peak RSS above the inputs")
    print(
        f"  chunked_nll (1024-token chunks): {r['chunked_extra_peak_mib']:8.0f} MiB  "
        f"({r['chunked_s']:.2f} s)\n"
        f"  full log_softmax (B, T, V) fp32: {r['full_extra_peak_mib']:8.0f} MiB  ({r['full_s']:.2f} s)\n"
        f"  ratio {r['memory_ratio']:.1f}x less memory; max |NLL difference| {r['max_abs_nll_diff']:.1e}"
    )


if __name__ == "__main__":
    main()
