"""What pinning torch's CPU kernels for training costs (`models.cpu_kernels`): the demo's four
models trained a few steps with the pin (AVX2 kernels, MKL's COMPATIBLE branch, oneDNN capped
at AVX2) and with this CPU's own fastest kernels (the baseline: nothing pinned), and, for the
record, with MKL's AVX2 branch instead of COMPATIBLE (the same bytes on every Intel CPU with
AVX2, but not on AMD's, where MKL ignores it) and with every library at its plainest code
(torch's kernels without AVX2, oneDNN at SSE4.1: the same bytes on CPUs without AVX2 too).

Each (setting, model) trains in its own fresh process (the pin is read when torch loads), one
thread, the demo's shapes (d_model 128, 4 layers, BaseConv 6; rows of 256 tokens, 8 a step) on
a stream of random token ids, through the trainer's own loop (`pipeline.train.loop.train_steps`).
The figure is CPU seconds per step (`time.process_time`, after two warm-up steps): on a shared
machine wall time mostly measures the neighbours, CPU time the work.

  .venv/bin/python benchmarks/bench_train_kernels.py            # 30 steps, 2 rounds
  .venv/bin/python benchmarks/bench_train_kernels.py --steps 10 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data" / "train-kernels"
VOCAB = 2048
MODELS = {  # the demo's (pipeline/configs/demo.toml)
    "transformer_pp": {
        "mixer_options": ["num_heads=4"],
        "model_options": ['state_mixer_kwargs={"hidden": 368}'],
    },
    "base_conv": {"n_layers": 6},
    "hyena": {},
    "rwkv": {},
}
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def settings() -> dict[str, dict[str, str]]:
    from models.cpu_kernels import PIN

    return {
        "this CPU's own": {},
        "pinned": dict(PIN),
        "pinned, MKL AVX2": {**PIN, "MKL_CBWR": "AVX2"},
        "plain (SSE) everywhere": {
            "ATEN_CPU_CAPABILITY": "default",
            "MKL_CBWR": "COMPATIBLE",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
        },
    }


def store() -> Path:
    import numpy as np

    from ar_slicing.data.store import write_token_store
    from ar_slicing.machinery.io import is_complete

    path = DATA / "random"
    if not is_complete(path):
        rng = np.random.default_rng(0)
        docs = [rng.integers(1, VOCAB, 2000).tolist() for _ in range(500)]
        info = {"name": "random", "fingerprint": "b" * 64, "vocab_size": VOCAB, "eos_id": 0}
        write_token_store(path, docs, tokenizer_info=info)
    return path


def worker(arch: str, steps: int, tokens: str) -> None:
    """Train `arch` `steps` steps in this process; print CPU seconds per step as JSON."""
    import time

    import torch

    from pipeline.train import TrainConfig, make_optimizer, model_config_for
    from pipeline.train.loop import Progress, TrainInputs, train_steps
    from pipeline.train.state import build_model

    torch.set_num_threads(1)
    cfg = TrainConfig(
        arch=arch, tokens=tokens, out="unused", d_model=128, seq_len=256, batch_size=8,
        steps=steps + 2, warmup_steps=5, eval_every=0, checkpoint_every=0, progress=False,
        **MODELS[arch],
    )  # fmt: skip
    inputs = TrainInputs.open(cfg)
    torch.manual_seed(0)
    model = build_model(model_config_for(cfg, VOCAB), "cpu")
    optimizer = make_optimizer(model, cfg)
    progress = Progress()

    def run(until):
        train_steps(
            cfg, model, optimizer, inputs, progress, "cpu", lambda: torch.autocast("cpu", enabled=False),
            checkpoint=lambda p: None, name=arch, until=until,
        )  # fmt: skip

    run(2)  # warm-up: first calls allocate and pick their kernels
    t0 = time.process_time()
    run(steps + 2)
    print(json.dumps({"cpu_s_per_step": (time.process_time() - t0) / steps}))


def measure(arch: str, env_vars: dict, steps: int, tokens: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(env_vars, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [
        sys.executable,
        __file__,
        "--worker",
        arch,
        "--steps",
        str(steps),
        "--tokens",
        str(tokens),
    ]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu_s_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.tokens)
        return
    tokens = store()
    kinds = settings()
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):  # rounds alternate the order, so drift favours no setting
        for arch in MODELS:
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                s = measure(arch, kinds[kind], args.steps, tokens)
                best[arch, kind] = min(s, best.get((arch, kind), s))
    print(f"load average {os.getloadavg()[0]:.1f}; CPU seconds per training step, best of "
          f"{args.rounds} ({args.steps} steps, one thread)")  # fmt: skip
    print(f"| model | {' | '.join(kinds)} | pinned / own |")
    print("|---|" + "---:|" * (len(kinds) + 1))
    total = {k: 0.0 for k in kinds}
    for arch in MODELS:
        row = [best[arch, k] for k in kinds]
        for k, v in zip(kinds, row, strict=True):
            total[k] += v
        ratio = best[arch, "pinned"] / best[arch, "this CPU's own"]
        print(f"| {arch} | {' | '.join(f'{v:.3f}' for v in row)} | {ratio:.2f}x |")
    ratio = total["pinned"] / total["this CPU's own"]
    print(f"| all four | {' | '.join(f'{total[k]:.3f}' for k in kinds)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
