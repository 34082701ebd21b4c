"""The run layout: every file name, glob and directory a stage writes or reads, in one place.

`run`, `report`, `results`, `verify` and the Makefile's stage targets (through the rules
`arslice run --make-rules` writes) all find files through here, so a name changes in one line::

    runs/<name>/
      config.toml                the resolved configuration
      tokenizer.json             the run's tokenizer (trained or copied)
      tokens/train/ tokens/val/  token stores (tokens.bin, docs.parquet, tokenizer.json, meta.json)
      counts/                    bigrams.parquet, meta.json
      tags/                      windows.parquet, tags-*.parquet, meta.json
      models/<model>/            config.json, model.safetensors, meta.json (trained models);
                                 checkpoints/step-<n>/ along its training (`keep_checkpoints`)
      losses/<model>/            losses-*.parquet, meta.json (one folder per evaluated model,
                                 and `<model>@step<n>` per evaluated checkpoint)
      probes/<model>/            the probes of each evaluated model and checkpoint: induction,
                                 recall and position Parquet files with their summaries, meta.json
      results.duckdb             views over all of the above
      report/                    report.md, report.html, *.png, *.csv, meta.json
      mqar/                      `arslice mqar` (optional): cells/, mqar.csv, mqar.md, mqar.png
      .settings/                 each stage's resolved settings, rewritten only when they change

A stage's output directory is complete exactly when its `meta.json` exists (written last); while
a stage runs, its `.plan.json` says with which settings and inputs (see `ar_slicing.machinery.plan`).
`RunLayout` also finds what a run holds (its token stores, the tags' counts and store, the tag
and loss parts, the complete and unfinished folders), for `results`, `verify` and the API.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

META_NAME = "meta.json"
PLAN_NAME = ".plan.json"
# the finished parts of an unfinished output (`ar_slicing.machinery.ledger`), folded into meta.json at the end
LEDGER_NAME = ".ledger.jsonl"
# a writer's lock (`ar_slicing.machinery.ownership`); beside a one-file output, `.<name>` + LOCK_NAME
LOCK_NAME = ".arslice.lock"
# Temporary names end so (`ar_slicing.machinery.io.tmp_path_for`); one sweep removes those a kill left.
TMP_SUFFIX = ".tmp"
# ... with what a library adds to a temporary it writes: DuckDB keeps `<db>.wal` and spills to
# `<db>.tmp/` beside the database it builds under a temporary name.
_TEMPORARY = re.compile(r"\..+" + re.escape(TMP_SUFFIX) + r"(\.[A-Za-z]+)*")

# the stage folders of a run directory
TOKENS_DIR = "tokens"
COUNTS_DIR = "counts"
TAGS_DIR = "tags"
MODELS_DIR = "models"
LOSSES_DIR = "losses"
PROBES_DIR = "probes"
# token stores
TOKENS_NAME = "tokens.bin"
DOCS_NAME = "docs.parquet"
TOKENIZER_NAME = "tokenizer.json"
STORE_PARTS = ("train", "val")
STORE_WORK_DIR = ".parts"  # the shards of an unfinished tokenize (kept for resuming)
# counts
BIGRAMS_NAME = "bigrams.parquet"
COUNT_WORK_DIR = ".work"  # partials and reduced ranges of an unfinished count (kept for resuming)
COUNT_PARTIALS_DIR = "partials"  # in COUNT_WORK_DIR: the map step's partial files
COUNT_REDUCED_DIR = "reduced"  # in COUNT_WORK_DIR: the reduce ranges and their Parquet parts
# tags
WINDOWS_NAME = "windows.parquet"
TAG_PART = "tags-{:05d}.parquet"
TAG_PART_GLOB = "tags-*.parquet"
# losses
LOSS_PART = "losses-{:05d}.parquet"
LOSS_PART_GLOB = "losses-*.parquet"
# probes (`arslice probe`, docs/design.md "Probes of a checkpoint"): per model, the per-position
# tables of the two probes on random tokens, the loss by position on the run's windows, and a
# summary of each
PROBE_FILES = {
    "induction": ("induction.parquet", "induction_score.parquet", "induction_curve.parquet"),
    "recall": ("recall.parquet", "recall_by_k.parquet", "recall_by_distance.parquet"),
    "position": ("position.parquet", "icl.parquet"),
}
# a trained model, in this project's checkpoint format (`models.checkpoints.native`)
MODEL_CONFIG_NAME = "config.json"
MODEL_WEIGHTS_NAME = "model.safetensors"
TRAIN_STATE_DIR = ".train-state"  # the last periodic checkpoint of an unfinished training run
TRAIN_STATE = "step-{:08d}"  # one periodic checkpoint in it (`train_state`)
# the checkpoints a training run keeps (`keep_checkpoints`), each a native checkpoint with a
# meta.json recording its step: `native:models/<name>/checkpoints/step-<n>` loads one
KEPT_CHECKPOINTS_DIR = "checkpoints"
KEPT_CHECKPOINT = "step-{}"
# a folder of prebuilt models (`arslice export-models`; `[train] prebuilt` takes from it): one
# folder per model holding PREBUILT_RECORD (how it was made), config.json, model.safetensors
# (bf16) and its kept checkpoints, and a README.md saying how the folder was made
PREBUILT_RECORD = "prebuilt.json"
PREBUILT_README = "README.md"
# the losses folder of a checkpoint: the model's name and the step, `losses/attention@step800`
CHECKPOINT_LOSSES = "{}@step{}"
# the report
REPORT_MD_NAME = "report.md"
REPORT_HTML_NAME = "report.html"
FREQUENCY_CURVE_FIGURE = "frequency_curve.png"
COPY_LENGTH_FIGURE = "copy_length.png"
SLICE_BARS_FIGURE = "slice_bars.png"
RECALL_GAIN_FIGURE = "recall_gain.png"
EMERGENCE_FIGURE = "emergence.png"  # only in a run that evaluated checkpoints
PROBES_FIGURE = "probes.png"  # only in a run with probes (`arslice probe`)
# ... with checkpoints too: the probes beside the recall gain along training
PROBES_TRAINING_FIGURE = "probes_training.png"
TABLE_CSV = "{}.csv"  # one per table: table1, copy_length and each query of queries/
# the MQAR probe
MQAR_CELLS_DIR = "cells"
MQAR_CSV_NAME = "mqar.csv"
MQAR_MD_NAME = "mqar.md"
MQAR_FIGURE = "mqar.png"  # also shown in the report, under the same name
# the run directory
CONFIG_NAME = "config.toml"
RESULTS_NAME = "results.duckdb"
REPORT_DIR = "report"
MQAR_DIR = "mqar"
SETTINGS_DIR = ".settings"
MAKE_RULES_NAME = "stages.mk"


def meta_path(out_dir: str | os.PathLike) -> Path:
    """The `meta.json` of a stage's output directory (written last: the output is complete when
    it exists)."""
    return Path(out_dir) / META_NAME


def file_meta_path(path: str | os.PathLike) -> Path:
    """The meta of a one-file output, beside it: `<stem>.meta.json` (`tokenizer.meta.json`)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{META_NAME}")


