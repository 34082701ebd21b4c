"""Tag throughput: `arslice tag` against the straightforward DuckDB formulation, in the same run.

Data (generated once under bench-data/tag/, reused by later runs): a validation token store of
100 M tokens (4 M with --quick) and the exact bigram counts (`arslice count`'s own code) of a
training store of the same size. Tokens are Zipf-distributed over a GPT-2-sized vocabulary of
50 304 ids, with spans copied from earlier in the same document (as text quotes itself) so that
in-context repeats occur; documents have geometric lengths (mean 1 500 tokens) and Pile subsets.

Contenders, each in its own process (peak memory = the sampled proportional set size of that
process and its workers, so pages the workers share are counted once; sampled every 0.1 s or
more, so that sampling takes under 5% of a core):
  ours    `run_tag` (the whole stage: open the store and counts, tag on all cores, write the
          Parquet parts and meta.json)
  duckdb  one SQL statement: the targets (stream index, window_id, pos, token, prev; prepared
          beforehand as Parquet, not timed), `lag(pos) OVER (PARTITION BY window_id, prev, token
          ORDER BY pos)` for prev_pos, a LEFT JOIN with bigrams.parquet for train_count and an
          ASOF JOIN with docs.parquet for doc_id and subset, written sorted to Parquet
Both outputs are then compared column by column (the columns the formulation has: copy lengths
are beyond it).

Copy lengths: `match_len` comes out of the tag kernel's own pass, and the span counts of the
long copies are handed to it in order. `copy_length_cost` times the kernel alone, batch by
batch in one process, without them (`copy_lengths=False`: the kernel as it was before them) and
with them, alternating per batch so that both see the same load, and prints the ratio; and the
pass that finds the long copies, which the stage runs once before it counts their n-grams.
Ours runs `--repeats` times (default 3, each in a fresh process, so the first also loads or
compiles the numba kernels) and the fastest run is reported: the machine may be shared, and
one run takes seconds. DuckDB runs once.

    .venv/bin/python benchmarks/bench_tag.py [--quick] [--tokens N] [--workers N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ar_slicing.machinery.executor import default_workers  # noqa: E402

DATA = REPO / "bench-data" / "tag"
VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64, as the Pythia models use
EOS = 50256
WINDOW = 2048
SUBSETS = ["Pile-CC", "Github", "ArXiv", "PubMed Central", "Wikipedia (en)", None]
TARGET_TOKENS_PER_S = 20e6
TARGET_RATIO = 5.0


# ---- data ---------------------------------------------------------------------------------------


def synthetic_documents(n_tokens: int, seed: int) -> tuple[list[np.ndarray], list[str | None]]:
    """Documents totalling about `n_tokens` stream tokens (EOS included), and their subsets."""
    # the same ids are frequent in every store made here (training and validation alike)
    ids = np.random.default_rng(0).permutation(
        np.array([t for t in range(VOCAB) if t != EOS], np.uint16)
    )
    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < n_tokens:
        k = int(min(rng.geometric(1 / 1500), 20000))
        k = min(k, n_tokens - total - 1) if n_tokens - total > 1 else 0
        lengths.append(k)
        total += k + 1
    documents = []
    for k in lengths:
        doc = ids[(rng.zipf(1.2, size=k) - 1) % len(ids)]
        # quote earlier text: about one copied span (8-64 tokens, from up to 1500 back) per 150
        n_copies = rng.binomial(k, 1 / 150) if k > 64 else 0
        starts = rng.integers(16, k - 8, size=n_copies) if n_copies else []
        for start in starts:
            length = int(rng.integers(8, 65))
            back = int(rng.integers(length, 1500))
            src = start - back
            if src >= 0 and start + length <= k:
                doc[start : start + length] = doc[src : src + length].copy()
        documents.append(doc)
    subsets = [SUBSETS[i] for i in rng.integers(0, len(SUBSETS), size=len(documents))]
    return documents, subsets


def make_store(path: Path, n_tokens: int, seed: int):
    from ar_slicing.data.store import TokenStore, write_token_store
    from ar_slicing.machinery.io import is_complete

    if is_complete(path):
        return TokenStore.open(path)
    t0 = time.time()
    documents, subsets = synthetic_documents(n_tokens, seed)
    info = {"name": "synthetic-zipf", "fingerprint": "5" * 64, "vocab_size": VOCAB, "eos_id": EOS}
    store = write_token_store(
        path, documents, tokenizer_info=info, subsets=subsets, source="synthetic"
    )
    print(
        f"  made {path} ({store.n_tokens:,} tokens, {store.n_docs:,} docs) in {time.time() - t0:.1f}s"
    )
    return store


def prepare(n_tokens: int, workers: int) -> Path:
    """Validation store, training store, counts and the baseline's targets table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ar_slicing.machinery.io import atomic_path, is_complete
    from pipeline.count import count_stores

    root = DATA / f"v2-n{n_tokens}"
    val = make_store(root / "val", n_tokens, seed=1)
    make_store(root / "train", n_tokens, seed=2)
    if not is_complete(root / "counts"):
        t0 = time.time()
        count_stores([root / "train"], root / "counts", workers=workers, progress=False)
        print(f"  counted the training bigrams in {time.time() - t0:.1f}s")
    targets = root / "targets.parquet"
    if not targets.exists():
        tok = np.asarray(val.tokens)
        with atomic_path(targets) as tmp, pq.ParquetWriter(tmp, schema=targets_schema()) as writer:
            for a in range(1, val.n_tokens, 1 << 24):
                i = np.arange(a, min(a + (1 << 24), val.n_tokens), dtype=np.int64)
                writer.write_table(
                    pa.table(
                        {
                            "i": i,
                            "window_id": ((i - 1) // WINDOW).astype(np.int32),
                            "pos": ((i - 1) % WINDOW + 1).astype(np.int32),
                            "token": tok[i].astype(np.int32),
                            "prev": tok[i - 1].astype(np.int32),
                        },
                        schema=targets_schema(),
                    )
                )
    return root


def targets_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("i", pa.int64()),
            ("window_id", pa.int32()),
            ("pos", pa.int32()),
            ("token", pa.int32()),
            ("prev", pa.int32()),
        ]
    )


