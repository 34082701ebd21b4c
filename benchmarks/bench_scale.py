"""The Pile on one node, scaled down: a Pile-shaped corpus through import, count and tag.

Data (generated once under bench-data/scale/, reused by later runs): a synthetic corpus shaped
like the Pile. Token ids follow a Zipf law (p ~ 1/rank) over GPT-2's padded 50 304 ids;
documents have geometric lengths (mean 1 500 tokens, as the Pile's ~6 KiB documents), each
followed by EOS, and belong to one of the Pile's 22 subsets (by their share of the Pile); about
one position in 150 starts a span of 8-64 tokens copied from up to 1 500 tokens earlier in the
same document, as text quotes itself, so in-context repeats occur. By default 2 B training
tokens (written as a raw uint16 file) and 100 M validation tokens (a store with subsets).

Stages, each in its own process, as the pipeline runs them:
  tokenize-import   `arslice tokenize --source-format raw-uint16` of the training file
  full count        `count_stores` of the training store (and of its first 10%, for the
                    memory-flatness check)
  restricted count  `count_stores --only-bigrams-of` the validation store
  tag               `run_tag` of the validation store with the restricted counts (span order 4:
                    its first pass finds the long copies and gathers their span n-grams, which
                    are counted over the 2 B training tokens, then the parts are written)
  tag, bigrams only the same with span order 1 (no span n-grams: the stage without span counts)
  span n-gram count the tag stage's first pass and its count of the span n-grams in training
                    alone, for their time and memory beside the restricted bigram count's
  tag kernel        the tag kernel alone on one core, with and without copy lengths, batch by
                    batch in turn (`bench_tag.copy_length_cost`): their throughput ratio
Each prints wall time, tokens/s, peak memory (the proportional set size of the stage's process
and its workers, sampled; pages the workers share count once) and peak temporary disk (the
most bytes the stage had under its output directory beyond what it leaves there), then the
same figures per token, scaled to the Pile (300 B training / 383 M validation tokens) on a
16-core node, each with its formula.

    .venv/bin/python benchmarks/bench_scale.py            # 2 B + 100 M tokens (about 4 GB + 8 GB disk)
    .venv/bin/python benchmarks/bench_scale.py --quick    # 60 M + 6 M tokens
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

DATA = REPO / "bench-data" / "scale"
VOCAB = 50304
EOS = 50256
WINDOW = 2048
PILE_TRAIN, PILE_VAL, NODE_CORES = 300e9, 383e6, 16
# The Pile's 22 subsets and their share of its tokens (Gao et al. 2020, Table 1, "Weight").
SUBSETS = {
    "Pile-CC": 18.11,
    "PubMed Central": 14.40,
    "Books3": 12.07,
    "OpenWebText2": 10.01,
    "ArXiv": 8.96,
    "Github": 7.59,
    "FreeLaw": 6.12,
    "StackExchange": 5.13,
    "USPTO Backgrounds": 3.65,
    "PubMed Abstracts": 3.07,
    "Gutenberg (PG-19)": 2.17,
    "OpenSubtitles": 1.55,
    "Wikipedia (en)": 1.53,
    "DM Mathematics": 1.24,
    "Ubuntu IRC": 0.88,
    "BookCorpus2": 0.75,
    "EuroParl": 0.73,
    "HackerNews": 0.62,
    "YoutubeSubtitles": 0.60,
    "PhilPapers": 0.38,
    "NIH ExPorter": 0.30,
    "Enron Emails": 0.14,
}
TARGETS = {"count_only_peak_gib": 1.5, "count_only_disk_gb": 2.0, "tag_tokens_per_s": 20e6}


# ---- the corpus -----------------------------------------------------------------------------------


def _generate(out, doc_ends, cdf, guide, ids, seed, mean_doc, copy_rate):
    """Fill `out` with whole documents (the last one cut to fit), each followed by EOS; record
    where each document's EOS ends in `doc_ends`. Returns the number of documents. A rank is
    drawn by inverting `cdf`, starting from the guide table's entry for the uniform draw."""
    np.random.seed(seed)
    n = out.size
    i = 0
    d = 0
    while i < n:
        length = min(np.random.geometric(1.0 / mean_doc), n - i - 1)
        start = i
        end = i + length
        while i < end:
            if i - start >= 16 and np.random.random() < copy_rate:
                span = np.random.randint(8, 65)
                back = np.random.randint(span, 1501)
                if i - back >= start:
                    stop = min(i + span, end)
                    while i < stop:
                        out[i] = out[i - back]
                        i += 1
                    continue
            u = np.random.random()
            r = guide[np.int64(u * guide.size)]
            while cdf[r] <= u:
                r += 1
            out[i] = ids[r]
            i += 1
        out[i] = ids.size  # placeholder for EOS, set by the caller
        i += 1
        doc_ends[d] = i
        d += 1
    return d


