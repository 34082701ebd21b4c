"""The Parquet parts of a finished stage (`tags-*.parquet`, `losses-*.parquet`): their footers are
opened here for every reader (the results, eval, verify), so a part cut short or damaged is named
with the reason and the command that rewrites it, in one message, wherever it is met."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ar_slicing.errors import BadInput
from ar_slicing.layout import LOSS_PART_GLOB, TAG_PART_GLOB

# The stage that writes each kind of part, by the start of its file name.
_WRITER = {TAG_PART_GLOB.split("*")[0]: "tag", LOSS_PART_GLOB.split("*")[0]: "eval"}


def part_footer(path: str | os.PathLike):
    """The part's Parquet footer (`pyarrow.parquet.FileMetaData`). A part without a readable one
    (a write cut short, a damaged copy) raises `BadInput` naming it, the reason and the command
    that rewrites it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        return pq.read_metadata(path)
    except (pa.ArrowException, OSError) as e:
        reason = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") or type(e).__name__
    stage = next((s for prefix, s in _WRITER.items() if path.name.startswith(prefix)), None)
    redo = (
        f"rerun `arslice {stage} ... --overwrite --out {path.parent}` to rewrite the folder"
        if stage
        else "rerun the stage that wrote it with --overwrite"
    )
    raise BadInput(f"{path}: not a whole Parquet file ({reason}), cut short or damaged; {redo}")


def part_rows(paths: Iterable[str | os.PathLike]) -> list[int]:
    """The number of rows of each part, from its footer (see `part_footer`)."""
    return [part_footer(p).num_rows for p in paths]


def damage(path: str | os.PathLike) -> str | None:
    """`part_footer`'s message when `path` is not a whole part, else None (for `verify`, which
    reports every damaged part instead of stopping at the first)."""
    try:
        part_footer(path)
    except BadInput as e:
        return str(e)
    return None
