"""`[tokenizer] pretrained = NAME` of a pipeline config: an existing tokenizer (a file, directory
or hub name) copied into the run under the same stage plan as every output (the tokenizer
stage's other form; it has no subcommand of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import atomic_path, build_meta
from pipeline.config import Command


@dataclass(frozen=True)
class CopyTokenizerConfig:
    pretrained: str = field(
        metadata={"help": "the tokenizer to copy: a file, directory or hub name"}
    )
    out: str = field(metadata={"help": "where the copy goes (the run's tokenizer.json)"})
    overwrite: bool = field(default=False, metadata={"help": "copy it again even if complete"})


def copy_pretrained_tokenizer(cfg: CopyTokenizerConfig) -> dict:
    """Copy the tokenizer `cfg.pretrained` to `cfg.out` (same name and fingerprint: skipped)."""
    from ar_slicing.data.tokenizer import describe, load_tokenizer
    from ar_slicing.machinery.plan import StagePlan
    from pipeline.stage import Finished, run_stage

    tok = load_tokenizer(cfg.pretrained)
    info = describe(tok, cfg.pretrained)
    plan = StagePlan(
        "tokenizer",
        settings=copy_settings(cfg),
        inputs={"fingerprint": info["fingerprint"]},
    )
    out = Path(cfg.out)

    def copy(stage, _) -> Finished:
        with atomic_path(out) as tmp:
            tok.save(str(tmp))
        meta = build_meta(
            "tokenizer",
            config={"pretrained": cfg.pretrained, "out": cfg.out},
            inputs=plan.inputs,
            counts={},
            wall_time_s=0,
            **info,
        )
        return Finished(
            meta,
            [f"tokenizer: copied {cfg.pretrained} ({info['vocab_size']} tokens) to {out}"],
            {"tokenizer": str(out), **info},
        )

    return run_stage(
        "tokenizer",
        out,
        plan,
        copy,
        overwrite=cfg.overwrite,
        single_file=True,
        skipped=lambda meta: {"tokenizer": str(out), "skipped": True},
    )


def copy_settings(cfg: CopyTokenizerConfig) -> dict:
    return {"pretrained": cfg.pretrained}


def pretrained_table(values: dict, where: str) -> bool:
    """Whether a `[tokenizer]` table names a tokenizer to copy (refusing keys that would train
    one beside it)."""
    if "pretrained" not in values:
        return False
    extra = sorted(set(values) - {"pretrained"})
    if extra:
        raise BadInput(
            f"{where}: `pretrained` copies an existing tokenizer, so {', '.join(extra)} cannot "
            "be used with it"
        )
    if not isinstance(values["pretrained"], str) or not values["pretrained"].strip():
        raise BadInput(f"{where}: `pretrained` must name a tokenizer")
    return True


def hub_names(cfg: CopyTokenizerConfig, where: str) -> list[tuple[str, str, str]]:
    from ar_slicing.machinery import hub

    if not hub.is_hub_name(cfg.pretrained):
        return []
    return [(f"tokenizer {cfg.pretrained!r} ({where} pretrained)", cfg.pretrained, "model")]


COMMAND = Command(
    CopyTokenizerConfig,
    copy_pretrained_tokenizer,
    summary="copy an existing tokenizer into a run",
    plan_settings=copy_settings,
    hub_names=hub_names,
    out_is_file=True,
)