# What each stage writes in its output folder, by the stage name of its plan (globs relative to
# the folder; `*` also matches across `/`): the only files it removes, and the only ones it
# accepts there besides its meta.json, plan, lock and temporaries (`ar_slicing.machinery.ownership`).
STAGE_FILES: dict[str, tuple[str, ...]] = {
    "tokenize": (TOKENS_NAME, DOCS_NAME, TOKENIZER_NAME, STORE_WORK_DIR + "/*"),
    "count": (BIGRAMS_NAME, COUNT_WORK_DIR + "/*"),
    "tag": (WINDOWS_NAME, TAG_PART_GLOB),
    "eval": (LOSS_PART_GLOB,),
    "train": (
        MODEL_CONFIG_NAME,
        MODEL_WEIGHTS_NAME,
        TOKENIZER_NAME,
        TRAIN_STATE_DIR + "/*",
        KEPT_CHECKPOINTS_DIR + "/*",
    ),
    "report": (REPORT_MD_NAME, REPORT_HTML_NAME, "*.png", TABLE_CSV.format("*")),
    "mqar": (MQAR_CELLS_DIR + "/*", MQAR_CSV_NAME, MQAR_MD_NAME, MQAR_FIGURE),
}
# The folder of a stage's unfinished work (by the stage name of its plan): the parts the ledger
# records there are dropped when the output is complete, and the folder with them.
STAGE_WORK: dict[str, str] = {
    "tokenize": STORE_WORK_DIR,
    "count": COUNT_WORK_DIR,
    "train": TRAIN_STATE_DIR,
}
# What `arslice run` writes at the top of a run directory besides the stage folders below.
RUN_FILES = (
    CONFIG_NAME,
    TOKENIZER_NAME,
    file_meta_path(TOKENIZER_NAME).name,
    RESULTS_NAME,
    f"{RESULTS_NAME}.wal",
    SETTINGS_DIR + "/*",
)


