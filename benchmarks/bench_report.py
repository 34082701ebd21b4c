"""Report-stage benchmark: the window bootstrap and the slice query, each against a plain baseline.

1. Bootstrap of every Table-1 statistic (`ar_slicing.analysis.metrics.bootstrap`: per-window sums, one
   matrix product per chunk of replicates) vs the textbook loop: per replicate, gather the tokens
   of the resampled windows and recompute the slice means. Same draws, same numbers (checked).
   The baseline runs a subset of the replicates; the figure compared is seconds per replicate.
2. `queries/slice_perplexity.sql` through results.duckdb (views over Parquet) vs polars reading
   the same Parquet, joining tags and losses and grouping.

    .venv/bin/python benchmarks/bench_report.py            # 2,000 windows of 2,048 tokens, 3 models
    .venv/bin/python benchmarks/bench_report.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ar_slicing.analysis.metrics import WindowSums, bootstrap  # noqa: E402
from tests.handmade import write_handmade_meta  # noqa: E402

MODELS = ("attention", "hyena", "rwkv")


def make_run(root: Path, n_windows: int, window: int, seed: int = 0):
    """Tags and losses Parquet for a synthetic run (10% AR hits); returns per-token arrays."""
    rng = np.random.default_rng(seed)
    n = n_windows * window
    w = np.repeat(np.arange(n_windows, dtype=np.int32), window)
    pos = np.tile(np.arange(1, window + 1, dtype=np.int32), n_windows)
    is_ar = rng.random(n) < 0.1
    train_count = rng.integers(0, 10**6, n)
    tags = root / "tags"
    tags.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "window_id": np.arange(n_windows, dtype=np.int32),
                "start": np.arange(n_windows, dtype=np.int64) * window,
                "n_targets": np.full(n_windows, window, np.int32),
            }
        ),
        tags / "windows.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "window_id": w,
                "pos": pos,
                "doc_id": (np.arange(n) // 5000).astype(np.int64),
                "token": rng.integers(0, 50000, n).astype(np.int32),
                "prev": rng.integers(0, 50000, n).astype(np.int32),
                "train_count": train_count,
                "prev_pos": pa.array(np.where(is_ar, 1, 0).astype(np.int32), mask=~is_ar),
                "is_repeat": is_ar,
                "is_ar_hit": is_ar,
                "subset": pa.array(np.where(w % 3 == 0, "Github", "ArXiv")),
            }
        ),
        tags / "tags-00000.parquet",
        row_group_size=1 << 20,
    )
    write_handmade_meta(
        tags, "tag", tokens=None, fingerprint="f" * 64, window=window, threshold=1250
    )
    nll = {}
    base = rng.gamma(2.0, 1.5, n).astype(np.float32)
    for k, m in enumerate(MODELS):
        nll[m] = base * np.where(is_ar, 0.3 + 0.4 * k, 1.0 + 0.02 * k).astype(np.float32)
        out = root / "losses" / m
        out.mkdir(parents=True)
        pq.write_table(
            pa.table({"window_id": w, "pos": pos, "nll": nll[m]}), out / "losses-00000.parquet"
        )
        write_handmade_meta(out, "eval", name=m, architecture=m, fingerprint="f" * 64)
    return w, is_ar, np.stack([nll[m].astype(np.float64) for m in MODELS], axis=1)


def naive_bootstrap(w, is_ar, nll, n_windows, draws):
    """The textbook loop: per replicate, the tokens of the drawn windows, then the slice means."""
    starts = np.searchsorted(w, np.arange(n_windows))
    ends = np.searchsorted(w, np.arange(n_windows), side="right")
    out = []
    for row in draws:
        idx = np.concatenate([np.arange(starts[k], ends[k]) for k in row])
        x, ar = nll[idx], is_ar[idx]
        m_all, m_ar, m_other = x.mean(0), x[ar].mean(0), x[~ar].mean(0)
        d = x - x[:, :1]
        share = d[ar].sum(0) / np.where(d.sum(0) == 0, np.nan, d.sum(0))
        out.append((np.exp(m_all), np.exp(m_ar), np.exp(m_other), m_ar - m_ar[0], share))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--windows", type=int, default=2000)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--replicates", type=int, default=1000)
    args = ap.parse_args()
    if args.quick:
        args.windows, args.window, args.replicates = 200, 256, 200
    n_base = min(args.replicates, 20 if args.quick else 10)

    with tempfile.TemporaryDirectory(
        dir=ROOT / "bench-data" if (ROOT / "bench-data").is_dir() else None
    ) as tmp:
        root = Path(tmp) / "run"
        t = time.perf_counter()
        w, is_ar, nll = make_run(root, args.windows, args.window)
        n_tokens = len(w)
        print(
            f"synthetic run: {args.windows:,} windows x {args.window:,} tokens = {n_tokens:,} tokens, "
            f"{len(MODELS)} models ({time.perf_counter() - t:.1f} s to write)"
        )

        # -- 1. bootstrap -----------------------------------------------------------------------
        masks = [np.ones_like(is_ar), is_ar, ~is_ar]  # the slices all, ar, other
        sums = WindowSums(
            models=list(MODELS),
            window_ids=np.arange(args.windows),
            slices=("all", "ar", "other"),
            n=np.stack([np.bincount(w, weights=t, minlength=args.windows) for t in masks], 1),
            s=np.stack(
                [
                    np.stack(
                        [
                            np.bincount(w, weights=nll[:, j] * t, minlength=args.windows)
                            for j in range(3)
                        ],
                        1,
                    )
                    for t in masks
                ],
                1,
            ),
        )
        tracemalloc.start()
        t = time.perf_counter()
        reps = bootstrap(sums, 0, args.replicates, seed=0)
        ours = time.perf_counter() - t
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        draws = np.random.default_rng(0).integers(0, args.windows, size=(n_base, args.windows))
        if args.replicates <= (1 << 22) // args.windows:  # one chunk: the draws are the same
            tracemalloc.start()
            t = time.perf_counter()
            base = naive_bootstrap(w, is_ar, nll, args.windows, draws)
            theirs = time.perf_counter() - t
            _, base_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            for b in range(n_base):
                np.testing.assert_allclose(reps["ppl_ar"][b], base[b][1], rtol=1e-9)
                np.testing.assert_allclose(reps["ar_share"][b][1:], base[b][4][1:], rtol=1e-9)
            checked = "same numbers"
        else:
            t = time.perf_counter()
            naive_bootstrap(w, is_ar, nll, args.windows, draws)
            theirs = time.perf_counter() - t
            base_peak = float("nan")
            checked = "different draws (several chunks), not compared"
        per_ours, per_theirs = ours / args.replicates, theirs / n_base
        print("\nbootstrap of every statistic (all models, paired):")
        print(
            f"  window sums @ resample counts: {args.replicates} replicates in {ours:.2f} s "
            f"= {1e3 * per_ours:.2f} ms/replicate, peak {peak / 2**20:.0f} MiB"
        )
        print(
            f"  token-gather loop (baseline):  {n_base} replicates in {theirs:.2f} s "
            f"= {1e3 * per_theirs:.2f} ms/replicate, peak {base_peak / 2**20:.0f} MiB ({checked})"
        )
        print(f"  speed-up per replicate: {per_theirs / per_ours:.0f}x")

        # -- 2. slice query ----------------------------------------------------------------------
        import duckdb
        import polars as pl

        from ar_slicing.analysis.results import ensure_results

        t = time.perf_counter()
        checked, _ = ensure_results(root)
        build = time.perf_counter() - t
        con = duckdb.connect(str(checked.layout.results), read_only=True)
        sql = (ROOT / "queries" / "slice_perplexity.sql").read_text()
        t = time.perf_counter()
        rows = con.execute(sql).fetchall()
        q = time.perf_counter() - t
        con.close()

        t = time.perf_counter()
        tags = pl.read_parquet(
            root / "tags" / "tags-00000.parquet", columns=["window_id", "pos", "is_ar_hit"]
        )
        parts = [
            pl.read_parquet(root / "losses" / m / "losses-00000.parquet").with_columns(
                pl.lit(m).alias("model")
            )
            for m in MODELS
        ]
        joined = pl.concat(parts).join(tags, on=["window_id", "pos"])
        res = (
            joined.group_by("model")
            .agg(
                pl.len().alias("n"),
                pl.col("nll").cast(pl.Float64).mean().alias("all"),
                pl.col("nll").cast(pl.Float64).filter(pl.col("is_ar_hit")).mean().alias("ar"),
                pl.col("nll").cast(pl.Float64).filter(~pl.col("is_ar_hit")).mean().alias("other"),
            )
            .sort("model")
        )
        polars_s = time.perf_counter() - t
        for r, (m, _n, a, ar, other) in zip(rows, res.iter_rows()):
            assert (
                r[0] == m
                and abs(r[6] - a) < 1e-9
                and abs(r[8] - ar) < 1e-9
                and abs(r[10] - other) < 1e-9
            )
        print(f"\nslice_perplexity over {n_tokens * len(MODELS):,} (model, token) rows:")
        print(f"  results.duckdb (built in {build:.2f} s): {q:.2f} s")
        print(f"  polars read + join + group (baseline): {polars_s:.2f} s (same numbers)")
        print(f"  ratio baseline / ours: {polars_s / q:.2f}x")


if __name__ == "__main__":
    main()
