"""The eval stage's config and the constants its parts share."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.kernels import KERNEL_CHOICES
from pipeline.config import ReadsModel, executor_option, ray_address_option

# On CPU a few windows per batch amortise per-op overhead; more only grows memory.
CPU_TOKENS_PER_BATCH = 8192
# A first guess on CUDA (back-off halves it when it does not fit): 128 windows of 2048 tokens.
CUDA_TOKENS_PER_BATCH = 1 << 18


def _model_help() -> str:
    from models.checkpoints.registry import spec_forms

    return f"model spec: {spec_forms()} (a hub id may end in @REVISION)"


def _model_config_help() -> str:
    from models.checkpoints.registry import model_config_prefixes

    return (
        f"{model_config_prefixes()} model config file (YAML or JSON, as the format's own code "
        "writes it) to use instead of the one found with the checkpoint (based: a config.json "
        "with `fla_version`, see docs/models.md)"
    )


@dataclass(frozen=True)
class EvalConfig(ReadsModel):
    model: str = field(metadata={"help": _model_help})
    tags: str = field(metadata={"help": "tag directory written by `arslice tag` (windows.parquet)"})
    out: str = field(metadata={"help": "output directory for losses-*.parquet and meta.json"})
    name: str | None = field(
        default=None, metadata={"help": "model name recorded in meta.json (default: from the spec)"}
    )
    device: str = field(
        default="auto",
        metadata={"help": "auto = cuda when available", "choices": ["auto", "cpu", "cuda"]},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "autocast dtype of the forward pass; auto = bf16 on CUDA (fp16 without bf16 "
            "support) and on CPUs with native bf16 (AVX512-BF16, AMX, Arm BF16), else fp32. "
            "The cross-entropy is always fp32; --dtype fp32 for exact fp32 losses",
            "choices": ["auto", "bf16", "fp16", "fp32"],
        },
    )
    batch_size: str = field(
        default="auto",
        metadata={
            "help": "sequences per forward pass, or auto (backs off on CUDA out-of-memory)",
            "values": 'a positive integer or "auto"',  # (a config file may give 8 or "8")
        },
    )
    max_windows: int | None = field(
        default=None,
        metadata={"help": "evaluate only the first N windows (a partial run, resumable)"},
    )
    checkpoint_of: str | None = field(
        default=None,
        metadata={
            "help": "the model (its losses folder's name) whose training checkpoint this is: its "
            "losses are a point of that model's recall emergence, kept apart from the models "
            "of Table 1"
        },
    )
    step: int | None = field(
        default=None,
        metadata={
            "help": "with --checkpoint-of: the checkpoint's training step (default: what a "
            "native checkpoint's meta.json records)"
        },
    )
    tokens_seen: int | None = field(
        default=None,
        metadata={
            "help": "with --checkpoint-of: the training tokens the checkpoint had seen "
            "(default: what a native checkpoint's meta.json records)"
        },
    )
    window_subset: int | None = field(
        default=None,
        metadata={
            "help": "with --checkpoint-of: score only N windows, evenly strided over all of them "
            "(window floor(k*W/N) for k < N), to fit a budget; a model of Table 1 is scored on "
            "every window"
        },
    )
    windowing: str = field(
        default="fixed",
        metadata={
            "help": "fixed = the tag windows as they are (the paper's); rolling = per-document "
            "windows after a prefix token (lm-eval loglikelihood_rolling)",
            "choices": ["fixed", "rolling"],
        },
    )
    prefix_token: int | None = field(
        default=None,
        metadata={
            "help": "rolling windowing: the token id read before each document (default: the "
            "model tokenizer's BOS when it declares one, else EOS, as lm-eval's prefix_token_id)"
        },
    )
    harness_bos: bool = field(
        default=False,
        metadata={
            "help": "rolling windowing: score each document as lm-eval 0.4's default does with a "
            "tokenizer that adds BOS itself (add_bos_token=True, Llama-style): after the prefix "
            "and the BOS that tokenizer.encode adds, so every token reads two BOS (the same as "
            "plain rolling for a tokenizer that adds nothing)"
        },
    )
    tokens: str | None = field(
        default=None,
        metadata={
            "help": "validation token store (default: the one recorded in the tags' meta.json)"
        },
    )
    model_config: str | None = field(
        default=None,
        metadata={"help": _model_config_help},
    )
    skip_tokenizer_check: bool = field(
        default=False,
        metadata={
            "help": "evaluate even if the model's tokenizer differs from the store's (recorded)"
        },
    )
    fast_path: bool = field(
        default=True,
        metadata={
            "help": "run RWKV and Mamba-1 through this project's chunked forwards (the same "
            "losses, many times faster than transformers' per-token loops on a CPU); "
            "--no-fast-path keeps transformers' own forward"
        },
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": "the recurrences' fused kernels (models/kernels): auto = on CUDA the field's "
            "(mamba_ssm, causal-conv1d, flash-linear-attention) when they import, else this "
            "project's Triton kernels, and the PyTorch forms on a CPU; field, triton or pytorch "
            "to insist on one. meta.json records the path each op took",
            "choices": list(KERNEL_CHOICES),
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "run the Python an hf: model's config.json names (`auto_map`: transformers' "
            "custom code); without it such a model is refused and none of its code runs "
            "(recorded in the plan)"
        },
    )
    chunk_windows: int = field(
        default=256, metadata={"help": "windows per output file (the unit of resuming)"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete output directory"})
    executor: str = executor_option(
        "local = this process; ray = chunks spread over Ray actors, one per GPU of the cluster "
        "(every node must see --tags, the store and --out under the same paths)"
    )
    ray_address: str | None = ray_address_option()
    ray_actors: int = field(
        default=0,
        metadata={"help": "Ray actors (0 = one per GPU of the cluster; one per CPU without GPUs)"},
    )