def is_temporary(name: str) -> bool:
    """True for the name of a temporary file or directory of the project (`.x.parquet.123.tmp`,
    `.results.duckdb.123.tmp.wal`, `.tags.old.tmp`); a user's `notes.tmp` is not one."""
    return _TEMPORARY.fullmatch(name) is not None


def is_complete(out_dir: str | os.PathLike) -> bool:
    """True when a stage's output directory holds its final `meta.json`."""
    return meta_path(out_dir).is_file()


def require_complete(out_dir: str | os.PathLike, what: str, fix: str) -> Path:
    """Refuse in one line a stage's output directory (`what`: "tags", "counts", ...) that has no
    final `meta.json` (missing, still running, or interrupted), saying how to `fix` it; its
    `meta.json`'s path otherwise."""
    from ar_slicing.errors import BadInput

    path = meta_path(out_dir)
    if not path.is_file():
        raise BadInput(f"{what} {Path(out_dir)}: incomplete or missing (no {META_NAME}); {fix}")
    return path


class Folders(NamedTuple):
    """The stage folders under one folder of a run (tokens/, models/, losses/), in name order:
    those with their `meta.json` and those without (a stage still running, or interrupted)."""

    complete: list[Path]
    incomplete: list[Path]


def stage_folders(root: str | os.PathLike) -> Folders:
    """The folders directly under `root` (none when it is missing); files there are not stage
    folders (`losses/meta.json` marks every model evaluated)."""
    root = Path(root)
    found = Folders([], [])
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir():
            (found.complete if is_complete(d) else found.incomplete).append(d)
    return found


def kept_checkpoint(model_dir: str | os.PathLike, step: int) -> Path:
    """The folder of the checkpoint a training run kept at `step`:
    `<model_dir>/checkpoints/step-<step>`."""
    return Path(model_dir) / KEPT_CHECKPOINTS_DIR / KEPT_CHECKPOINT.format(int(step))


def train_state(model_dir: str | os.PathLike, step: int) -> Path:
    """The folder of an unfinished training run's periodic checkpoint at `step`:
    `<model_dir>/.train-state/step-<step, 8 digits>` (removed when the model is written)."""
    return Path(model_dir) / TRAIN_STATE_DIR / TRAIN_STATE.format(int(step))


def model_of_checkpoint(path: str | os.PathLike) -> Path | None:
    """The model folder a kept checkpoint belongs to (`<model>/checkpoints/step-<n>` ->
    `<model>`), None for a folder that is not one."""
    path = Path(path)
    if path.parent.name == KEPT_CHECKPOINTS_DIR and re.fullmatch(r"step-\d+", path.name):
        return path.parent.parent
    return None