def corpus(path: Path, n_tokens: int, seed: int) -> tuple[Path, np.ndarray]:
    """A raw uint16 token file of `n_tokens` tokens and the stream offset where each document
    ends (EOS included), made once and reused."""
    import numba

    ends_path = path.with_suffix(".ends.npy")
    if path.is_file() and ends_path.is_file():
        return path, np.load(ends_path)
    gen = numba.njit(cache=True)(_generate)
    cdf = np.cumsum(1.0 / np.arange(1, VOCAB + 1))[:-1]  # VOCAB - 1 ranks: EOS is not drawn
    cdf /= cdf[-1]
    cdf[-1] = 2.0  # every draw u < 1 stops at the last rank at the latest
    # guide[j] = first rank whose cdf exceeds j / len(guide): a draw scans from there
    guide = np.searchsorted(cdf, np.arange(1 << 20) / (1 << 20), side="right")
    ids = np.random.default_rng(0).permutation(np.array([t for t in range(VOCAB) if t != EOS]))
    ids = ids.astype(np.uint16)
    chunk = 1 << 24
    mm = np.memmap(path.with_suffix(".tmp"), dtype="<u2", mode="w+", shape=(n_tokens,))
    ends = []
    t0 = time.time()
    for k, a in enumerate(range(0, n_tokens, chunk)):
        buf = np.empty(min(chunk, n_tokens - a), np.uint16)
        doc_ends = np.empty(buf.size, np.int64)
        n_docs = gen(buf, doc_ends, cdf, guide, ids, seed * 100_003 + k, 1500.0, 1 / 150)
        buf[doc_ends[:n_docs] - 1] = EOS
        mm[a : a + buf.size] = buf
        ends.append(doc_ends[:n_docs] + a)
    mm.flush()
    del mm
    os.replace(path.with_suffix(".tmp"), path)
    ends = np.concatenate(ends)
    np.save(ends_path, ends)
    print(
        f"  made {path.name}: {n_tokens:,} tokens, {ends.size:,} documents ({time.time() - t0:.0f} s)"
    )
    return path, ends


