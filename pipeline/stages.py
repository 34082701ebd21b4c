"""The stage table: every `arslice` subcommand, and the pipeline stages in the order they run.

`pipeline.cli` dispatches from it and `pipeline.run` runs the pipeline stages from it, so a
stage is added or renamed in one place. A pipeline stage is configured by the config table of
its `table` name (`[tokenizer]`, `[tokenize]`, ...) and waits for the stages in `after`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    command: str  # the `arslice` subcommand
    module: str  # the module defining its COMMAND
    summary: str  # one line for `arslice --help`
    table: str | None = None  # its pipeline config table; None: not a pipeline stage
    after: tuple[str, ...] = ()  # pipeline stages whose outputs it reads


COMMANDS: tuple[Stage, ...] = (
    Stage(
        "train-tokenizer",
        "pipeline.train_tokenizer",
        "train a byte-level BPE tokenizer on text sources",
        table="tokenizer",
    ),
    Stage(
        "tokenize",
        "pipeline.tokenize",
        "text sources or pre-tokenized data -> token store",
        table="tokenize",
        after=("tokenizer",),
    ),
    Stage(
        "count",
        "pipeline.count",
        "exact training bigram counts of token stores",
        table="count",
        after=("tokenize",),
    ),
    Stage(
        "tag",
        "pipeline.tag",
        "evaluation windows, in-context repeats and AR hits",
        table="tag",
        after=("tokenize", "count"),
    ),
    Stage(
        "train",
        "pipeline.train",
        "train a small model of one architecture on a token store",
        table="train",
        after=("tokenize",),
    ),
    Stage(
        "eval",
        "pipeline.eval",
        "per-token losses of one model over the tagged windows",
        table="eval",
        after=("tag", "train"),
    ),
    Stage(
        "report",
        "pipeline.report",
        "results.duckdb, Table 1, Figure 1 and the HTML report",
        table="report",
        after=("tag", "eval"),
    ),
    Stage("query", "pipeline.query", "run one SQL question from queries/ against a run"),
    Stage("verify", "pipeline.verify", "check a run's invariants"),
    Stage(
        "mqar",
        "pipeline.mqar",
        "Zoology's multi-query associative recall probe (Figure 2)",
    ),
    Stage("run", "pipeline.run", "run stages of a pipeline config file (what `make` calls)"),
)

BY_COMMAND = {s.command: s for s in COMMANDS}
PIPELINE = {s.table: s for s in COMMANDS if s.table}  # in running order
PIPELINE_STAGES = tuple(PIPELINE)