def _first_holding(name: str, *candidates: str | os.PathLike | None) -> Path | None:
    """The first of `candidates` that holds the file `name`."""
    for c in candidates:
        if c and (Path(c) / name).is_file():
            return Path(c)
    return None


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (nothing is read or created by building one)."""

    run_dir: Path

    def __post_init__(self):
        object.__setattr__(self, "run_dir", Path(self.run_dir))

    @property
    def config(self) -> Path:
        return self.run_dir / CONFIG_NAME

    @property
    def tokenizer(self) -> Path:
        return self.run_dir / TOKENIZER_NAME

    @property
    def tokens_root(self) -> Path:
        return self.run_dir / TOKENS_DIR

    def store(self, part: str) -> Path:
        """`tokens/train` or `tokens/val`."""
        return self.tokens_root / part

    def stores(self) -> Folders:
        """Every token store under tokens/ (not only `train` and `val`)."""
        return stage_folders(self.tokens_root)

    def found_store(self, recorded: str | os.PathLike | None) -> Path | None:
        """The validation store of the tags: the one they recorded, when it is complete there,
        else this layout's `tokens/val` (the run was moved since the tags were made); None when
        neither is complete."""
        return _first_holding(META_NAME, recorded, self.store("val"))

    @property
    def counts(self) -> Path:
        return self.run_dir / COUNTS_DIR

    def found_counts(self, recorded: str | os.PathLike | None) -> Path | None:
        """The counts the tags were made with: the folder they recorded, when it holds
        bigrams.parquet, else this layout's `counts/` (a moved run); None when neither does."""
        return _first_holding(BIGRAMS_NAME, recorded, self.counts)

    @property
    def tags(self) -> Path:
        return self.run_dir / TAGS_DIR

    @property
    def windows(self) -> Path:
        """The tags' window table (what eval reads)."""
        return self.tags / WINDOWS_NAME

    def tag_parts(self) -> list[Path]:
        """The tags' Parquet parts, in order."""
        return sorted(self.tags.glob(TAG_PART_GLOB))

    @property
    def models(self) -> Path:
        return self.run_dir / MODELS_DIR

    def model(self, name: str) -> Path:
        return self.models / name

    def trained_models(self) -> Folders:
        return stage_folders(self.models)

    @property
    def losses_root(self) -> Path:
        return self.run_dir / LOSSES_DIR

    def losses(self, name: str) -> Path:
        return self.losses_root / name

    def loss_folders(self) -> Folders:
        """Every losses/<model>/ folder: one per evaluated model (or checkpoint)."""
        return stage_folders(self.losses_root)

    def loss_parts(self, name: str) -> list[Path]:
        """The Parquet parts of `losses/<name>/`, in order."""
        return sorted(self.losses(name).glob(LOSS_PART_GLOB))

    @property
    def probes_root(self) -> Path:
        return self.run_dir / PROBES_DIR

    def probes(self, name: str) -> Path:
        return self.probes_root / name

    def probe_folders(self) -> Folders:
        """Every probes/<model>/ folder: one per probed model (or checkpoint)."""
        return stage_folders(self.probes_root)

    @property
    def results(self) -> Path:
        return self.run_dir / RESULTS_NAME

    @property
    def report(self) -> Path:
        return self.run_dir / REPORT_DIR

    @property
    def mqar(self) -> Path:
        """`make mqar`'s output; the report shows it when it is complete."""
        return self.run_dir / MQAR_DIR

    def stage_folders(self) -> dict[Path, str]:
        """Every output folder of a stage that has one fixed place in the run, with its stage
        (the token stores, counts, tags, report and MQAR sweep)."""
        return {
            **{self.store(part): "tokenize" for part in STORE_PARTS},
            self.counts: "count",
            self.tags: "tag",
            self.report: "report",
            self.mqar: "mqar",
        }

    def stage_containers(self) -> dict[Path, str]:
        """The folders holding one output folder per model (or checkpoint), with the stage that
        writes them: models/ (train), losses/ (eval), probes/ (probe). tokens/ holds the stores,
        which `stage_folders` names."""
        return {self.models: "train", self.losses_root: "eval", self.probes_root: "probe"}

    @property
    def settings_dir(self) -> Path:
        return self.run_dir / SETTINGS_DIR

    def settings(self, stage: str) -> Path:
        return self.settings_dir / f"{stage}.json"

    @property
    def make_rules(self) -> Path:
        return self.settings_dir / MAKE_RULES_NAME


def require_dir(path: str | os.PathLike, what: str) -> None:
    """Refuse `path`, given as the directory `what` ("run directory", "token store", ...), when
    it is missing or is a file."""
    from ar_slicing.errors import BadInput

    path = Path(path)
    if path.is_dir():
        return
    if path.exists():
        raise BadInput(f"{what} {path}: a file, not a directory")
    raise BadInput(f"{what} {path}: no such directory")


def looks_like_run_dir(path: str | os.PathLike) -> bool:
    """A directory holding any of a run's stage folders or its resolved config."""
    path = Path(path)
    layout = RunLayout(path)
    return path.is_dir() and any(
        p.exists() for p in (layout.config, layout.tags, layout.losses_root, layout.counts)
    )


def where_is(path: str | os.PathLike, want: str) -> str:
    """A hint for a path given as `want` (a stage folder such as "tags") that is not one: the
    run directory it belongs to, or the stage folder inside it, whichever the user meant."""
    path = Path(path)
    if looks_like_run_dir(path) and (path / want).exists():
        return f"{path} is a run directory; its {want} are {path / want}"
    for parent in path.resolve().parents:
        if looks_like_run_dir(parent):
            if (parent / want).resolve() == path.resolve():
                return ""  # the right folder, only unfinished
            return f"{path} is inside the run directory {parent}; its {want} are {parent / want}"
    return ""
