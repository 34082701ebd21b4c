"""The ledger of an unfinished output: which of a stage's parts are finished, with every file each
one wrote and the small facts the stage needs back about it. `ar_slicing.machinery.plan` owns it: a stage
asks its `StageDir` which parts are still to do and records each part it finishes.

One rule for every stage: **a part is done when the ledger records it and its files are there
whole**, at the sizes recorded. The ledger is `OUT/.ledger.jsonl`, one JSON line per finished
part, appended and flushed to disk as each part is recorded, so it survives a kill; a line cut
short by one is ignored (and cut off before the next record). A part recorded twice is the later
record. When the stage finishes, the ledger is folded into its meta.json (`"ledger"`) and
removed; reopening a complete output writes it back.

Only the process holding the output's lock records, and only once the part's files are in place
under their final names (written atomically): a worker writes files, its driver records them.

**What the stage expects to write.** Between a file's rename into place and its record (a kill
there, or a worker's file its driver never received), a file under a final name is in the
folder but not recorded. So before it writes (or hands out) files under final names, the stage
says which (`expect`: a line `{"expect": [...]}`, flushed like a record): the files an
unfinished output owns are exactly those its ledger records or expects, never any file merely
named like them (a user's `tags-99999.parquet` stays foreign).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.machinery.layout import LEDGER_NAME


def relative(out: Path, files: Iterable[str | os.PathLike]) -> list[str]:
    """The paths `files` relative to `out` (with `/`; `out` may be reached through a link, and
    the files need not exist yet)."""
    root = os.path.realpath(out)
    found = []
    for f in files:
        rel = os.path.relpath(os.path.realpath(f), root)
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            raise ValueError(f"{f}: not inside the output {out}")
        found.append(Path(rel).as_posix())
    return found


def file_sizes(out: Path, files: Iterable[str | os.PathLike]) -> dict[str, int]:
    """{path relative to `out`: bytes} of the files at the paths `files` (inside `out`)."""
    files = list(files)
    return {rel: os.stat(f).st_size for rel, f in zip(relative(out, files), files)}


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
        self._expected: dict[str, None] = {}
        self._expects = False  # whether it says what its stage expects (an `expect` line)

    @property
    def parts(self) -> dict[str, dict]:
        """Every recorded part by name: {"files": {relative path: bytes}, "facts": {...}}, whether
        or not its files are still there."""
        if self._parts is None:
            self._parts, self._expected, self._expects = _read(self.path)
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
        self._append(
            json.dumps({"part": name, **entry}, sort_keys=True, default=_plain)
            for name, entry in parts.items()
        )
        self.parts.update(
            {name: json.loads(json.dumps(e, default=_plain)) for name, e in parts.items()}
        )

    def expect(self, files: Iterable[str | os.PathLike]) -> None:
        """Append that the stage is about to write `files` (their paths, inside the output, as
        `record` takes them; an output named by a relative path gives relative ones): from now
        on they are its own, written or not."""
        self.parts  # noqa: B018  (what it expects already)
        new = relative(self.out, files)
        new = [rel for rel in dict.fromkeys(new) if rel not in self._expected]
        if new or not self._expects:
            self._append([json.dumps({"expect": new})])
            self._expected.update(dict.fromkeys(new))
            self._expects = True

    @property
    def names_expected(self) -> bool:
        """Whether the ledger says what its stage expects to write (a stage says so, with an
        `expect` line, when it starts; an unfinished output whose ledger never did was left by
        an older version, which owned the names of its layout)."""
        self.parts  # noqa: B018
        return self._expects

    def _append(self, lines: Iterable[str]) -> None:
        self.parts  # noqa: B018  (read before appending: a torn last line is cut off first)
        _cut_torn_tail(self.path)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())

    def files(self) -> list[str]:
        """Every file the ledger records (relative paths), whether or not it is still there."""
        return list(dict.fromkeys(rel for entry in self.parts.values() for rel in entry["files"]))

    def expected(self) -> list[str]:
        """The files the stage said it was about to write (relative paths)."""
        self.parts  # noqa: B018
        return list(self._expected)

    def owned(self) -> list[str]:
        """Every file the ledger records or expects: what the unfinished output owns."""
        return list(dict.fromkeys([*self.files(), *self.expected()]))

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


def _read(path: Path) -> tuple[dict[str, dict], dict[str, None], bool]:
    """(the recorded parts by name, the expected files, whether it has an `expect` line) of the
    ledger file `path`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return {}, {}, False
    parts: dict[str, dict] = {}
    expected: dict[str, None] = {}
    expects = False
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # the last line, cut short by a kill: that part was never recorded
        try:
            entry = json.loads(line)
            if "expect" in entry:
                expected.update(dict.fromkeys(rel for rel in entry["expect"] if _plain_path(rel)))
                expects = True
                continue
            parts[entry["part"]] = {"files": dict(entry["files"]), "facts": dict(entry["facts"])}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # (a line no version of this ledger writes: not a record)
    return parts, expected, expects


def _plain_path(rel: object) -> bool:
    """A relative path inside the output (what `expect` writes), not a way out of it."""
    return (
        isinstance(rel, str)
        and bool(rel)
        and not rel.startswith("/")
        and ".." not in rel.split("/")
    )


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
