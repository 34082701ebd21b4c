"""`arslice eval` on a GPU: tokens/s and model FLOPs utilisation for Pythia-160M and Mamba-130M shapes.

Two cases (`--case`, default both), each with random weights, saved to a temporary directory and
evaluated through `pipeline.eval.run_eval` (spec `hf:<dir>`) on windows of 2048 tokens of real
text (Python standard-library sources, tokenized by a byte-level BPE trained here), with bf16
autocast and the automatic batch size:
  * `pythia`: a GPT-NeoX of Pythia-160M's shape (12 layers, d_model 768, 12 heads, MLP 3072,
    rotary on 25% of each head, vocabulary 50 304);
  * `mamba`: a `MambaForCausalLM` of state-spaces/mamba-130m-hf's shape (24 layers, d_model 768,
    state 16, vocabulary 50 280), run through this project's chunked Mamba forward
    (models/mixers/mamba.py), as `hf:` does by default.

MFU = tokens/s x forward FLOPs per token / the device's peak dense bf16 FLOP/s, with the forward
FLOPs per token counted as in PaLM (Chowdhery et al. 2022, appendix B), forward third:
`2 * N + 4 * n_layers * d_model * T`, where N counts the parameters that do matmul work (the
blocks and the output head, not the input embedding) and T = 2048 (attention counted without the
causal halving, as PaLM does). For Mamba, `2 * N` plus the scan's ~9 FLOPs per (channel, state)
and token (decay, input, update, readout), with the tied head counted once. The peak is looked up from the device name (H100/H200 989,
A100 312 TFLOP/s, ...) or given with --peak-tflops.

    .venv/bin/python benchmarks/gpu_eval.py            # 256 windows (524 288 tokens)
    .venv/bin/python benchmarks/gpu_eval.py --quick    # 32 windows
    .venv/bin/python benchmarks/gpu_eval.py --case mamba
Without a CUDA device it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WINDOW = 2048
# Pythia-160M (EleutherAI/pythia-160m config.json)
SHAPE = dict(
    vocab_size=50304,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
    rotary_pct=0.25,
    max_position_embeddings=2048,
)
# state-spaces/mamba-130m-hf config.json
MAMBA_SHAPE = dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24)
# FLOPs of the selective scan per (channel, state) and token: exp of Δ A, Δ u B, the
# multiply-add of the update, the readout's multiply-add
SCAN_FLOPS = 9
# Dense bf16 peak in TFLOP/s (vendor data sheets, SXM parts; no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name.upper():
            return value
    return None


def forward_flops_per_token(model, window: int) -> float:
    cfg = model.config
    if cfg.model_type == "mamba":  # parameters() yields the tied head once
        n_matmul = sum(p.numel() for p in model.parameters())
        scan = SCAN_FLOPS * cfg.intermediate_size * cfg.state_size
        return 2 * n_matmul + scan * cfg.num_hidden_layers
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if "embed_in" not in n)
    return 2 * n_matmul + 4 * cfg.num_hidden_layers * cfg.hidden_size * window


def build_model(root: Path, case: str, tokenizer_json: str):
    """The case's model with random weights, saved to root/case with the tokenizer: (spec, model)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    if case == "mamba":
        model = MambaForCausalLM(MambaConfig(**MAMBA_SHAPE))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**SHAPE))
    model.save_pretrained(root / case)
    (root / case / "tokenizer.json").write_text(tokenizer_json)
    return f"hf:{root / case}", model


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="32 windows instead of 256")
    parser.add_argument("--windows", type=int, default=None)
    parser.add_argument("--batch-size", default="auto")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak")
    parser.add_argument("--case", choices=["pythia", "mamba", "both"], default="both")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_eval: no CUDA device visible to torch (torch.cuda.is_available() is False); "
            "nothing measured. Run `make bench-gpu` on a machine with an NVIDIA GPU and a CUDA "
            "build of torch.",
            file=sys.stderr,
        )
        return 1
    n_windows = args.windows or (32 if args.quick else 256)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or peak_tflops(name)

    from eval_inputs import build_tagged_text

    from ar_slicing.io import read_json
    from pipeline.eval import EvalConfig, run_eval

    print(f"device            {name}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="gpu-eval-") as tmp:
        root = Path(tmp)
        tok = build_tagged_text(root, n_windows, WINDOW, vocab_size=16384, train_docs=400)
        for case in ("pythia", "mamba") if args.case == "both" else (args.case,):
            spec, model = build_model(root, case, tok.to_str())
            flops = forward_flops_per_token(model, WINDOW)
            n_params = sum(p.numel() for p in model.parameters())
            del model
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            cfg = EvalConfig(
                model=spec, tags=str(root / "tags"), out=str(root / f"losses-{case}"),
                device="cuda", dtype=args.dtype, batch_size=args.batch_size,
            )  # fmt: skip
            run_eval(cfg)
            wall = time.perf_counter() - t0
            meta = read_json(root / f"losses-{case}" / "meta.json")
            report(case, meta, n_params, n_windows, wall, flops, peak)
    return 0


def report(case, meta, n_params, n_windows, wall, flops, peak) -> None:
    import torch

    shape = {"pythia": "Pythia-160M", "mamba": "Mamba-130M"}[case]
    tps = meta["tokens_per_s"]
    print()
    print(
        f"model             {shape} shape ({meta['architecture']}), {n_params / 1e6:.1f} M "
        f"parameters, window {WINDOW}"
    )
    print(
        f"windows           {n_windows} ({meta['tokens']:,} tokens), dtype {meta['dtype']}, "
        f"batch size {meta['batch_size']}"
    )
    print(
        f"tokens/s          {tps:,.0f} (loop), {meta['tokens'] / wall:,.0f} end to end incl. loading"
    )
    print(f"forward FLOPs/tok {flops / 1e9:.3f} G")
    if peak:
        print(
            f"MFU               {100 * tps * flops / (peak * 1e12):.1f}% of {peak:.0f} TFLOP/s "
            "dense bf16"
        )
    else:
        print("MFU               unknown peak for this device; pass --peak-tflops")
    print(f"peak GPU memory   {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    sys.exit(main())