# ---- contenders (each run in a child process) --------------------------------------------------


def run_ours(root: Path, out: Path, workers: int) -> dict:
    from pipeline.tag import TagConfig, run_tag

    t0 = time.perf_counter()
    meta = run_tag(
        TagConfig(
            tokens=str(root / "val"),
            counts=str(root / "counts"),
            out=str(out),
            window=WINDOW,
            workers=workers,
            overwrite=True,
        )
    )
    return {"seconds": time.perf_counter() - t0, "rows": meta["counts"]["tokens"]}


DUCKDB_SQL = """
COPY (
    WITH tagged AS (
        SELECT t.window_id, t.pos, d.doc_id, t.token, t.prev,
               coalesce(c.count, 0) AS train_count,
               lag(t.pos) OVER (PARTITION BY t.window_id, t.prev, t.token ORDER BY t.pos) AS prev_pos,
               d.subset
        FROM read_parquet($targets) AS t
        ASOF JOIN read_parquet($docs) AS d ON t.i >= d."offset"
        LEFT JOIN read_parquet($bigrams) AS c ON c.prev = t.prev AND c.next = t.token
    )
    SELECT window_id, pos, doc_id, token, prev, train_count::BIGINT AS train_count,
           prev_pos::INTEGER AS prev_pos,
           prev_pos IS NOT NULL AS is_repeat,
           prev_pos IS NOT NULL AND train_count <= $threshold AS is_ar_hit,
           subset
    FROM tagged
    ORDER BY window_id, pos
) TO '{out}' (FORMAT parquet)
"""


