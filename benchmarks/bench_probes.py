"""The probes of one checkpoint (induction score and zero-shot key-value recall at the default
`ProbeSizes`) against the eval stage's own work on as many tokens, on CPU, in the same run.

Both go through `pipeline.eval.forward.score_rows` with the same model, one torch thread, fp32:

  * probes  `ar_slicing.analysis.probes.run_probes` (drawing the sequences, scoring them, building the
            tables) and the statistics the report reads (`induction_score`, `recall_by_k`,
            `recall_by_distance`, 1000 bootstrap resamples each);
  * eval    the same number of tokens in rows of the run's window (256), as the eval stage scores
            a model's windows.

The model is the demo's Transformer++ (demo-models/torch/transformer_pp, ~1.1M parameters, d_model
128, vocabulary 2048). Printed: tokens/s of each (best of `--repeat`), their ratio, the load
average, and what the probe stage would add to `make all` on the demo (every model and kept
checkpoint: 21 points, two side by side as the demo trains them) at the measured rate.

    .venv/bin/python benchmarks/bench_probes.py
    .venv/bin/python benchmarks/bench_probes.py --repeat 5   # steadier numbers on a busy machine
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "demo-models" / "torch" / "transformer_pp"
WINDOW = 256
DEMO_POINTS = 21  # 4 final models, 4 kept checkpoints each (Transformer++ 5): docs/design.md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch

    from ar_slicing.analysis.probes import (
        ProbeSizes,
        induction_score,
        probe_vocabulary,
        recall_by_distance,
        recall_by_k,
        run_probes,
    )
    from models import load_model
    from pipeline.eval.forward import score_rows

    torch.set_num_threads(1)
    loaded = load_model(f"native:{MODEL}")
    sizes = ProbeSizes()
    vocab = probe_vocabulary(2048, [0], loaded.vocab_size)  # the demo tokenizer's EOS is id 0
    score = functools.partial(score_rows, loaded, device="cpu", dtype="fp32")
    n_tokens = sizes.tokens_read(prefix=True)
    rows = np.random.default_rng(0).integers(1, 2048, size=(-(-n_tokens // WINDOW), WINDOW + 1))
    score(rows[:2])  # warm up (first-call allocations)

    best = {"probes": float("inf"), "eval": float("inf")}
    print(f"bench_probes: load average {os.getloadavg()[0]:.2f} at the start")
    for _ in range(args.repeat):
        t = time.perf_counter()
        tables = run_probes(score, vocab, sizes, seed=0, prefix=0)
        induction_score(tables.induction)
        recall_by_k(tables.recall, vocab.head_rows)
        recall_by_distance(tables.recall)
        best["probes"] = min(best["probes"], time.perf_counter() - t)
        t = time.perf_counter()
        score(rows)
        best["eval"] = min(best["eval"], time.perf_counter() - t)
    probe_rate = n_tokens / best["probes"]
    eval_rate = rows[:, :-1].size / best["eval"]
    print(
        f"probes of one checkpoint ({n_tokens:,} tokens: induction n={sizes.induction_length} x "
        f"{sizes.induction_sequences}, recall k={list(sizes.recall_pairs)} x "
        f"{sizes.recall_queries} queries): {best['probes']:.2f} s, {probe_rate:,.0f} tokens/s"
    )
    print(f"eval forward, {len(rows)} windows of {WINDOW}: {eval_rate:,.0f} tokens/s")
    print(f"probes / eval tokens/s: {probe_rate / eval_rate:.2f}")
    print(
        f"the demo's {DEMO_POINTS} points, two at a time: ~{DEMO_POINTS * best['probes'] / 2:.0f} s "
        f"(load average {os.getloadavg()[0]:.2f} at the end)"
    )


if __name__ == "__main__":
    main()
