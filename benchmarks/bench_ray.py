"""The count stage on a local Ray cluster beside the local process pool, same data, same workers.

What it shows on one machine: what Ray costs per task (its scheduling and object store, measured
on a map of no-op tasks) and for a whole `count_stores` run, against the process pool that is
the default. On one machine Ray cannot win; the point of `--executor ray` is a cluster, where the
same tasks spread over many machines. Ray's start-up is reported apart (paid once per run).

Data: a uint16 token store of Zipf-distributed tokens over 50 304 ids under bench-data/ray/.
Both runs must write the same bigrams.parquet, byte for byte (checked).

  .venv/bin/python benchmarks/bench_ray.py            # 50 M tokens, 2 workers
  .venv/bin/python benchmarks/bench_ray.py --quick    # 4 M tokens
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "bench-data" / "ray"
VOCAB = 50_304


def zipf_store(n_tokens: int) -> Path:
    from ar_slicing.data.store import write_token_store
    from ar_slicing.machinery.io import is_complete

    path = DATA / f"zipf-{n_tokens}"
    if is_complete(path):
        return path
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, VOCAB)
    ids = rng.choice(np.arange(1, VOCAB), size=n_tokens, p=weights / weights.sum())
    doc = 1 << 20
    docs = [ids[a : a + doc] for a in range(0, n_tokens, doc)]
    info = {"name": "zipf", "fingerprint": "bench" + "0" * 59, "vocab_size": VOCAB, "eos_id": 0}
    write_token_store(path, docs, tokenizer_info=info)
    return path


def noop(task):
    return task


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 M tokens instead of 50 M")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-tokens", type=int, default=1 << 22)
    parser.add_argument("--noop-tasks", type=int, default=400)
    args = parser.parse_args()

    import ray

    from ar_slicing.machinery.executor import LocalExecutor
    from ar_slicing.machinery.ray_executor import RayExecutor
    from pipeline.count import count_stores

    n_tokens = 4_000_000 if args.quick else 50_000_000
    store = zipf_store(n_tokens)
    out = DATA / "out"
    shutil.rmtree(out, ignore_errors=True)
    kw = dict(shard_tokens=args.shard_tokens, progress=False)

    t_start = timed(
        lambda: ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    )
    try:
        ray_ex = RayExecutor(args.workers)
        local_ex = LocalExecutor(args.workers)
        # warm both (numba kernels loaded, Ray workers started) on a small run first
        for name, ex in (("local", local_ex), ("ray", ray_ex)):
            warm = out / f"warm-{name}"
            count_stores(
                [store], warm, make_executor=lambda e=ex: e, shard_tokens=1 << 20, progress=False
            )
        rounds = {"local": [], "ray": []}
        for r in range(2):  # alternate, so drift on a shared machine hits both
            for name, ex in (("local", local_ex), ("ray", ray_ex)):
                target = out / f"{name}-{r}"
                rounds[name].append(
                    timed(
                        lambda t=target, e=ex: count_stores(
                            [store], t, make_executor=lambda: e, **kw
                        )
                    )
                )
        same = (out / "local-0" / "bigrams.parquet").read_bytes() == (
            out / "ray-0" / "bigrams.parquet"
        ).read_bytes()
        tasks = list(range(args.noop_tasks))
        t_noop_ray = timed(lambda: list(ray_ex.map_unordered(noop, tasks)))
        t_noop_local = timed(lambda: list(local_ex.map_unordered(noop, tasks)))
    finally:
        ray.shutdown()
        shutil.rmtree(out, ignore_errors=True)

    n_shards = -(-n_tokens // args.shard_tokens)
    local_s, ray_s = min(rounds["local"]), min(rounds["ray"])
    print(
        f"count of {n_tokens / 1e6:.0f} M Zipf tokens, {n_shards} map shards, {args.workers} workers"
    )
    print(f"  local process pool  {local_s:7.2f} s  {n_tokens / local_s / 1e6:6.1f} M tokens/s")
    print(f"  ray (local cluster) {ray_s:7.2f} s  {n_tokens / ray_s / 1e6:6.1f} M tokens/s")
    print(f"  ray / local time    {ray_s / local_s:7.2f}x   (bigrams.parquet identical: {same})")
    print(f"  ray start-up        {t_start:7.2f} s  (once per run, not in the figures above)")
    print(
        f"no-op tasks: ray {t_noop_ray / len(tasks) * 1e3:.2f} ms/task, local pool "
        f"{t_noop_local / len(tasks) * 1e3:.2f} ms/task ({t_noop_ray / t_noop_local:.1f}x)"
    )
    if not same:
        raise SystemExit("bigrams.parquet differs between the executors")


if __name__ == "__main__":
    main()
