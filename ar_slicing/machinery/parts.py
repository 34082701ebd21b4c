"""The Parquet parts of a finished stage (`tags-*.parquet`, `losses-*.parquet`): every reader (the
results, eval, verify) checks them here, so a part cut short or damaged is named with the reason
and the command that rewrites it, in one message, wherever it is met."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ar_slicing.errors import BadInput
from ar_slicing.machinery.layout import LOSS_PART_GLOB, TAG_PART_GLOB

# The stage that writes each kind of part, by the start of its file name.
_WRITER = {TAG_PART_GLOB.split("*")[0]: "tag", LOSS_PART_GLOB.split("*")[0]: "eval"}
_MAGIC = b"PAR1"  # a Parquet file starts and ends so; the footer's length comes just before the end


def _redo(path: Path) -> str:
    """What rewrites the part `path`: its stage's command, with --overwrite."""
    stage = next((s for prefix, s in _WRITER.items() if path.name.startswith(prefix)), None)
    if stage:
        return f"rerun `arslice {stage} ... --overwrite --out {path.parent}` to rewrite the folder"
    return "rerun the stage that wrote it with --overwrite"


def damaged_part(path: str | os.PathLike, reason: str) -> BadInput:
    """The error for a part that is not whole: its path, `reason`, and what rewrites it."""
    path = Path(path)
    return BadInput(
        f"{path}: not a whole Parquet file ({reason}), cut short or damaged; {_redo(path)}"
    )


def require_whole(paths: Iterable[str | os.PathLike]) -> None:
    """Refuse a part that was cut short, from its first and last 8 bytes only (so it is cheap
    enough for every `arslice query`): the magic at both ends and a footer length that fits."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                head = f.read(4)
                size = f.seek(0, os.SEEK_END)
                f.seek(max(size - 8, 0))
                tail = f.read(8)
        except OSError as e:
            raise damaged_part(path, e.strerror or type(e).__name__) from None
        footer = int.from_bytes(tail[:4], "little")
        if size < 12:
            raise damaged_part(path, f"Parquet file size is {size} bytes")
        if head != _MAGIC or tail[4:] != _MAGIC:
            raise damaged_part(path, "Parquet magic bytes not found in footer")
        if not 0 < footer <= size - 12:
            raise damaged_part(path, f"a footer of {footer} bytes in a file of {size}")


def part_footer(path: str | os.PathLike):
    """The part's Parquet footer (`pyarrow.parquet.FileMetaData`), read in full; a part without
    a readable one raises `damaged_part`'s error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path)
    except (pa.ArrowException, OSError) as e:
        reason = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") or type(e).__name__
        raise damaged_part(path, reason) from None


def part_rows(paths: Iterable[str | os.PathLike]) -> list[int]:
    """The number of rows of each part, from its footer (see `part_footer`)."""
    return [part_footer(p).num_rows for p in paths]


def _kind(arrow_type) -> str:
    import pyarrow as pa

    for kind in ("integer", "floating", "boolean", "string"):
        if getattr(pa.types, f"is_{kind}")(arrow_type):
            return kind
    if pa.types.is_dictionary(arrow_type):
        return _kind(arrow_type.value_type)
    return str(arrow_type)


def schema_problem(footer, schema) -> str | None:
    """How a part's columns (its `footer`) fall short of `schema` (the writer's pyarrow schema):
    a column missing or of another kind (integer, floating, ...); None when none does."""
    have = footer.schema.to_arrow_schema()
    for field in schema:
        if field.name not in have.names:
            return f"no column {field.name} among {', '.join(have.names) or 'none'}"
        found = have.field(field.name).type
        if _kind(found) != _kind(field.type):
            return f"column {field.name} is {found}, not {field.type}"
    return None


def damage(path: str | os.PathLike, schema=None) -> str | None:
    """`part_footer`'s message when `path` is not a whole part, or the columns it lacks of
    `schema` (the writer's), else None (for `verify`, which reports every damaged part instead
    of stopping at the first)."""
    try:
        footer = part_footer(path)
    except BadInput as e:
        return str(e)
    problem = None if schema is None else schema_problem(footer, schema)
    if problem is not None:
        path = Path(path)
        return f"{path}: not a part its stage writes ({problem}); {_redo(path)}"
    return None
