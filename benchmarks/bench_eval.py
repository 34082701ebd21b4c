"""`arslice eval`'s core against a naive per-window loop, on CPU, in the same run.

Both score the same 2048-token windows of real text (Python standard-library sources, tokenized by
a byte-level BPE trained here) with the same ~10 M-parameter GPT-NeoX (random weights from a
Pythia-like config, saved to a temporary directory and loaded with `hf:<dir>`):

  * eval   `pipeline.eval.run_eval` end to end: loading, batched forward passes under
           inference_mode, chunked fp32 cross-entropy, Parquet output and meta.json.
  * naive  what one writes first: the same model from `from_pretrained`, one window at a time
           (batch 1) under no_grad, full `(T, V)` fp32 `log_softmax`, gather.

Printed: tokens/s of each (loop only, and end to end with model loading), their ratio (target >= 2x),
peak resident memory of each (VmHWM, reset between the two through /proc/self/clear_refs), and the
largest |difference| between the two sets of losses.

    .venv/bin/python benchmarks/bench_eval.py            # 8 windows
    .venv/bin/python benchmarks/bench_eval.py --quick    # 2 windows, a smoke run
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WINDOW = 2048
VOCAB = 50304  # Pythia's padded GPT-NeoX vocabulary: the output head is most of the work
TOKENIZER_VOCAB = 8192


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
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from ar_slicing.store import write_token_store
    from ar_slicing.tokenizer import describe
    from pipeline.count import CountConfig, run_count
    from pipeline.tag import TagConfig, run_tag

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    # Documents in order until the EOS-joined stream holds exactly n_windows full windows
    # (n_windows * WINDOW + 1 tokens); the last document is cut to fit.
    need, docs = n_windows * WINDOW + 1, []
    for enc in tok.encode_batch(texts):
        room = need - sum(len(d) + 1 for d in docs) - 1
        docs.append(enc.ids[:room])
        if room <= len(enc.ids):
            break
    info = describe(tok, "bench")
    store = write_token_store(root / "val", docs, tokenizer_info=info, tokenizer_json=tok.to_str())
    run_count(CountConfig(tokens=[str(store.path)], out=str(root / "counts"), workers=1))
    run_tag(
        TagConfig(
            tokens=str(store.path),
            counts=str(root / "counts"),
            out=str(root / "tags"),
            window=WINDOW,
            workers=1,
        )
    )
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=384,
        max_position_embeddings=WINDOW,
    )
    model = GPTNeoXForCausalLM(config)
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 windows instead of 8")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--batch-size", default="auto")
    args = parser.parse_args()
    n_windows = args.windows or (2 if args.quick else 8)

    import pyarrow.parquet as pq
    import torch

    from ar_slicing.io import read_json
    from pipeline.eval import EvalConfig, open_tags, run_eval

    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        print(
            f"building inputs: {n_windows} windows of {WINDOW} tokens, GPT-NeoX vocab {VOCAB} ..."
        )
        tags_dir, spec, n_params = build_inputs(root, n_windows)
        tags = open_tags(tags_dir)
        n_rows = int(tags.n_targets.sum())
        print(
            f"model: GPT-NeoX {n_params / 1e6:.1f} M parameters; {tags.n_windows} windows, {n_rows} targets"
        )
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

        reset_peak_rss()
        t0 = time.perf_counter()
        naive, naive_loop_s = naive_losses(
            spec.split(":", 1)[1], tags.store, tags.starts, tags.n_targets
        )
        naive_total_s = time.perf_counter() - t0
        naive_peak = peak_rss_mib()

        reset_peak_rss()
        t0 = time.perf_counter()
        cfg = EvalConfig(
            model=spec,
            tags=str(tags_dir),
            out=str(root / "losses"),
            device="cpu",
            batch_size=args.batch_size,
        )
        run_eval(cfg)
        eval_total_s = time.perf_counter() - t0
        eval_peak = peak_rss_mib()
        meta = read_json(root / "losses" / "meta.json")
        ours = np.concatenate(
            [
                pq.read_table(p).column("nll").to_numpy()
                for p in sorted((root / "losses").glob("losses-*.parquet"))
            ]
        )

    eval_loop_tps = meta["tokens_per_s"]
    naive_loop_tps = n_rows / naive_loop_s
    print()
    print(f"{'':24s}{'eval':>14s}{'naive':>14s}{'ratio':>9s}")
    print(
        f"{'tokens/s (loop)':24s}{eval_loop_tps:14,.0f}{naive_loop_tps:14,.0f}{eval_loop_tps / naive_loop_tps:8.2f}x"
    )
    e2e, n2e = n_rows / eval_total_s, n_rows / naive_total_s
    print(f"{'tokens/s (end to end)':24s}{e2e:14,.0f}{n2e:14,.0f}{e2e / n2e:8.2f}x")
    print(f"{'peak RSS (MiB)':24s}{eval_peak:14,.0f}{naive_peak:14,.0f}")
    print(f"batch size {meta['batch_size']}; max |nll difference| {np.abs(ours - naive).max():.2e}")
    print(
        f"target: eval >= 2x naive tokens/s -> {'met' if eval_loop_tps >= 2 * naive_loop_tps else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