def copy_length_cost(
    val: Path, counts_dir: Path, window: int = WINDOW, span_order: int = 4, max_tokens=None
) -> dict:
    """Seconds of the tag kernel over the store's batches without copy lengths (the kernel as it
    was before them) and with them as the stage tags: `match_len`, and the span counts of each
    batch's long copies handed to it in order. Both run in this process, a batch at a time, each
    batch several times each way (alternating which goes first) with its fastest time counted. The span counts here are the rows' numbers
    (their values change nothing of the work). Also timed, on their own: the stage's pass that
    finds the long copies and gathers their n-grams (`long_spans` and `NgramTable.add`, once per
    run, before the n-grams are counted in training). Times are this thread's CPU time, so that
    other processes on a shared machine count as little as they can."""
    from ar_slicing.algorithms.counts import BigramCounts
    from ar_slicing.algorithms.counts.ngrams import NgramTable
    from ar_slicing.algorithms.tags import DocTable, column_buffers, long_spans, tag_windows, warm
    from ar_slicing.algorithms.windows import stream_range
    from ar_slicing.data.store import TokenStore
    from pipeline.tag import BATCH_TOKENS

    warm()
    store = TokenStore.open(val)
    docs = DocTable.from_store(store)
    counts = BigramCounts.open(counts_dir)
    per = max(1, BATCH_TOKENS // window)
    n_windows = -(-(store.n_tokens - 1) // window)
    if max_tokens:
        n_windows = min(n_windows, max(1, max_tokens // window))
    buffers = column_buffers(per * window)
    batches = [
        (w, store.slice(*stream_range(w, min(w + per, n_windows), window, store.n_tokens)))
        for w in range(0, n_windows, per)
    ]
    args = dict(docs=docs, vocab_size=store.vocab_size)
    table = NgramTable.empty(span_order, 1 << 16)
    find_s = gather_s = 0.0
    span_counts = []
    for w, stream in batches:
        t = time.thread_time()
        ends, orders = long_spans(stream, w, window, **args, span_order=span_order, out=buffers)
        find_s += time.thread_time() - t
        t = time.thread_time()
        span_counts.append(table.add(stream, ends, orders))
        gather_s += time.thread_time() - t

    def run(k, copies):
        w, stream = batches[k]
        t = time.thread_time()
        tag_windows(
            stream,
            w,
            window,
            **args,
            lookup=counts,
            threshold=1250,
            out=buffers,
            copy_lengths=copies,
            span_order=span_order if copies else 1,
            span_counts=span_counts[k] if copies else None,
        )
        return time.thread_time() - t

    run(0, True), run(0, False)  # compiled code loaded, caches warm
    # Each batch is tagged `rounds` times each way, alternating which goes first, and its
    # fastest time each way counts: a moment of another process's work (or of the page cache
    # filling) slows one run of a batch, not the figure. A small store gets more rounds.
    rounds = max(3, -(-30_000_000 // max(1, n_windows * window)))
    seconds = {True: 0.0, False: 0.0}
    for k in range(len(batches)):
        best = {True: float("inf"), False: float("inf")}
        for r in range(rounds):
            for copies in (True, False) if (k + r) % 2 else (False, True):
                best[copies] = min(best[copies], run(k, copies))
        seconds[True] += best[True]
        seconds[False] += best[False]
    return {
        "tokens": sum(len(s) - 1 for _, s in batches),
        "rounds": rounds,
        "with_s": seconds[True],
        "without_s": seconds[False],
        "store_tokens": sum(len(s) - 1 for _, s in batches),
        "find_s": find_s,
        "gather_s": gather_s,
        "long_copies": sum(len(c) for c in span_counts),
        "span_ngrams": table.n_rows,
    }


def print_copy_length_cost(r: dict) -> None:
    rate_with, rate_without = r["tokens"] / r["with_s"], r["tokens"] / r["without_s"]
    print(
        f"  tag kernel, one core, {r['tokens']:,} tokens (fastest of {r['rounds']} per batch): "
        f"without copy lengths "
        f"{rate_without / 1e6:.2f} M tokens/s, with copy lengths and span counts "
        f"{rate_with / 1e6:.2f} M tokens/s: ratio {rate_with / rate_without:.3f} "
        f"(target >= 0.90; load average {os.getloadavg()[0]:.2f})"
    )
    n = r["store_tokens"]
    print(
        f"  {'':<11} the pass before counting: finding the {r['long_copies']:,} long copies "
        f"{n / r['find_s'] / 1e6:.2f} M tokens/s, gathering their {r['span_ngrams']:,} span "
        f"n-grams {n / r['gather_s'] / 1e6:.2f} M tokens/s"
    )


def run_duckdb(root: Path, out: Path, workers: int, memory: str) -> dict:
    import duckdb

    out.mkdir(parents=True, exist_ok=True)
    path = out / "tags.parquet"
    t0 = time.perf_counter()
    con = duckdb.connect(
        config={
            "threads": int(workers),
            "memory_limit": memory,
            "temp_directory": str(out / "spill"),
        }
    )
    # COPY's target is not a bindable parameter; the path is ours, made above
    con.execute(
        DUCKDB_SQL.replace("{out}", str(path).replace("'", "''")),
        {
            "targets": str(root / "targets.parquet"),
            "docs": str(root / "val" / "docs.parquet"),
            "bigrams": str(root / "counts" / "bigrams.parquet"),
            "threshold": 1250,
        },
    )
    rows = con.execute("SELECT count(*) FROM read_parquet($p)", {"p": str(path)}).fetchone()[0]
    seconds = time.perf_counter() - t0
    con.close()
    shutil.rmtree(out / "spill", ignore_errors=True)
    return {"seconds": seconds, "rows": rows}


# ---- measuring ----------------------------------------------------------------------------------


def tree_pss(pid: int) -> int:
    """Proportional set size of `pid` and all its descendants (from /proc): memory shared by
    forked workers (the counts table, the memory-mapped store) is counted once, not per worker."""
    return tree_memory(pid)[0]


def tree_memory(pid: int) -> tuple[int, int]:
    """(PSS, its anonymous part) of `pid` and all its descendants: the anonymous part leaves out
    the pages of mapped files (a memory-mapped store), which the kernel can drop and read again."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total = {"Pss": 0, "Pss_Anon": 0}
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in total:
                        total[key] += int(line.split()[1]) * 1024
        except OSError:
            pass
        stack += children.get(p, [])
    return total["Pss"], total["Pss_Anon"]


def measured(args: list[str]) -> dict:
    """Run this script as a child with `args`; its JSON result plus the sampled peak RSS."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while True:
            t = time.perf_counter()
            peak = max(peak, tree_pss(proc.pid))
            # reading smaps_rollup walks page tables, tens of ms for a process of a few GB: the
            # pause keeps the sampler under 5% of a core, which it takes from the contender
            if stop.wait(max(0.1, 20 * (time.perf_counter() - t))):
                break

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # usage includes the child's reaped workers
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed with status {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_pss"] = peak
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


def compare(ours: Path, duck: Path) -> tuple[bool, str]:
    """Column-by-column equality of our parts and DuckDB's file (both sorted by window_id, pos)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ar_slicing.algorithms.tags import TAG_COLUMNS

    parts = sorted(ours.glob("tags-*.parquet"))
    for name in TAG_COLUMNS[:10]:  # the formulation's columns (copy lengths are ours alone)
        a = pa.concat_tables([pq.read_table(p, columns=[name]) for p in parts]).column(name)
        b = pq.read_table(duck / "tags.parquet", columns=[name]).column(name)
        if a.type != b.type:
            b = b.cast(a.type)
        if len(a) != len(b):
            return False, f"{len(a):,} rows against {len(b):,}"
        if not a.equals(b):
            return False, f"column {name} differs"
        del a, b
    return True, "10 columns equal"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 M tokens instead of 100 M")
    parser.add_argument(
        "--tokens", type=int, default=None, help="validation tokens (default 100 M)"
    )
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="cores for both contenders"
    )
    parser.add_argument(
        "--duckdb-memory", default="8GB", help="DuckDB memory_limit (it spills beyond)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of ours; the fastest is reported"
    )
    parser.add_argument("--child", choices=["ours", "duckdb"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        root = Path(args.root)
        if args.child == "ours":
            result = run_ours(root, root / "out-ours", args.workers)
        else:
            result = run_duckdb(root, root / "out-duckdb", args.workers, args.duckdb_memory)
        print(json.dumps(result))
        return

    n_tokens = args.tokens or (4_000_000 if args.quick else 100_000_000)
    print(f"bench_tag: {n_tokens:,} validation tokens, window {WINDOW}, {args.workers} workers")
    root = prepare(n_tokens, args.workers)
    child = [
        "--root",
        str(root),
        "--workers",
        str(args.workers),
        "--duckdb-memory",
        args.duckdb_memory,
    ]
    ours = min(
        (measured(["--child", "ours", *child]) for _ in range(max(1, args.repeats))),
        key=lambda r: r["seconds"],
    )
    duck = measured(["--child", "duckdb", *child])
    equal, detail = compare(root / "out-ours", root / "out-duckdb")

    meta = json.loads((root / "out-ours" / "meta.json").read_text())
    c = meta["counts"]
    print(
        f"  data: {c['repeats'] / c['tokens']:.1%} repeats, {c['ar_hits'] / c['tokens']:.1%} AR hits "
        f"(threshold 1250), {meta['inputs']['counts'].get('distinct_bigrams', 0):,} distinct training bigrams"
    )
    rows = []
    best_of = f"ours, best of {max(1, args.repeats)}"
    for name, r in ((best_of, ours), ("duckdb formulation", duck)):
        rate = r["rows"] / r["seconds"]
        rows.append(rate)
        print(
            f"  {name:<20} {r['rows']:>13,} tokens  {r['seconds']:7.2f} s  {rate / 1e6:7.2f} M tokens/s  "
            f"CPU {r['cpu_s']:7.1f} s ({r['cpu_s'] / r['rows'] * 1e9:5.0f} ns/token)  "
            f"peak memory (PSS) {r['peak_pss'] / 2**30:5.2f} GiB"
        )
    ratio = rows[0] / rows[1]
    print(
        f"  ratio ours/duckdb: {ratio:.2f}x   results equal: {'yes' if equal else 'NO'} ({detail})"
    )
    print(
        f"  targets: >= {TARGET_TOKENS_PER_S / 1e6:.0f} M tokens/s ({'met' if rows[0] >= TARGET_TOKENS_PER_S else 'not met'}), "
        f">= {TARGET_RATIO:.0f}x duckdb ({'met' if ratio >= TARGET_RATIO else 'not met'})"
    )
    print_copy_length_cost(copy_length_cost(root / "val", root / "counts"))
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
