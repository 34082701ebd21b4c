"""The report stage's config and the names its parts share."""

from __future__ import annotations

from dataclasses import dataclass, field

QUERY_TABLES = (
    "slice_perplexity",
    "gap_vs_reference",
    "frequency_curve",
    "recall_gain",
    "by_subset",
    "examples",
)


@dataclass(frozen=True)
class ReportConfig:
    run: str = field(metadata={"help": "run directory (holds tags/ and losses/<model>/)"})
    reference: str | None = field(
        default=None,
        metadata={
            "help": "reference model (a losses folder name); default: the model whose architecture "
            "or name says attention, else the first"
        },
    )
    bootstrap: int = field(
        default=1000,
        metadata={"help": "bootstrap resamples of windows for the 95%% intervals (0 = none)"},
    )
    seed: int = field(
        default=0, metadata={"help": "bootstrap random seed (fixed: reruns are identical)"}
    )
    passages: int = field(
        default=3, metadata={"help": "validation windows shown in the HTML passage viewer"}
    )
    overwrite: bool = field(default=False, metadata={"help": "redo a complete report"})
