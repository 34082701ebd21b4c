"""The run layout: every file name, glob and directory a stage writes or reads, in one place.

`run`, `report`, `results`, `verify` and the Makefile's stage targets (through the rules
`arslice run --make-rules` writes) all find files through here, so a name changes in one line::

    runs/<name>/
      config.toml                the resolved configuration
      tokenizer.json             the run's tokenizer (trained or copied)
      tokens/train/ tokens/val/  token stores (tokens.bin, docs.parquet, tokenizer.json, meta.json)
      counts/                    bigrams.parquet, meta.json
      tags/                      windows.parquet, tags-*.parquet, meta.json
      models/<model>/            config.json, model.safetensors, meta.json (trained models)
      losses/<model>/            losses-*.parquet, meta.json (one folder per evaluated model)
      results.duckdb             views over all of the above
      report/                    report.md, report.html, *.png, *.csv, meta.json
      mqar/                      `arslice mqar`'s probe (optional): cells/, mqar.md, mqar.png
      .settings/                 each stage's resolved settings, rewritten only when they change

A stage's output directory is complete exactly when its `meta.json` exists (written last); while
a stage runs, its `.plan.json` says with which settings and inputs (see `ar_slicing.plan`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

META_NAME = "meta.json"
PLAN_NAME = ".plan.json"
# the finished parts of an unfinished output (`ar_slicing.ledger`), folded into meta.json at the end
LEDGER_NAME = ".ledger.jsonl"
# a writer's lock (`ar_slicing.ownership`); beside a one-file output, `.<name>` + LOCK_NAME
LOCK_NAME = ".arslice.lock"
# Temporary names end so (`ar_slicing.io.tmp_path_for`); one sweep removes those a kill left.
TMP_SUFFIX = ".tmp"
# ... with what a library adds to a temporary it writes: DuckDB keeps `<db>.wal` and spills to
# `<db>.tmp/` beside the database it builds under a temporary name.
_TEMPORARY = re.compile(r"\..+" + re.escape(TMP_SUFFIX) + r"(\.[A-Za-z]+)*")

# token stores
TOKENS_NAME = "tokens.bin"
DOCS_NAME = "docs.parquet"
TOKENIZER_NAME = "tokenizer.json"
STORE_PARTS = ("train", "val")
STORE_WORK_DIR = ".parts"  # the shards of an unfinished tokenize (kept for resuming)
# counts
BIGRAMS_NAME = "bigrams.parquet"
COUNT_WORK_DIR = ".work"  # partials and reduced ranges of an unfinished count (kept for resuming)
# tags
WINDOWS_NAME = "windows.parquet"
TAG_PART = "tags-{:05d}.parquet"
TAG_PART_GLOB = "tags-*.parquet"
# losses
LOSS_PART = "losses-{:05d}.parquet"
LOSS_PART_GLOB = "losses-*.parquet"
# a trained model
TRAIN_STATE_DIR = ".train-state"  # the last periodic checkpoint of an unfinished training run
# the run directory
CONFIG_NAME = "config.toml"
RESULTS_NAME = "results.duckdb"
REPORT_DIR = "report"
MQAR_DIR = "mqar"
SETTINGS_DIR = ".settings"
MAKE_RULES_NAME = "stages.mk"

# What each stage writes in its output folder, by the stage name of its plan (globs relative to
# the folder; `*` also matches across `/`): the only files it removes, and the only ones it
# accepts there besides its meta.json, plan, lock and temporaries (`ar_slicing.ownership`).
STAGE_FILES: dict[str, tuple[str, ...]] = {
    "tokenize": (TOKENS_NAME, DOCS_NAME, TOKENIZER_NAME, STORE_WORK_DIR + "/*"),
    "count": (BIGRAMS_NAME, COUNT_WORK_DIR + "/*"),
    "tag": (WINDOWS_NAME, TAG_PART_GLOB),
    "eval": (LOSS_PART_GLOB,),
    "train": ("config.json", "model.safetensors", TOKENIZER_NAME, TRAIN_STATE_DIR + "/*"),
    "report": ("report.md", "report.html", "*.png", "*.csv"),
    "mqar": ("cells/*", "mqar.csv", "mqar.md", "mqar.png"),
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
    "tokenizer.meta.json",
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
    return (Path(out_dir) / META_NAME).is_file()


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

    def store(self, part: str) -> Path:
        """`tokens/train` or `tokens/val`."""
        return self.run_dir / "tokens" / part

    @property
    def counts(self) -> Path:
        return self.run_dir / "counts"

    @property
    def tags(self) -> Path:
        return self.run_dir / "tags"

    @property
    def models(self) -> Path:
        return self.run_dir / "models"

    def model(self, name: str) -> Path:
        return self.models / name

    @property
    def losses_root(self) -> Path:
        return self.run_dir / "losses"

    def losses(self, name: str) -> Path:
        return self.losses_root / name

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