def write_val_store(out: Path, raw: Path, ends: np.ndarray, tokenizer_info: dict) -> None:
    """The validation store: the raw tokens, with a document table whose subsets follow the Pile."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ar_slicing.data.store import docs_schema
    from ar_slicing.machinery.io import build_meta, is_complete, write_meta

    if is_complete(out):
        return
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(raw, out / "tokens.bin")
    offsets = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    names = list(SUBSETS)
    weights = np.array(list(SUBSETS.values()))
    rng = np.random.default_rng(3)
    subsets = np.array(names, dtype=object)[
        rng.choice(len(names), ends.size, p=weights / weights.sum())
    ]
    table = pa.table(
        {
            "doc_id": pa.array(np.arange(ends.size, dtype=np.int64)),
            "offset": pa.array(offsets),
            "n_tokens": pa.array((ends - offsets - 1).astype(np.int32)),
            "source": pa.array(["synthetic"] * ends.size, pa.string()),
            "subset": pa.array(list(subsets), pa.string()),
        },
        schema=docs_schema(),
    )
    pq.write_table(table, out / "docs.parquet")
    n = int(ends[-1])
    meta = build_meta(
        "tokenize",
        config={},
        inputs={"source": str(raw)},
        counts={"documents": int(ends.size), "tokens": n},
        wall_time_s=0.0,
        tokenizer=tokenizer_info,
        dtype="uint16",
        n_tokens=n,
        n_docs=int(ends.size),
        eos_appended=True,
    )
    write_meta(out, meta)


# ---- the stages (each run in a child process) -------------------------------------------------------


def run_stage(stage: str, root: Path, workers: int) -> dict:
    t0 = time.perf_counter()
    if stage in ("import", "import-small"):
        from pipeline.tokenize import TokenizeConfig, run_tokenize

        name = "train" if stage == "import" else "train-small"
        cfg = TokenizeConfig(
            source=[str(root / f"{name}.u16")],
            out=str(root / name),
            source_format="raw-uint16",
            vocab_size=VOCAB,
            eos_id=EOS,
            workers=workers,
        )
        run_tokenize(cfg)
        tokens = json.loads((root / name / "meta.json").read_text())["n_tokens"]
    elif stage.startswith("count"):
        from pipeline.count import count_stores

        store = root / ("train-small" if stage == "count-small" else "train")
        only = [root / "val"] if stage == "count-only" else None
        meta = count_stores(
            [store], root / stage, workers=workers, only_bigrams_of=only, progress=False
        )
        tokens = meta["counts"]["tokens"]
        extra = {
            k: meta.get(k)
            for k in ("distinct_bigrams", "evaluated_bigrams", "evaluated_bigrams_unseen")
        }
        return {"seconds": time.perf_counter() - t0, "tokens": tokens, **extra}
    elif stage in ("tag", "tag-bigrams"):
        from pipeline.tag import TagConfig, run_tag

        meta = run_tag(
            TagConfig(
                tokens=str(root / "val"),
                counts=str(root / "count-only"),
                out=str(stage_out(root, stage)),
                window=WINDOW,
                workers=workers,
                span_order=4 if stage == "tag" else 1,
            )
        )
        tokens = meta["counts"]["tokens"]
        c = meta["counts"]
        return {
            "seconds": time.perf_counter() - t0,
            "tokens": tokens,
            "repeats": c["repeats"] / tokens,
            "ar_hits": c["ar_hits"] / tokens,
            "tagging_tokens_per_s": meta["throughput"]["tokens_per_s"],
            "span_counts": meta["span_counts"],
            "span_collect_s": meta["throughput"].get("span_collect_s", 0.0),
            "span_count_s": meta["throughput"].get("span_count_s", 0.0),
        }
    elif stage == "span-count":
        result = span_count_only(root, workers)
        return {"seconds": time.perf_counter() - t0, **result}
    elif stage == "tag-kernel":
        from bench_tag import copy_length_cost

        r = copy_length_cost(root / "val", root / "count-only")
        return {"seconds": time.perf_counter() - t0, **r}
    else:
        raise SystemExit(f"unknown stage {stage}")
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def stage_out(root: Path, stage: str) -> Path:
    """Where a stage writes (the disk it takes is measured there)."""
    return root / ("tags" if stage == "tag" else stage)


def span_count_only(root: Path, workers: int) -> dict:
    """The tag stage's span n-gram steps alone, as `run_tag` takes them: find the long copies of
    every part and gather their n-grams, then count those over the training stores."""
    from ar_slicing.algorithms.tags import warm
    from ar_slicing.algorithms.windows import n_windows
    from ar_slicing.data.store import TokenStore
    from ar_slicing.machinery.io import read_json
    from pipeline.tag import (
        TagConfig,
        _count_span_ngrams,
        _opened,
        part_tasks,
        span_training_stores,
    )

    cfg = TagConfig(
        tokens=str(root / "val"),
        counts=str(root / "count-only"),
        out=str(stage_out(root, "span-count")),
        window=WINDOW,
        workers=workers,
    )
    store = TokenStore.open(cfg.tokens)
    _opened("docs", cfg.tokens)  # as the stage does: its workers inherit the document table
    parts = part_tasks(cfg, n_windows(store.n_tokens, WINDOW), cfg.tokens, cfg.counts, cfg.out)
    training = span_training_stores(read_json(root / "count-only" / "meta.json"), cfg.counts, 4)
    warm()
    spans, seconds = _count_span_ngrams(cfg, parts, training, min(workers, len(parts)))
    grams = sum(v["ngrams"] for v in spans["by_order"].values())
    return {"tokens": store.n_tokens - 1, "span_ngrams": grams, **seconds}


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def measured(stage: str, root: Path, workers: int, out: Path) -> dict:
    """Run one stage in a child process; its result, sampled peak PSS and peak disk of `out`."""
    from bench_tag import tree_memory

    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            stage,
            "--root",
            str(root),
            "--workers",
            str(workers),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    peak = {"pss": 0, "anon": 0, "disk": 0}
    stop = threading.Event()

    def sample():
        while True:
            t = time.perf_counter()
            pss, anon = tree_memory(proc.pid)
            peak["pss"], peak["anon"] = max(peak["pss"], pss), max(peak["anon"], anon)
            peak["disk"] = max(peak["disk"], dir_bytes(out))
            # smaps_rollup walks page tables: the pause keeps the sampler under ~5% of a core
            if stop.wait(max(0.1, 20 * (time.perf_counter() - t))):
                break

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    stop.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"stage {stage} failed")
    result = json.loads(text.strip().splitlines()[-1])
    final = dir_bytes(out)
    result.update(
        peak_pss=peak["pss"],
        peak_anon=peak["anon"],
        final_bytes=final,
        temp_bytes=max(peak["disk"], final) - final,
        cpu_s=usage.ru_utime + usage.ru_stime,
    )
    return result


# ---- the report -----------------------------------------------------------------------------------


def report(name: str, r: dict, workers: int, pile_tokens: float, memory_law: str, disk_law: str):
    rate = r["tokens"] / r["seconds"]
    print(
        f"  {name:<17} {r['tokens']:>14,} tokens  {r['seconds']:7.1f} s  {rate / 1e6:7.1f} M tokens/s  "
        f"CPU {r['cpu_s'] / r['tokens'] * 1e9:5.1f} ns/token  peak PSS {r['peak_pss'] / 2**30:5.2f} GiB  "
        f"peak temp disk {r['temp_bytes'] / 1e9:6.2f} GB  output {r['final_bytes'] / 1e9:6.2f} GB"
    )
    minutes = r["seconds"] / r["tokens"] * pile_tokens * workers / NODE_CORES / 60
    print(
        f"  {'':<17} Pile: {r['seconds'] / r['tokens'] * 1e9:.2f} ns/token x {pile_tokens:.3g} tokens "
        f"x {workers}/{NODE_CORES} cores = {minutes:.1f} min; memory {memory_law}; disk {disk_law}"
    )


def print_copy_spans(results: dict, training_tokens: int) -> None:
    """The cost of the span counts, each beside its baseline in the same run: the whole tag
    stage with and without them (span order 4 and 1), and the span n-gram count (the stage's
    first pass and its count in training) against the restricted bigram count."""
    tag, bigrams = results["tag"], results["tag-bigrams"]
    spans, only = results["span-count"], results["count-only"]
    load = f"load average {os.getloadavg()[0]:.2f}"
    grams = sum(v["ngrams"] for v in tag["span_counts"]["by_order"].values())
    span_s = tag["span_collect_s"] + tag["span_count_s"]
    rate, rate_bigrams = tag["tokens"] / tag["seconds"], bigrams["tokens"] / bigrams["seconds"]
    rest = tag["tokens"] / (tag["seconds"] - span_s)
    print(
        f"\n  copy spans: {grams:,} distinct span n-grams (orders 3..5), found by the first pass "
        f"in {tag['span_collect_s']:.1f} s and counted over the {training_tokens:,} training "
        f"tokens in {tag['span_count_s']:.1f} s"
    )
    print(
        f"  tag stage with span counts {tag['seconds']:.1f} s ({rate / 1e6:.1f} M tokens/s), "
        f"without (span order 1) {bigrams['seconds']:.1f} s ({rate_bigrams / 1e6:.1f} M tokens/s): "
        f"ratio {rate / rate_bigrams:.3f}; leaving out the span n-gram steps ({span_s:.1f} s), "
        f"{rest / 1e6:.1f} M tokens/s: ratio {rest / rate_bigrams:.3f} (target >= 0.90); tagging "
        f"itself {tag['tagging_tokens_per_s'] / 1e6:.1f} vs {bigrams['tagging_tokens_per_s'] / 1e6:.1f}"
        f" M tokens/s: ratio {tag['tagging_tokens_per_s'] / bigrams['tagging_tokens_per_s']:.3f} "
        f"({load}); CPU {tag['cpu_s']:.1f} s vs {bigrams['cpu_s']:.1f} s: ratio "
        f"{bigrams['cpu_s'] / tag['cpu_s']:.3f}"
    )
    print(
        f"  span n-gram count: in the tag stage {span_s:.1f} s against {only['seconds']:.1f} s for "
        f"the restricted bigram count (ratio {span_s / only['seconds']:.2f}); alone, in a "
        f"process of its own as the restricted count runs, {spans['seconds']:.1f} s (CPU "
        f"{spans['cpu_s']:.1f} s), peak PSS {spans['peak_pss'] / 2**30:.2f} GiB (anonymous "
        f"{spans['peak_anon'] / 2**30:.2f}), against {only['seconds']:.1f} s (CPU "
        f"{only['cpu_s']:.1f} s), peak PSS {only['peak_pss'] / 2**30:.2f} GiB (anonymous "
        f"{only['peak_anon'] / 2**30:.2f}): time ratio {spans['seconds'] / only['seconds']:.2f} "
        f"(CPU {spans['cpu_s'] / only['cpu_s']:.2f}), memory ratio "
        f"{spans['peak_pss'] / only['peak_pss']:.2f} ({load}); {grams:,} span n-grams, "
        f"{spans['peak_anon'] / max(grams, 1):.0f} anonymous bytes each"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="60 M + 6 M tokens")
    parser.add_argument("--train-tokens", type=int, default=2_000_000_000)
    parser.add_argument("--val-tokens", type=int, default=100_000_000)
    parser.add_argument("--workers", type=int, default=0, help="cores (0 = all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from ar_slicing.machinery.executor import default_workers

    workers = args.workers or default_workers()
    if args.child:
        print(json.dumps(run_stage(args.child, Path(args.root), workers)))
        return
    n_train, n_val = (60_000_000, 6_000_000) if args.quick else (args.train_tokens, args.val_tokens)
    root = DATA / f"n{n_train}-v{n_val}"
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"bench_scale: {n_train:,} training + {n_val:,} validation tokens, {workers} workers, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    corpus(root / "train.u16", n_train, seed=1)
    _, val_ends = corpus(root / "val.u16", n_val, seed=2)
    small = root / "train-small.u16"
    if not small.is_file():  # the first 10% of the training tokens, for the flatness check
        with open(root / "train.u16", "rb") as src, open(small.with_suffix(".tmp"), "wb") as dst:
            dst.write(src.read(2 * (n_train // 10)))
        os.replace(small.with_suffix(".tmp"), small)

    from ar_slicing.algorithms.counts.kernels import warm_kernels
    from ar_slicing.algorithms.tags import warm

    warm_kernels()  # numba compiles once into its on-disk cache; the measured stages load it
    warm()
    results = {"import": measured("import", root, workers, root / "train")}
    info = json.loads((root / "train" / "meta.json").read_text())["tokenizer"]
    write_val_store(root / "val", root / "val.u16", val_ends, info)
    results["import-small"] = measured("import-small", root, workers, root / "train-small")
    stages = (
        "count-small",
        "count",
        "count-only",
        "span-count",
        "tag-bigrams",
        "tag",
        "tag-kernel",
    )
    for stage in stages:
        results[stage] = measured(stage, root, workers, stage_out(root, stage))
    print(f"  (load average after: {os.getloadavg()[0]:.2f})")

    only, tag, full, small_r = (
        results["count-only"],
        results["tag"],
        results["count"],
        results["count-small"],
    )
    print(
        f"\n  data: {only['evaluated_bigrams']:,} distinct validation bigrams "
        f"({only['evaluated_bigrams_unseen']:,} never in training), {full['distinct_bigrams']:,} "
        f"distinct training bigrams; {tag['repeats']:.1%} repeats, {tag['ar_hits']:.1%} AR hits"
    )
    # Distinct bigrams grow more slowly than tokens, so scaling them by the token ratio is an
    # upper bound for the Pile's validation set.
    v_pile = only["evaluated_bigrams"] * PILE_VAL / n_val
    rows_pile = only["distinct_bigrams"] * PILE_VAL / n_val
    report(
        "tokenize-import",
        results["import"],
        workers,
        PILE_TRAIN,
        "flat (16 M tokens at a time)",
        f"no temporary files; the store is 2 B/token = {2 * PILE_TRAIN / 1e12:.1f} TB",
    )
    report(
        "full count",
        full,
        workers,
        PILE_TRAIN,
        f"flat per worker: {full['peak_pss'] / workers / 2**30:.2f} GiB x {NODE_CORES} = "
        f"{full['peak_pss'] / workers * NODE_CORES / 2**30:.1f} GiB",
        f"temp {full['temp_bytes'] / full['tokens']:.2f} B/token x {PILE_TRAIN:.3g} = "
        f"{full['temp_bytes'] / full['tokens'] * PILE_TRAIN / 1e9:.0f} GB",
    )
    report(
        "restricted count",
        only,
        workers,
        PILE_TRAIN,
        f"~(6 B x V per worker + 4 B x V shared + 0.3 GiB per worker), V = distinct validation "
        f"bigrams <= {v_pile / 1e6:.0f} M: <= {(6 * NODE_CORES + 4) * v_pile / 2**30 + 0.3 * NODE_CORES:.1f} GiB",
        f"temp 4 B x V per worker + 4 B x V (the key set) = "
        f"{4 * v_pile * (NODE_CORES + 1) / 1e9:.1f} GB",
    )
    report(
        "tag",
        tag,
        workers,
        PILE_VAL,
        f"16 B x counted rows (<= {rows_pile / 1e6:.0f} M) shared + ~0.2 GiB per worker: <= "
        f"{(16 * rows_pile) / 2**30 + 0.2 * NODE_CORES:.1f} GiB",
        f"output {tag['final_bytes'] / tag['tokens']:.1f} B/token x {PILE_VAL:.3g} = "
        f"{tag['final_bytes'] / tag['tokens'] * PILE_VAL / 1e9:.1f} GB",
    )
    print_copy_spans(results, full["tokens"])
    from bench_tag import print_copy_length_cost

    print_copy_length_cost(results["tag-kernel"])
    flat = full["peak_pss"] / small_r["peak_pss"]
    print(
        f"\n  targets: restricted count peak {only['peak_pss'] / 2**30:.2f} GiB (<= 1.5), temp disk "
        f"{only['temp_bytes'] / 1e9:.2f} GB (<= 2); tag {tag['tokens'] / tag['seconds'] / 1e6:.1f} M "
        f"tokens/s (>= 20), peak {tag['peak_pss'] / 2**30:.2f} GiB (<= 1.5); full count peak "
        f"{small_r['peak_pss'] / 2**30:.2f} GiB at {small_r['tokens']:,} tokens, "
        f"{full['peak_pss'] / 2**30:.2f} GiB at {full['tokens']:,} ({flat:.2f}x, flat within 10%: "
        f"{'yes' if abs(flat - 1) <= 0.1 else 'no'}); restricted count "
        f"{only['tokens'] / only['seconds'] / 1e6:.1f} M tokens/s vs full "
        f"{full['tokens'] / full['seconds'] / 1e6:.1f}"
    )
    (root / "last-run.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
