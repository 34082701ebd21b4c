"""`arslice export-models`: the models a pipeline config's [train] trained, written to a folder of
prebuilt models (`pipeline.train.prebuilt`) that `[train] prebuilt = FOLDER` takes them from:
what `make demo-models` runs after training the demo's models here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ar_slicing.errors import BadInput
from pipeline.config import Command, say


@dataclass(frozen=True)
class ExportConfig:
    config: str = field(metadata={"help": "pipeline config (TOML) whose [train] models to export"})
    out: str = field(
        metadata={"help": "folder of prebuilt models to write (one <name>/ per model, README.md)"}
    )
    command: str = field(
        default="",
        metadata={"help": "the command that trained the models, for the folder's README"},
    )


def run_export(cfg: ExportConfig) -> dict:
    """Write every [train] model of `cfg.config` (each complete, trained here with saved_dtype
    bf16) to `cfg.out`, with the README.md saying how they were made."""
    from ar_slicing.machinery.io import read_json
    from ar_slicing.machinery.layout import META_NAME
    from pipeline.runner.config_file import load_pipeline_config
    from pipeline.runner.stages_run import Pipeline
    from pipeline.train.prebuilt import export_models, folder_bytes, made_by, without_prebuilt

    pipeline = Pipeline(Path(cfg.config), without_prebuilt(load_pipeline_config(cfg.config)))
    configs = pipeline.configs("train")
    if not configs:
        raise BadInput(f"{cfg.config}: no [train.models.<name>] to export")
    marker = pipeline.layout.models / META_NAME
    if not marker.is_file():
        raise BadInput(
            f"{cfg.config}: {pipeline.layout.models} holds no complete training of its models "
            f"(no {marker.name}); train them first: `arslice run --config {cfg.config} --stage "
            "train --train-here`"
        )
    command = cfg.command or f"arslice run --config {cfg.config} --stage train --train-here"
    made = made_by(command, float(read_json(marker).get("wall_time_s", 0.0)))
    out = Path(cfg.out)
    records = export_models(configs, out, made)
    size = folder_bytes(out)
    say(f"export-models: {len(records)} models -> {out} ({size / 1e6:.1f} MB)")
    return {"out": str(out), "models": sorted(records), "bytes": size}


COMMAND = Command(
    ExportConfig,
    run_export,
    summary="write a config's trained models to a folder of prebuilt models (bf16)",
    examples="""\
  arslice export-models --config runs/demo/config.toml --out demo-models""",
)
