"""`arslice eval` on a GPU at the shapes of the real-Pile table (docs/pile.md): tokens/s warm and cold,
the plain loop a user writes instead (same run), MFU and peak memory, written as a markdown table.

Every case has random weights drawn from its published config's shape, saved to a temporary
directory and evaluated through `pipeline.eval.run_eval` on windows of 2048 tokens of real text
(Python standard-library sources, tokenized by a byte-level BPE trained here), with bf16
autocast and the automatic batch size (128 windows):

    pythia-160m, pythia-1.4b  GPT-NeoX (EleutherAI/pythia-160m, -1.4b config.json), `hf:`
    mamba-130m                MambaForCausalLM (state-spaces/mamba-130m-hf), `hf:`, run by this
                              project's forward with the fused kernels (models/kernels/)
    rwkv-169m                 RwkvForCausalLM (RWKV/rwkv-4-169m-pile, context 2048), `hf:`, the
                              same
    mamba2-130m               Mamba2ForCausalLM at state-spaces/mamba2-130m's shape (d_model 768,
                              24 layers, 24 heads of 64, d_state 128, one group, expand 2, tied
                              head), `hf:`, the same (its convolution and SSD scan)
    hyena-864x18              this project's Hyena LM, d_model 864 x 18 layers (safari's
                              Hyena-153M), `native:`
    base_conv-768x12          this project's BaseConv LM, 768 x 12, `native:`

For each: the stage twice in this process, "cold" first (its rate counts the warm-up forward
that pays the device's one-time costs) and "warm" second; the plain loop a user writes instead,
in the same run: the same checkpoint loaded by transformers (or `load_native`) with bf16 weights,
`model(ids).logits` -> fp32 cross-entropy, 32 windows a batch (for transformers' own Mamba and
RWKV forwards, which step through the tokens in Python, 4 windows; for its Mamba-2, whose PyTorch
SSD holds (chunk x chunk x heads) fp32 blocks of ~50 MB a window, 8); MFU of the warm stage; peak
GPU memory of the stage; the mean NLL of the stage and of the plain loop (the same losses, up
to bf16 rounding); the path each fused op took (meta.json's `kernels`).

MFU = tokens/s x forward FLOPs per token / the device's dense bf16 peak. Forward FLOPs per token
as in PaLM (Chowdhery et al. 2022, appendix B): `2 N + 4 n_layers d_model T` for attention, N
the parameters that do matmul work (blocks and head, not the input embedding) and T = 2048
(attention without the causal halving, as PaLM counts it); for Mamba `2 N` plus the scan's ~9
FLOPs per (channel, state) and token, for Mamba-2 `2 N` plus the recurrence's 5 (the model's
FLOPs, not the chunked form's); for RWKV, Hyena and BaseConv `2 N` (their recurrences and
FFT convolutions uncounted: "matmuls only"). The peak is looked up from the device name (H100/H200
989, A100 312 TFLOP/s, ...) or given with --peak-tflops.

    python3 benchmarks/gpu_eval.py                 # every case, 256 windows each (~5 min, H200)
    python3 benchmarks/gpu_eval.py --case mamba-130m rwkv-169m --windows 64
    python3 benchmarks/gpu_eval.py --tiny          # tiny shapes on the CPU: the whole path, no GPU

A full run writes docs/gpu-eval.md and docs/pile.md's `<!-- gpu-eval:start -->` section (`--out`
elsewhere, `--table-only` to leave docs/pile.md as it is). It needs torch, transformers, tokenizers, pyarrow,
numpy, numba and triton, nothing else (no venv: `make bench-gpu PY=python3`). Without a CUDA
device (and without --tiny) it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the page whose `<!-- gpu-eval:start -->` section a full run rewrites
PILE_PAGE = "docs/pile.md"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WINDOW = 2048
# FLOPs of the selective scan per (channel, state) and token: exp of Δ A, Δ u B, the
# multiply-add of the update, the readout's multiply-add
SCAN_FLOPS = 9
# ... of Mamba-2's SSD recurrence: Δ x B, the update's multiply-add, the readout's (its decay
# exp(Δ A) is one per head)
SSD_FLOPS = 5
# Dense bf16 peak in TFLOP/s (vendor data sheets, SXM parts; no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


@dataclass(frozen=True)
class Case:
    """One row of the table: a label, how its model is built ("neox", "mamba", "rwkv" from a
    transformers config; "native" from this project's ModelConfig) and the config's fields."""

    label: str
    kind: str
    shape: dict = field(default_factory=dict)
    plain_windows: int = 32  # windows per batch of the plain loop
    tiny: dict = field(default_factory=dict)  # the shape's fields replaced for --tiny


_TINY_HF = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2)
CASES = {
    "pythia-160m": Case(
        "Pythia-160M (GPT-NeoX)", "neox",
        dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048),
        tiny=dict(_TINY_HF, num_attention_heads=4, intermediate_size=128),
    ),
    "pythia-1.4b": Case(
        "Pythia-1.4B (GPT-NeoX)", "neox",
        dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
             intermediate_size=8192, rotary_pct=0.25, max_position_embeddings=2048),
        tiny=dict(_TINY_HF, num_attention_heads=4, intermediate_size=128),
    ),
    "mamba-130m": Case(
        "Mamba-130M (`hf:`, fused kernels)", "mamba",
        dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24),
        plain_windows=4, tiny=dict(_TINY_HF, state_size=8),
    ),
    "rwkv-169m": Case(
        "RWKV-169M (`hf:`, context 2048, fused kernels)", "rwkv",
        dict(vocab_size=50277, hidden_size=768, num_hidden_layers=12, attention_hidden_size=768,
             intermediate_size=3072, context_length=2048, rescale_every=6),
        plain_windows=4, tiny=dict(_TINY_HF, attention_hidden_size=64, intermediate_size=128),
    ),
    "hyena-864x18": Case(
        "Hyena, d_model 864 x 18 layers (`native:`)", "native",
        dict(vocab_size=50257, d_model=864, n_layers=18, sequence_mixer="hyena",
             pad_vocab_size_multiple=8),
        tiny=dict(vocab_size=4096, d_model=64, n_layers=2, sequence_mixer_kwargs={"filter_order": 16}),
    ),
    "base_conv-768x12": Case(
        "BaseConv, 768 x 12 (`native:`)", "native",
        dict(vocab_size=50257, d_model=768, n_layers=12, sequence_mixer="base_conv",
             pad_vocab_size_multiple=8),
        tiny=dict(vocab_size=4096, d_model=64, n_layers=2),
    ),
    "mamba2-130m": Case(
        "Mamba-2-130M (`hf:`, fused kernels)", "mamba2",
        dict(vocab_size=50288, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
             state_size=128, n_groups=1, expand=2, chunk_size=256, tie_word_embeddings=True),
        plain_windows=8, tiny=dict(_TINY_HF, num_heads=8, head_dim=16, state_size=16),
    ),
}  # fmt: skip


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name.upper():
            return value
    return None


def build_model(case: Case, shape: dict, out: Path, tokenizer: Path, device: str):
    """The case's model with random weights (seed 0), saved to `out` with the tokenizer.json
    `tokenizer`:
    (its spec, its parameters, its forward FLOPs per token)."""
    import torch

    from models.checkpoints.registry import count_params

    torch.manual_seed(0)
    if case.kind == "native":
        from models.backbone import LanguageModel, ModelConfig
        from models.checkpoints.native import save_native

        with torch.device(device):  # (drawn on the GPU: seconds, where a CPU takes a minute)
            model = LanguageModel(ModelConfig(l_max=WINDOW, **shape))
        save_native(model.eval(), out, tokenizer_json=tokenizer)
        spec = f"native:{out}"
    else:
        import transformers

        config_class, model_class = {
            "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
            "mamba": ("MambaConfig", "MambaForCausalLM"),
            "rwkv": ("RwkvConfig", "RwkvForCausalLM"),
            "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"),
        }[case.kind]
        config = getattr(transformers, config_class)(**shape)
        with torch.device(device):
            model = getattr(transformers, model_class)(config)
        model.save_pretrained(out)  # (the stage loads it in fp32, the plain loop in bf16)
        shutil.copy(tokenizer, out / "tokenizer.json")
        spec = f"hf:{out}"
    return spec, count_params(model), forward_flops_per_token(case, model)


def forward_flops_per_token(case: Case, model) -> float:
    """PaLM's forward FLOPs per token (module docstring) of the model as built."""
    seen, n_matmul = set(), 0
    for name, p in model.named_parameters():  # (a tied weight comes once, under its first name)
        embedding = any(k in name for k in ("embed_in", "word_embeddings", "embeddings.weight"))
        if id(p) in seen or (embedding and not _tied(model, p)):
            continue
        seen.add(id(p))
        n_matmul += p.numel()
    flops = 2 * n_matmul
    config = model.config
    if case.kind == "neox":
        flops += 4 * config.num_hidden_layers * config.hidden_size * WINDOW
    if case.kind == "mamba":
        scan = SCAN_FLOPS * config.intermediate_size * config.state_size
        flops += scan * config.num_hidden_layers
    if case.kind == "mamba2":
        d_ssm = config.num_heads * config.head_dim
        flops += SSD_FLOPS * d_ssm * config.state_size * config.num_hidden_layers
    return float(flops)


def _tied(model, p) -> bool:
    """True when parameter `p` is also the output head's weight (a tied embedding does matmul work)."""
    for head in ("lm_head", "head", "embed_out"):
        module = getattr(model, head, None)
        if module is not None and module.weight is p:
            return True
    return False


def stage_once(spec: str, root: Path, out: str, device: str, dtype: str) -> dict:
    """One `run_eval`; returns its meta.json with the loop's wall time (warm-up included)."""
    import torch

    from ar_slicing.machinery.io import read_json
    from pipeline.eval import EvalConfig, run_eval

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cfg = EvalConfig(
        model=spec, tags=str(root / "tags"), out=str(root / out), device=device, dtype=dtype,
        batch_size="auto",
    )  # fmt: skip
    run_eval(cfg)
    meta = read_json(root / out / "meta.json")
    meta["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    # the cold rate pays the warm-up forward as well as the chunks
    loop_s = meta["tokens"] / meta["tokens_per_s"] + meta["warmup_s"]
    meta["rate_with_warmup"] = meta["tokens"] / loop_s
    return meta


def plain_loop(case: Case, spec: str, root: Path, device: str, batch: int) -> dict:
    """The loop a user writes: the checkpoint with bf16 weights (fp32 on a CPU), `model(ids)`
    logits -> fp32 cross-entropy over the same windows, one warm-up batch untimed. Returns
    {"tokens_per_s", "mean_nll"}."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ar_slicing.data.store import TokenStore
    from models.checkpoints.registry import ModelSpec

    path = ModelSpec.parse(spec).path
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if case.kind == "native":
        from models.checkpoints.native import load_native

        model = load_native(path, device=device, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokens = np.asarray(TokenStore.open(root / "val").tokens, dtype=np.int64)
    n = (len(tokens) - 1) // WINDOW
    windows = [tokens[w * WINDOW : w * WINDOW + WINDOW + 1] for w in range(n)]

    def run(rows) -> tuple[float, int]:
        ids = torch.from_numpy(np.stack(rows)).to(device)
        with torch.inference_mode():
            logits = model(ids[:, :-1])
            logits = getattr(logits, "logits", logits)  # (B, T, V)
            nll = F.cross_entropy(
                logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
            )
            return float(nll.sum()), nll.numel()

    batches = [windows[i : i + batch] for i in range(0, n, batch)]
    run(batches[0][:1])  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t, total, count = time.perf_counter(), 0.0, 0
    for rows in batches:
        s, k = run(rows)
        total, count = total + s, count + k
    if device == "cuda":
        torch.cuda.synchronize()
    rate = count / (time.perf_counter() - t)
    return {"tokens_per_s": rate, "mean_nll": total / count}


def measure(name: str, case: Case, root: Path, tok, args, device: str, peak) -> dict:
    import numpy as np
    import pyarrow.parquet as pq

    shape = {**case.shape, **case.tiny} if args.tiny else case.shape
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        tok.save(str(tokenizer))
    spec, n_params, flops = build_model(case, shape, root / name, tokenizer, device)
    dtype = "bf16" if device == "cuda" else "fp32"
    cold = stage_once(spec, root, f"losses-{name}-cold", device, dtype)
    warm = stage_once(spec, root, f"losses-{name}-warm", device, dtype)
    parts = sorted((root / f"losses-{name}-warm").glob("losses-*.parquet"))
    nll = np.concatenate(
        [pq.read_table(p, columns=["nll"]).column("nll").to_numpy() for p in parts]
    )
    plain = plain_loop(case, spec, root, device, case.plain_windows)
    row = {
        "case": name, "label": case.label, "params_m": n_params / 1e6,
        "warm": warm["tokens_per_s"], "cold": cold["rate_with_warmup"],
        "warmup_s": cold["warmup_s"], "plain": plain["tokens_per_s"],
        "mfu": 100 * warm["tokens_per_s"] * flops / (peak * 1e12) if peak else None,
        "gflops_per_token": flops / 1e9, "peak_gib": warm["peak_gib"],
        "batch": warm["batch_size"], "kernels": warm["kernels"],
        "weights": warm["weights_dtype"], "stage_nll": float(nll.mean()),
        "plain_nll": plain["mean_nll"], "tokens": warm["tokens"],
    }  # fmt: skip
    print(
        f"{name:18s} warm {row['warm']:>11,.0f} tok/s  cold {row['cold']:>11,.0f}  plain "
        f"{row['plain']:>11,.0f}  ({row['warm'] / row['plain']:.2f}x)  MFU "
        f"{_pct(row['mfu'])}  peak {_gib(row['peak_gib'])}  NLL {row['stage_nll']:.4f} / "
        f"{row['plain_nll']:.4f}  kernels {row['kernels'] or '-'}",
        flush=True,
    )
    return row


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1f} %"


def _gib(x) -> str:
    return "–" if x is None else f"{x:.1f} GiB"


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| shape | `run_eval` warm (cold) tok/s | MFU | plain loop tok/s (batch) | stage / plain "
        "| peak memory | mean NLL stage / plain | fused kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kernels = ", ".join(f"{op}: {path}" for op, path in r["kernels"].items()) or "–"
        lines.append(
            f"| {r['label']} | {r['warm']:,.0f} ({r['cold']:,.0f}) | {_pct(r['mfu'])} | "
            f"{r['plain']:,.0f} ({CASES[r['case']].plain_windows}) | {r['warm'] / r['plain']:.2f}x | "
            f"{_gib(r['peak_gib'])} | {r['stage_nll']:.4f} / {r['plain_nll']:.4f} | {kernels} |"
        )
    return "\n".join(lines) + "\n"


def write_pile_section(table: str) -> None:
    page = ROOT / PILE_PAGE
    text = page.read_text()
    pattern = r"(<!-- gpu-eval:start[^>]*-->\n).*?(\n<!-- gpu-eval:end -->)"
    new, found = re.subn(
        pattern, lambda m: m.group(1) + table.strip() + m.group(2), text, flags=re.S
    )
    if not found:
        raise SystemExit(f"{PILE_PAGE} has no <!-- gpu-eval:start --> section")
    page.write_text(new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--windows", type=int, default=None, help="windows per case (256)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny shapes on the CPU, 4 windows of 128"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the table (default docs/gpu-eval.md)"
    )
    parser.add_argument(
        "--table-only", action="store_true", help=f"leave {PILE_PAGE}'s section as it is"
    )
    args = parser.parse_args(argv)

    global WINDOW
    import torch

    if args.tiny:
        WINDOW, device, n_windows, peak = 128, "cpu", args.windows or 4, None
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_eval: no CUDA device visible to torch (torch.cuda.is_available() is False); "
                "nothing measured. Run `make bench-gpu` on a machine with an NVIDIA GPU and a "
                "CUDA build of torch, or `benchmarks/gpu_eval.py --tiny` for the path on a CPU.",
                file=sys.stderr,
            )
            return 1
        device, n_windows = "cuda", args.windows or 256
        peak = args.peak_tflops or peak_tflops(torch.cuda.get_device_name())
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (--tiny shapes)"

    from eval_inputs import build_tagged_text

    t0 = time.perf_counter()
    print(f"device {name}, torch {torch.__version__}, {n_windows} windows of {WINDOW} per case")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-eval-") as tmp:
        root = Path(tmp)
        tok = build_tagged_text(root, n_windows, WINDOW, vocab_size=4096 if args.tiny else 16384,
                                train_docs=40 if args.tiny else 400)  # fmt: skip
        for case in args.case:
            rows.append(measure(case, CASES[case], root, tok, args, device, peak))
            if device == "cuda":
                torch.cuda.empty_cache()
    import transformers

    header = (
        f"Measured by `make bench-gpu` ({n_windows} windows of {WINDOW} tokens a case, bf16, "
        f"automatic batch) on {name}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; MFU against {peak or '?'} TFLOP/s; "
        f"{time.perf_counter() - t0:.0f} s in all."
    )
    if device == "cpu":
        header = header.replace("bf16, automatic batch", "fp32, automatic batch")
    table = markdown(rows, header)
    print()
    print(table)
    out = args.out or (None if args.tiny else ROOT / "docs" / "gpu-eval.md")
    if out is not None:
        out.write_text(table)
        print(f"wrote {out}")
    if not args.tiny and not args.table_only and set(args.case) == set(CASES):
        write_pile_section(table)
        print(f"updated {PILE_PAGE}'s gpu-eval section")
    return 0


if __name__ == "__main__":
    sys.exit(main())
