"""`arslice eval`'s core against a naive per-window loop, on CPU, in the same run.

Both score the same 2048-token windows of real text (Python standard-library sources, tokenized by
a byte-level BPE trained here) with the same ~10 M-parameter GPT-NeoX (random weights from a
Pythia-like config, saved to a temporary directory and loaded with `hf:<dir>`):

  * eval   `pipeline.eval.run_eval` end to end: loading, batched forward passes under
           inference_mode, tiled fp32 cross-entropy, Parquet output and meta.json. Twice: with
           `--dtype auto` (the default: bf16 autocast on a CPU with native bf16, fp32 elsewhere)
           and with `--dtype fp32` (exact fp32 throughout).
  * naive  what one writes first: the same model from `from_pretrained`, one window at a time
           (batch 1) under no_grad, full `(T, V)` fp32 `log_softmax`, gather.

Each measurement runs in a fresh process (so peak memory and allocator state are its own), the two
alternating `--repeat` times, best kept. Printed: tokens/s of each (loop only, and end to end with
model loading and output), their ratio (target >= 2x for the default), peak resident memory of
each (VmHWM), and the largest and mean |difference| of each eval's losses from the naive ones.

    .venv/bin/python benchmarks/bench_eval.py            # 8 windows
    .venv/bin/python benchmarks/bench_eval.py --quick    # 2 windows, a smoke run
    .venv/bin/python benchmarks/bench_eval.py --repeat 3 # steadier numbers on a busy machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WINDOW = 2048
VOCAB = 50304  # Pythia's padded GPT-NeoX vocabulary: the output head is most of the work
TOKENIZER_VOCAB = 8192
METHODS = ("naive", "eval:auto", "eval:fp32")


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_inputs(root: Path, n_windows: int) -> tuple[Path, str, int]:
    """A validation store of real text, its tags, and a saved GPT-NeoX. Returns (tags, spec, n_params)."""
    from eval_inputs import build_tagged_text

    from tests.tiny_models import neox_lm

    tok = build_tagged_text(root, n_windows, WINDOW, TOKENIZER_VOCAB, train_docs=10**6)
    model = neox_lm(
        VOCAB, hidden_size=96, num_hidden_layers=6, num_attention_heads=4, intermediate_size=384,
        max_position_embeddings=WINDOW,
    )  # fmt: skip
    model.save_pretrained(root / "neox")
    (root / "neox" / "tokenizer.json").write_text(tok.to_str())
    return root / "tags", f"hf:{root / 'neox'}", sum(p.numel() for p in model.parameters())


def naive_losses(model_dir: str, store, starts, n_targets) -> tuple[np.ndarray, float]:
    """Batch 1, one window at a time, full fp32 log_softmax over the vocabulary, gather."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():  # warm-up, untimed: one-time allocator and thread-pool start-up costs
        model(input_ids=torch.zeros(1, 64, dtype=torch.long))
    t0 = time.perf_counter()
    with torch.no_grad():
        for start, n in zip(starts, n_targets):
            span = torch.from_numpy(store.slice(int(start), int(start + n + 1)).astype(np.int64))
            logits = model(input_ids=span[None, :-1]).logits[0]  # (T, V)
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.append(-logp.gather(1, span[1:, None])[:, 0].numpy())
    return np.concatenate(out), time.perf_counter() - t0


def measure(method: str, root: Path, batch_size: str) -> dict:
    """One method in this (fresh) process: loop seconds, end-to-end seconds, peak RSS; losses saved."""
    import pyarrow.parquet as pq

    from ar_slicing.machinery.io import read_json
    from pipeline.eval import EvalConfig, open_tags, run_eval

    tags = open_tags(root / "tags")
    reset_peak_rss()
    t0 = time.perf_counter()
    if method == "naive":
        nll, loop_s = naive_losses(str(root / "neox"), tags.store, tags.starts, tags.n_targets)
        extra = {}
    else:
        out = root / "losses"
        run_eval(
            EvalConfig(
                model=f"hf:{root / 'neox'}",
                tags=str(root / "tags"),
                out=str(out),
                device="cpu",
                dtype=method.split(":")[1],
                batch_size=batch_size,
                overwrite=True,
            )
        )
        meta = read_json(out / "meta.json")
        loop_s = meta["tokens"] / meta["tokens_per_s"]
        nll = np.concatenate(
            [
                pq.read_table(p).column("nll").to_numpy()
                for p in sorted(out.glob("losses-*.parquet"))
            ]
        )
        extra = {"batch_size": meta["batch_size"], "dtype": meta["dtype"]}
    total_s = time.perf_counter() - t0
    np.save(root / f"{method}.npy", nll)
    return {
        "loop_s": loop_s,
        "total_s": total_s,
        "peak_mib": peak_rss_mib(),
        "rows": len(nll),
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 windows instead of 8")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--batch-size", default="auto")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="alternate the methods this many times; keep each one's best",
    )
    parser.add_argument("--measure", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # child process: one measurement, as JSON on the last line
        print(json.dumps(measure(args.measure, Path(args.root), args.batch_size)))
        return
    n_windows = args.windows or (2 if args.quick else 8)

    import torch

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        print(
            f"building inputs: {n_windows} windows of {WINDOW} tokens, GPT-NeoX vocab {VOCAB} ..."
        )
        n_params = build_inputs(root, n_windows)[2]
        print(f"model: GPT-NeoX {n_params / 1e6:.1f} M parameters; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        best: dict[str, dict] = {}
        for _ in range(args.repeat):
            for method in METHODS:
                # A fresh process each: peak memory and allocator state are the method's own.
                proc = subprocess.run(
                    [sys.executable, __file__, "--measure", method, "--root", str(root),
                     "--batch-size", str(args.batch_size)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                print(
                    f"  {method:9s} loop {got['loop_s']:.2f} s, end to end {got['total_s']:.2f} s"
                )
                if method not in best or got["loop_s"] < best[method]["loop_s"]:
                    best[method] = {
                        **got,
                        "total_s": min(got["total_s"], best.get(method, got)["total_s"]),
                    }
        naive = np.load(root / "naive.npy")
        diffs = {m: np.abs(np.load(root / f"{m}.npy") - naive) for m in METHODS[1:]}

    nv = best["naive"]
    rows = nv["rows"]
    print()
    print(f"{rows} targets in {n_windows} windows; best of {args.repeat}")
    print(f"{'':34s}{'tokens/s':>10s}{'ratio':>8s}{'end to end':>12s}{'ratio':>8s}"
          f"{'peak MiB':>10s}{'max|dNLL|':>11s}{'mean|dNLL|':>11s}")  # fmt: skip
    for m in METHODS:
        r = best[m]
        label = "naive (batch 1, fp32 log_softmax)" if m == "naive" else f"eval --dtype {m[5:]}"
        if m != "naive":
            label += f" ({r['dtype']}, batch {r['batch_size']})"
        d = diffs.get(m)
        print(f"{label:34s}{rows / r['loop_s']:10,.0f}{nv['loop_s'] / r['loop_s']:7.2f}x"
              f"{rows / r['total_s']:12,.0f}{nv['total_s'] / r['total_s']:7.2f}x{r['peak_mib']:10,.0f}"
              + (f"{d.max():11.2e}{d.mean():11.2e}" if d is not None else ""))  # fmt: skip
    ratio = nv["loop_s"] / best["eval:auto"]["loop_s"]
    print(f"target: eval (default dtype) >= 2x naive tokens/s (loop) -> "
          f"{'met' if ratio >= 2 else 'NOT met'} ({ratio:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
