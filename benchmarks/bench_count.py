"""`arslice count` beside DuckDB and polars on the same uint16 token streams.

Streams (each written as a uint16 token store under bench-data/count/):
  zipf   tokens drawn independently from a Zipf law (p ~ 1/rank) over 50 304 ids: the hard,
         high-cardinality case (about a quarter of all pairs distinct at 200 M tokens)
  text   real text: the Python standard library's own sources, tokenized with a byte-level BPE
         (vocabulary 50 304) trained here, the token stream repeated up to the stream length
         (repetition keeps the distinct pairs of the real text; only counts grow)

Engines, each in its own subprocess so its peak memory is its own (sampled from /proc every
20 ms as the summed RSS of the process and its worker processes, until the engine has its
result; converting and checking the result afterwards is not counted):
  arslice   `count_stores` (map + reduce + bigrams.parquet), all cores
  duckdb    SELECT prev, next, count(*) FROM <arrow table of two uint16 columns> GROUP BY ALL
  polars    DataFrame(prev, next).group_by(prev, next).len()

The three results are checked equal (as sorted (prev, next, count) arrays). Then the memory
flatness check: arslice alone on a Zipf stream of 1 B tokens (--big-tokens), which must keep
about the peak of the 200 M run.

  .venv/bin/python benchmarks/bench_count.py            # 200 M tokens per stream, then 1 B
  .venv/bin/python benchmarks/bench_count.py --quick    # 5 M tokens, no 1 B run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench-data" / "count"
VOCAB = 50_304
FP = "bench" + "0" * 59


# ---- streams -------------------------------------------------------------------------------


def write_raw_store(path: Path, fill, n_tokens: int, name: str) -> Path:
    """A uint16 token store of `n_tokens` tokens written chunk by chunk by `fill(start, stop)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ar_slicing.data.store import docs_schema
    from ar_slicing.machinery.io import build_meta, is_complete, write_meta

    if is_complete(path):
        return path
    path.mkdir(parents=True, exist_ok=True)
    mm = np.memmap(path / "tokens.bin", dtype="<u2", mode="w+", shape=(n_tokens,))
    chunk = 1 << 24
    for a in range(0, n_tokens, chunk):
        b = min(n_tokens, a + chunk)
        mm[a:b] = fill(a, b)
    mm.flush()
    del mm
    docs = pa.table(
        {
            "doc_id": pa.array([0], pa.int64()),
            "offset": pa.array([0], pa.int64()),
            "n_tokens": pa.array([n_tokens], pa.int32()),
            "source": pa.array([name]),
            "subset": pa.array([None], pa.string()),
        },
        schema=docs_schema(),
    )
    pq.write_table(docs, path / "docs.parquet")
    info = {"name": name, "fingerprint": FP, "vocab_size": VOCAB, "eos_id": 0}
    meta = build_meta(
        "tokenize",
        config={},
        inputs={"source": name},
        counts={},
        wall_time_s=0.0,
        tokenizer=info,
        dtype="uint16",
        n_tokens=n_tokens,
        n_docs=1,
        eos_appended=False,
    )
    write_meta(path, meta)
    return path


def zipf_store(n_tokens: int) -> Path:
    cdf = np.cumsum(1.0 / np.arange(1, VOCAB + 1))
    cdf /= cdf[-1]

    def fill(a, b):
        rng = np.random.default_rng(a)  # seeded per chunk: the same stream on every run
        return np.minimum(np.searchsorted(cdf, rng.random(b - a)), VOCAB - 1).astype(np.uint16)

    return write_raw_store(DATA / f"zipf-{n_tokens}", fill, n_tokens, "zipf")


def text_store(n_tokens: int) -> Path:
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = DATA / f"text-{n_tokens}"
    if (path / "meta.json").exists():
        return path
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts[::3], trainer=trainer)  # a third of the files: faster, same kind
    eos = tok.token_to_id("<|endoftext|>")
    pieces = []
    for enc in tok.encode_batch(texts):
        pieces.append(np.asarray(enc.ids, dtype=np.uint16))
        pieces.append(np.array([eos], dtype=np.uint16))
    corpus = np.concatenate(pieces)
    how = "repeated to" if n_tokens > corpus.size else "the first"
    print(f"  text: {len(files)} stdlib files -> {corpus.size:,} tokens; {how} {n_tokens:,}")

    def fill(a, b):
        idx = np.arange(a, b, dtype=np.int64) % corpus.size
        return corpus[idx]

    return write_raw_store(path, fill, n_tokens, "stdlib-bpe")


# ---- engines (run in subprocesses) -------------------------------------------------------------


def counted(result: Path) -> None:
    """Tell the parent the counting is over: memory used after this (checking) is not sampled."""
    result.with_suffix(".done").touch()


def run_engine(engine: str, store: Path, result: Path, workers: int) -> None:
    """Body of one subprocess: count `store` with `engine`, save sorted (prev, next, count)."""
    tokens = np.memmap(store / "tokens.bin", dtype="<u2", mode="r")
    t0 = time.perf_counter()
    if engine == "arslice":
        import pyarrow.parquet as pq

        from pipeline.count import count_stores

        out = result.with_suffix(".counts")
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        count_stores([store], out, workers=workers, progress=False)
        wall = time.perf_counter() - t0
        counted(result)
        with open(out / "bigrams.parquet", "rb") as f:
            table = pq.read_table(f)
        prev, nxt, count = (table.column(c).to_numpy() for c in ("prev", "next", "count"))
    elif engine == "duckdb":
        import duckdb
        import pyarrow as pa

        tbl = pa.table({"prev": tokens[:-1], "next": tokens[1:]})  # zero-copy views  # noqa: F841
        con = duckdb.connect()
        con.execute(f"SET threads = {workers}")
        # `tbl` is found by DuckDB's replacement scan of Python variables
        arrow = con.sql(
            "SELECT prev, next, count(*) AS count FROM tbl GROUP BY ALL"
        ).to_arrow_table()
        wall = time.perf_counter() - t0
        counted(result)
        prev, nxt, count = (arrow.column(c).to_numpy() for c in ("prev", "next", "count"))
    elif engine == "polars":
        import polars as pl

        df = pl.DataFrame({"prev": tokens[:-1], "next": tokens[1:]})
        out = df.group_by(["prev", "next"]).len()
        wall = time.perf_counter() - t0
        counted(result)
        prev, nxt, count = (out[c].to_numpy() for c in ("prev", "next", "len"))
    else:
        raise SystemExit(f"unknown engine {engine}")
    key = (prev.astype(np.uint64) << np.uint64(16)) | nxt.astype(np.uint64)
    order = np.argsort(key)
    np.savez(result, key=key[order], count=count[order].astype(np.int64), wall=wall)


def measure(engine: str, store: Path, workers: int) -> dict:
    """Run one engine in a subprocess; its wall time and the peak of its process tree's RSS."""
    result = DATA / f"result-{engine}-{store.name}.npz"
    result.unlink(missing_ok=True)
    done = result.with_suffix(".done")
    done.unlink(missing_ok=True)
    env = dict(os.environ, POLARS_MAX_THREADS=str(workers))
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--store",
            str(store),
            "--result",
            str(result),
            "--workers",
            str(workers),
        ],
        env=env,
    )
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set() and not done.exists():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    stop.set()
    sampler.join()
    if rc != 0:
        raise SystemExit(f"{engine} failed on {store} (exit {rc})")
    with np.load(result) as z:
        out = {"key": z["key"], "count": z["count"], "wall": float(z["wall"])}
    result.unlink()
    done.unlink(missing_ok=True)
    out["peak_rss"] = peak[0]
    return out


def tree_rss(pid: int) -> int:
    """Summed resident memory (bytes) of `pid` and all its descendants."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


# ---- the comparison ----------------------------------------------------------------------------


def compare(name: str, store: Path, n_tokens: int, workers: int, engines: list[str]) -> dict:
    print(f"\n== {name}: {n_tokens:,} tokens ({store})")
    runs = {e: measure(e, store, workers) for e in engines}
    ref = runs[engines[0]]
    for e in engines[1:]:
        same = np.array_equal(runs[e]["key"], ref["key"]) and np.array_equal(
            runs[e]["count"], ref["count"]
        )
        if not same:
            raise SystemExit(f"{name}: {e} and {engines[0]} disagree")
    distinct = ref["key"].size
    assert int(ref["count"].sum()) == n_tokens - 1
    print(
        f"  distinct pairs: {distinct:,} ({distinct / (n_tokens - 1):.1%} of all pairs); "
        f"all {len(engines)} results equal"
    )
    rows = {}
    for e in engines:
        r = runs[e]
        rows[e] = {
            "tokens_per_s": n_tokens / r["wall"],
            "wall_s": r["wall"],
            "peak_rss_gib": r["peak_rss"] / 2**30,
        }
    base = rows.get("duckdb")
    for e, r in rows.items():
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:5.2f}x duckdb" if base else ""
        print(
            f"  {e:8s} {r['tokens_per_s'] / 1e6:7.1f} M tokens/s  {r['wall_s']:7.1f} s  "
            f"peak {r['peak_rss_gib']:5.2f} GiB  {ratio}"
        )
    return rows


def measure_lookups(counts_dir: Path, store: Path, n_queries: int) -> dict:
    """`BigramCounts.lookup` of the stream's own pairs vs numpy searchsorted on the sorted keys."""
    import pyarrow.parquet as pq

    from ar_slicing.algorithms.counts import BigramCounts

    tokens = np.memmap(store / "tokens.bin", dtype="<u2", mode="r")
    prev = np.asarray(tokens[:n_queries])
    nxt = np.asarray(tokens[1 : n_queries + 1])
    t0 = time.perf_counter()
    counts = BigramCounts.open(counts_dir)
    build = time.perf_counter() - t0
    counts.lookup(prev[:1000], nxt[:1000])
    t0 = time.perf_counter()
    ours = counts.lookup(prev, nxt)
    ours_s = time.perf_counter() - t0
    with open(counts_dir / "bigrams.parquet", "rb") as f:
        table = pq.read_table(f)
    keys = (table.column("prev").to_numpy().astype(np.uint32) << 16) | table.column(
        "next"
    ).to_numpy()
    values = table.column("count").to_numpy()
    t0 = time.perf_counter()
    q = (prev.astype(np.uint32) << 16) | nxt
    idx = np.minimum(np.searchsorted(keys, q), keys.size - 1)
    base = np.where(keys[idx] == q, values[idx], 0)
    base_s = time.perf_counter() - t0
    assert np.array_equal(ours, base) and (ours > 0).all()
    print(
        f"  lookup   {n_queries / ours_s / 1e6:7.1f} M lookups/s (table of {len(counts):,} built in "
        f"{build:.1f} s); numpy searchsorted {n_queries / base_s / 1e6:.1f} M/s "
        f"-> {base_s / ours_s:.1f}x"
    )
    return {"lookups_per_s": n_queries / ours_s, "searchsorted_per_s": n_queries / base_s}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="5 M tokens per stream, no 1 B run")
    ap.add_argument("--tokens", type=int, default=200_000_000, help="tokens per stream")
    ap.add_argument(
        "--big-tokens",
        type=int,
        default=1_000_000_000,
        help="Zipf stream for the memory-flatness check (0 = skip)",
    )
    ap.add_argument("--workers", type=int, default=0, help="cores for every engine (0 = all)")
    ap.add_argument("--engines", nargs="+", default=["arslice", "duckdb", "polars"])
    # subprocess mode
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ar_slicing.machinery.executor import default_workers

    workers = args.workers or default_workers()
    if args.engine:
        run_engine(args.engine, Path(args.store), Path(args.result), workers)
        return
    n = 5_000_000 if args.quick else args.tokens
    big = 0 if args.quick else args.big_tokens
    DATA.mkdir(parents=True, exist_ok=True)
    from ar_slicing.algorithms.counts.kernels import warm_kernels

    warm_kernels()  # numba compiles once into its on-disk cache; the timed runs load it
    print(
        f"bench_count: {workers} workers, streams of {n:,} tokens (load average {os.getloadavg()[0]:.1f})"
    )
    zipf = zipf_store(n)
    results = {"zipf": compare("zipf", zipf, n, workers, args.engines)}
    if "arslice" in args.engines:
        counts_dir = (DATA / f"result-arslice-{zipf.name}").with_suffix(".counts")
        results["lookup"] = measure_lookups(counts_dir, zipf, min(n - 1, 50_000_000))
    results["text"] = compare("text", text_store(n), n, workers, args.engines)
    if big:
        store = zipf_store(big)
        print(f"\n== memory flatness: arslice alone on a Zipf stream of {big:,} tokens")
        r = measure("arslice", store, workers)
        assert int(r["count"].sum()) == big - 1
        rows = {
            "tokens_per_s": big / r["wall"],
            "wall_s": r["wall"],
            "peak_rss_gib": r["peak_rss"] / 2**30,
        }
        small = results["zipf"]["arslice"]["peak_rss_gib"]
        print(
            f"  arslice  {rows['tokens_per_s'] / 1e6:7.1f} M tokens/s  {rows['wall_s']:7.1f} s  "
            f"peak {rows['peak_rss_gib']:5.2f} GiB (at {n:,} tokens: {small:.2f} GiB, "
            f"{rows['peak_rss_gib'] / small:.2f}x)"
        )
        results["zipf_big"] = {"arslice": rows}
    if "arslice" in args.engines and "duckdb" in args.engines:
        ratio = {
            s: results[s]["arslice"]["tokens_per_s"] / results[s]["duckdb"]["tokens_per_s"]
            for s in ("zipf", "text")
        }
        peaks = [results[s]["arslice"]["peak_rss_gib"] for s in results if "arslice" in results[s]]
        print(
            f"\ntargets: zipf {ratio['zipf']:.2f}x duckdb (>= 2), text {ratio['text']:.2f}x "
            f"(>= 1), peak {max(peaks):.2f} GiB (<= 6)"
            + (f", 1 B / {n:,} peak {rows['peak_rss_gib'] / small:.2f}x (flat)" if big else "")
        )
    (DATA / "last-run.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
