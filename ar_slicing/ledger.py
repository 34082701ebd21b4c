"""The ledger of an unfinished output: which of a stage's parts are finished, with every file each
one wrote and the small facts the stage needs back about it. `ar_slicing.plan` owns it: a stage
asks its `StageDir` which parts are still to do and records each part it finishes.

One rule for every stage: **a part is done when the ledger records it and its files are there
whole**, at the sizes recorded. The ledger is `OUT/.ledger.jsonl`, one JSON line per finished
part, appended and flushed to disk as each part is recorded, so it survives a kill; a line cut
short by one is ignored (and cut off before the next record). A part recorded twice is the later
record. When the stage finishes, the ledger is folded into its meta.json (`"ledger"`) and
removed; reopening a complete output writes it back.

Only the process holding the output's lock records, and only once the part's files are in place
under their final names (written atomically): a worker writes files, its driver records them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.layout import LEDGER_NAME


def file_sizes(out: Path, files: Iterable[str | os.PathLike]) -> dict[str, int]:
    """{path relative to `out`: bytes} of the files at the paths `files` (inside `out`, which
    may be reached through a link)."""
    root = os.path.realpath(out)
    sizes = {}
    for f in files:
        rel = os.path.relpath(os.path.realpath(f), root)
        if rel.startswith(".."):
            raise ValueError(f"{f}: not inside the output {out}")
        sizes[Path(rel).as_posix()] = os.stat(f).st_size
    return sizes


def whole(out: Path, files: Mapping[str, int]) -> bool:
    """Whether every one of `files` ({relative path: bytes}) is in `out` at its recorded size."""
    for rel, size in files.items():
        try:
            if (out / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


class Ledger:
    """The finished parts of the output folder `out` (read on first use, then kept in step with
    every record)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LEDGER_NAME
        self._parts: dict[str, dict] | None = None

    @property
    def parts(self) -> dict[str, dict]:
        """Every recorded part by name: {"files": {relative path: bytes}, "facts": {...}}, whether
        or not its files are still there."""
        if self._parts is None:
            self._parts = _read(self.path)
        return self._parts

    def done(self, part: str) -> dict | None:
        """The facts recorded with `part` when it is done (recorded, its files whole), else None."""
        entry = self.parts.get(part)
        if entry is None or not whole(self.out, entry["files"]):
            return None
        return entry["facts"]

    def record(self, part: str, files: Iterable[str | os.PathLike], facts: Mapping) -> None:
        """Append `part` with its files (their paths; already in place) and facts, flushed."""
        entry = {"files": file_sizes(self.out, files), "facts": dict(facts)}
        self.write({part: entry})

    def write(self, parts: Mapping[str, dict]) -> None:
        """Append the entries `parts` ({name: {"files", "facts"}}) as they are."""
        if not parts:
            return
        self.parts  # noqa: B018  (read before appending: a torn last line is cut off first)
        _cut_torn_tail(self.path)
        lines = "".join(
            json.dumps({"part": name, **entry}, sort_keys=True, default=_plain) + "\n"
            for name, entry in parts.items()
        )
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        self.parts.update(
            {name: json.loads(json.dumps(e, default=_plain)) for name, e in parts.items()}
        )

    def files(self) -> list[str]:
        """Every file the ledger records (relative paths), whether or not it is still there."""
        return list(dict.fromkeys(rel for entry in self.parts.values() for rel in entry["files"]))

    def finished(self, exclude: str | None = None) -> dict[str, dict]:
        """The done parts ({name: entry}) with no file under the folder `exclude` (the stage's
        unfinished work, gone once it completes): what meta.json keeps of the ledger."""
        prefix = None if exclude is None else exclude.rstrip("/") + "/"
        return {
            name: entry
            for name, entry in self.parts.items()
            if whole(self.out, entry["files"])
            and not (prefix and any(rel.startswith(prefix) for rel in entry["files"]))
        }


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot record {value!r} in a ledger")


def _read(path: Path) -> dict[str, dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    parts: dict[str, dict] = {}
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # the last line, cut short by a kill: that part was never recorded
        try:
            entry = json.loads(line)
            parts[entry["part"]] = {"files": dict(entry["files"]), "facts": dict(entry["facts"])}
        except (ValueError, KeyError, TypeError):
            continue  # (a line no version of this ledger writes: not a record)
    return parts


def _cut_torn_tail(path: Path) -> None:
    """Cut a last line without its newline off the ledger, so the next record starts a line."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        return
