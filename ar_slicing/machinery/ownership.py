"""Who may write an output, and which of its files a stage may remove.

**One writer.** A writer holds an exclusive `flock` on the output's lock file (`OUT/.arslice.lock`,
or `.<name>.arslice.lock` beside a one-file output) from before it reads the output's plan until it is
done. The kernel drops the lock when the process dies, so a killed run never leaves a stale one;
a second writer is refused at once, naming the holder's pid::

    with output_lock(out):          # OutputBusy: "another arslice (pid 4242) is writing ..."
        ... read the plan, sweep temporaries, write ...

**Ownership.** A stage owns the files its ledger says it wrote: a complete output's meta.json
records exactly those (`written`, beside the parts of its ledger); an unfinished one owns the
files its ledger records or expects (`ar_slicing.machinery.ledger`), file by file, never a file only named
like them. Only an output an older version completed (no `written`) owns the names its layout
gives it (`ar_slicing.machinery.layout.STAGE_FILES`, also recorded as `owns`). Its meta.json, plan, ledger,
lock, temporaries and the hidden folder of its unfinished work are always its own; a link among
its own names, or a file where its layout keeps a folder, is refused (`misplaced`): nothing is
written through a link. Any other file in its output folder is foreign: the stage
refuses, naming it, and never removes it, `--overwrite` or not. Removing an output removes its owned files one by one and the
folders they leave empty; nothing is ever removed as a tree, and a linked output folder is
followed (its target's owned files are removed, never the link or the target itself).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import glob
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.layout import (
    LEDGER_NAME,
    LOCK_NAME,
    META_NAME,
    PLAN_NAME,
    RUN_FILES,
    STAGE_FILES,
    STAGE_WORK,
    TMP_SUFFIX,
    RunLayout,
    file_meta_path,
)

log = logging.getLogger(__name__)


class OutputBusy(ArSliceError):
    """Another process is writing the output."""


class ForeignFiles(ArSliceError):
    """An output folder holds files its stage did not write."""


# ---- the lock ---------------------------------------------------------------------------------


def lock_path(out: str | os.PathLike, single_file: bool = False) -> Path:
    """The lock file of the output folder `out` (inside it), or of the one-file output `out`
    (beside it)."""
    out = Path(out)
    return out.with_name(f".{out.name}{LOCK_NAME}") if single_file else out / LOCK_NAME


@dataclass
class _Held:
    fd: int
    count: int


# lock files this process holds, by (pid, real path): taking one again in the same process (a
# stage's own plan check inside a command that locked the output first) shares it
_HELD: dict[tuple[int, str], _Held] = {}


class LockHold:
    """One hold of an output's lock; `release()` is idempotent."""

    def __init__(self, key: tuple[int, str], path: Path, held: bool = True):
        self._key, self.path, self._released = key, path, not held

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        held = _HELD.get(self._key)
        if held is None or self._key[0] != os.getpid():
            return
        held.count -= 1
        if held.count:
            return
        del _HELD[self._key]
        # unlink first, so a process that opened the old file finds another inode and retries
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(held.fd).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            fcntl.flock(held.fd, fcntl.LOCK_UN)
        os.close(held.fd)


def _open_lock_file(path: Path) -> int | None:
    """An fd of the lock file (made if missing; read-only when another user's), or None when
    the folder may only be read."""
    flags = os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    try:
        return os.open(path, flags | os.O_RDONLY)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
            raise
        return None


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip() or "x")
        return f"pid {pid}"
    return "a process that is still starting"


def acquire(path: str | os.PathLike, what: str | os.PathLike, wait: bool = False) -> LockHold:
    """Take the lock file `path` (its folder must exist) for writing `what`. Refuses with
    OutputBusy when another process holds it, or, with `wait`, says so and waits for it."""
    path = Path(path)
    key = (os.getpid(), os.path.realpath(path))
    held = _HELD.get(key)
    if held is not None:
        held.count += 1
        return LockHold(key, path)
    while True:
        fd = _open_lock_file(path)
        if fd is None:  # a folder this user may only read: nothing can be written, no lock needed
            return LockHold(key, path, held=False)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                if not wait:
                    raise OutputBusy(
                        f"{what}: another arslice ({holder}) is writing it; this one does not "
                        "wait: rerun when that one has finished, or choose another output"
                    ) from None
                log.warning(
                    "%s: waiting for another arslice (%s) to finish writing it", what, holder
                )
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder removed it as this one opened it: take the new one
                os.close(fd)
                continue
            with contextlib.suppress(OSError):  # (another user's lock file: locked, not written)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        _HELD[key] = _Held(fd, 1)
        return LockHold(key, path)


@contextlib.contextmanager
def output_lock(
    folder: str | os.PathLike, wait: bool = False, single_file: bool = False
) -> Iterator[LockHold]:
    """Hold the lock of the output `folder` (made if missing) while the block writes it."""
    folder = Path(folder)
    (folder.parent if single_file else folder).mkdir(parents=True, exist_ok=True)
    hold = acquire(lock_path(folder, single_file), folder, wait=wait)
    try:
        yield hold
    finally:
        hold.release()


def results_lock(run_dir: str | os.PathLike, wait: bool = False):
    """Hold the lock of a run's results.duckdb, which `report` and `query` rebuild when it is
    out of date (nothing is made when `run_dir` is not a folder: a wrong --run stays as it is)."""
    results = RunLayout(run_dir).results
    if not results.parent.is_dir():
        return contextlib.nullcontext()
    return output_lock(results, wait=wait, single_file=True)


# ---- what a stage owns ------------------------------------------------------------------------


def is_temporary(name: str) -> bool:
    """A temporary name the project makes (`ar_slicing.machinery.io.tmp_path_for`, `aside_path_for`, and
    the files a library adds beside one, such as DuckDB's `.wal`)."""
    return name.startswith(".") and TMP_SUFFIX in name


def _always_owned(name: str) -> bool:
    return (
        name in (META_NAME, PLAN_NAME, LEDGER_NAME)
        or name.endswith(LOCK_NAME)
        or is_temporary(name)
    )


def stage_patterns(stage: str, meta: Mapping | None = None) -> tuple[str, ...]:
    """The globs of the files `stage` writes in its output folder: its layout's, and those an
    older version recorded in `meta` (`owns`)."""
    recorded = meta.get("owns") if isinstance(meta, Mapping) else None
    if not (isinstance(recorded, list) and all(isinstance(p, str) for p in recorded)):
        recorded = []
    return tuple(dict.fromkeys([*STAGE_FILES.get(stage, ()), *recorded]))


def written_files(meta: Mapping | None) -> dict[str, int] | None:
    """The files a complete output's meta.json records its stage wrote ({path: bytes}), None
    when it records none (an output made before the ledger)."""
    written = meta.get("written") if isinstance(meta, Mapping) else None
    if isinstance(written, Mapping) and all(isinstance(p, str) for p in written):
        return dict(written)
    return None


def stage_owns(
    stage: str, meta: Mapping | None = None, recorded: Iterable[str] = ()
) -> tuple[str, ...]:
    """What `stage` may keep in and remove from its output folder (as `owns` patterns): for a
    complete output whose `meta` records what it wrote, exactly those files; for an unfinished
    one (`meta` None), exactly the files its ledger records or expects (`recorded`), never a
    file only named like them; for an output an older version completed (no `written`), the
    names of its layout (`stage_patterns`). The folder of its unfinished work (`STAGE_WORK`,
    hidden, made by the stage; a kill after meta.json may leave it) is always its own."""
    work = STAGE_WORK.get(stage)
    scratch = (f"{work}/*",) if work else ()
    if meta is None:
        return (*scratch, *map(glob.escape, recorded))
    written = written_files(meta)
    if written is None:
        return (*stage_patterns(stage, meta), *map(glob.escape, recorded))
    return (*map(glob.escape, written), *scratch)


def unfinished_owns(stage: str, folder: Path, ledger) -> tuple[str, ...]:
    """What `stage` owns in the unfinished output `folder` by its `ledger`: the files it records
    or expects; where a run of an older version left the folder (its plan there, its ledger
    naming nothing expected), the names of its layout too, as that version owned them."""
    if not ledger.names_expected and (folder / PLAN_NAME).is_file():
        return (*stage_patterns(stage), *stage_owns(stage, None, ledger.owned()))
    return stage_owns(stage, None, ledger.owned())


def layout_folders(stage: str) -> list[str]:
    """The folders `stage` makes inside its output (`.work`, `.parts`, `checkpoints`, ...)."""
    return [p[:-2] for p in STAGE_FILES.get(stage, ()) if p.endswith("/*")]


def misplaced(folder: str | os.PathLike, patterns: Iterable[str], stage: str) -> list[str]:
    """What a stage with these patterns would write through, under `folder` (relative paths,
    sorted): a link among its own names (a scratch folder replaced by a link), and a folder of
    its layout that is not a folder."""
    folder, patterns = Path(folder), tuple(patterns)
    if not folder.is_dir():
        return []
    found = [
        rel
        for rel, path, _is_dir in _entries(folder, lambda rel: owns(rel, patterns))
        if path.is_symlink() and owns(rel, patterns)
    ]
    for name in layout_folders(stage):
        path = folder / name
        if path.exists() and not path.is_dir():
            found.append(name)
    return sorted(set(found))


def refuse_misplaced(folder: Path, found: list[str], what: str) -> None:
    """Raise ForeignFiles naming the first of `found` (`misplaced`'s answer for `folder`)."""
    if not found:
        return
    path = folder / found[0]
    if path.is_symlink():
        kind = f"a link (to {os.readlink(path)})"
        fix = "remove the link (its target stays as it is)"
    else:
        kind = "a file"
        fix = "move it away"
    raise ForeignFiles(
        f"{folder}: holds {path}, {kind} where {what} keeps its own files; it writes nothing "
        f"through it: {fix}, or choose another output. Nothing was changed"
    )


def owns(rel: str, patterns: Iterable[str]) -> bool:
    """Whether the path `rel` (relative to the output folder, with `/`) is one a stage with
    these patterns writes: a pattern's match, anything inside a temporary, or a folder that
    leads to a pattern (`.parts` for `.parts/*`). A `*` also matches across `/`."""
    parts = rel.split("/")
    if (len(parts) == 1 and _always_owned(rel)) or any(is_temporary(p) for p in parts):
        return True
    return any(fnmatch.fnmatchcase(rel, p) or p.startswith(rel + "/") for p in patterns)


def _entries(folder: Path, descend=lambda rel: True) -> Iterator[tuple[str, Path, bool]]:
    """(relative path, path, is a real folder) of everything under `folder`, in sorted order,
    walking into the folders `descend(rel)` allows; linked folders are entries, not walked into
    (only `folder` itself is followed). An unreadable folder is an entry, not walked into."""
    stack = [("", folder)]
    while stack:
        prefix, here = stack.pop()
        try:
            children = sorted(os.scandir(here), key=lambda e: e.name, reverse=True)
        except (NotADirectoryError, PermissionError):
            continue
        for entry in children:
            rel = prefix + entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            yield rel, Path(entry.path), is_dir
            if is_dir and descend(rel):
                stack.append((rel + "/", Path(entry.path)))


def foreign_files(folder: str | os.PathLike, patterns: Iterable[str]) -> list[str]:
    """The paths under `folder` (relative, sorted) that a stage with these patterns did not
    write; a foreign folder is named once, not walked into."""
    folder, patterns = Path(folder), tuple(patterns)
    if not folder.is_dir():
        return []
    return sorted(
        rel
        for rel, _path, _is_dir in _entries(folder, lambda rel: owns(rel, patterns))
        if not owns(rel, patterns)
    )


def files_of(
    folder: str | os.PathLike, patterns: Iterable[str], leave_out: str | None = None
) -> dict[str, int]:
    """{relative path: bytes} of the files under `folder` a stage with these patterns wrote, but
    its meta.json, plan, ledger, lock, temporaries and anything under the folder `leave_out`."""
    folder, patterns = Path(folder), tuple(patterns)
    skip = None if leave_out is None else leave_out.rstrip("/") + "/"
    found = {}
    for rel, path, is_dir in _entries(folder, lambda rel: owns(rel, patterns)):
        parts = rel.split("/")
        if is_dir or not owns(rel, patterns) or any(is_temporary(p) for p in parts):
            continue
        if (len(parts) == 1 and _always_owned(rel)) or (skip and rel.startswith(skip)):
            continue
        found[rel] = path.stat().st_size
    return dict(sorted(found.items()))


def holds_work(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds any file but its lock and temporaries (a stage's work)."""
    folder = Path(folder)
    return folder.is_dir() and any(
        not is_dir and rel != LOCK_NAME and not any(is_temporary(p) for p in rel.split("/"))
        for rel, _p, is_dir in _entries(folder)
    )


def refuse_foreign(folder: Path, found: list[str], writes: Iterable[str], what: str) -> None:
    """Raise ForeignFiles naming the first of `found` (the foreign files of `folder`)."""
    if not found:
        return
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    writes = tuple(writes)
    like = next((p for p in writes if fnmatch.fnmatchcase(found[0], p)), None)
    if like is not None:  # (its ledger, not the name, says which files are the stage's)
        why = f"named like its {like}, but not among the files its ledger records"
    else:
        why = f"it writes {', '.join([META_NAME, *writes])}"
    raise ForeignFiles(
        f"{folder}: holds {folder / found[0]}{more}, which {what} did not write ({why}); move "
        "it out of the folder or choose another output. Nothing was changed (not even with "
        "--overwrite: a stage removes only its own files)"
    )


def refuse_not_owned(
    folder: Path,
    stage: str,
    owned: Iterable[str] | None = None,
    patterns: Iterable[str] | None = None,
) -> None:
    """Refuse the output `folder` of `stage` when it holds a file the stage does not own (by its
    meta.json or its ledger, unless `owned` says), or a link among its own names. The check a
    stage makes before it writes anything; `report` makes it before it rebuilds results.duckdb,
    which comes before its plan."""
    if not folder.is_dir():
        return  # (nothing in it: what it is instead, the stage's own check says)
    what = f"the {stage} stage"
    owned = tuple(_stage_owns(folder, stage) if owned is None else owned)
    patterns = stage_patterns(stage) if patterns is None else patterns
    refuse_foreign(folder, foreign_files(folder, owned), patterns, what)
    refuse_misplaced(folder, misplaced(folder, owned, stage), what)


def remove_owned(folder: str | os.PathLike, patterns: Iterable[str], keep=(LOCK_NAME,)) -> None:
    """Remove the files under `folder` that a stage with these patterns owns (all but `keep`),
    then the folders they leave empty; foreign files and links' targets are never touched."""
    folder, patterns = Path(folder), tuple(patterns)
    dirs = []
    for rel, path, is_dir in _entries(folder):
        if not owns(rel, patterns) or rel in keep:
            continue
        if is_dir:
            dirs.append(path)
        else:
            path.unlink(missing_ok=True)
    for d in sorted(dirs, key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):  # still holds a foreign file: it stays
            d.rmdir()


def remove_work(folder: str | os.PathLike) -> None:
    """Remove a stage's folder of unfinished work (`.work/`, a checkpoint), file by file."""
    folder = Path(folder)
    if folder.is_dir() and not folder.is_symlink():
        remove_owned(folder, ("*",), keep=())
        remove_if_empty([folder])


def remove_if_empty(folders: Iterable[Path]) -> None:
    """Remove each of `folders` (deepest first) that is empty; the others stay as they are."""
    for d in sorted(folders, key=lambda p: -len(p.parts)):
        try:
            d.rmdir()
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                raise


# ---- a whole run directory --------------------------------------------------------------------

RESOLVED_CONFIG_MARK = "by `arslice run`"  # on the first line of the config.toml it writes


def _stage_owns(folder: Path, stage: str) -> tuple[str, ...]:
    from ar_slicing.machinery.io import read_json
    from ar_slicing.machinery.ledger import Ledger

    meta = None
    with contextlib.suppress(ArSliceError, OSError):
        if (folder / META_NAME).is_file():
            meta = read_json(folder / META_NAME)
    if meta is None:
        return unfinished_owns(stage, folder, Ledger(folder))
    return stage_owns(stage, meta)


def run_outputs(layout: RunLayout) -> dict[Path, str]:
    """The stage folders of a run directory, with the stage that writes each: the fixed ones of
    the layout and every model folder under its containers (models/, losses/, probes/)."""
    outs = layout.stage_folders()
    for root, stage in layout.stage_containers().items():
        if root.is_dir() and not root.is_symlink():
            outs.update({d: stage for d in sorted(root.iterdir()) if d.is_dir()})
    return outs


def foreign_in_run(layout: RunLayout, outputs: dict[Path, str] | None = None) -> list[Path]:
    """Every file of the run directory (and of `outputs`, more stage folders by stage) that the
    project did not write, sorted; a foreign folder is named once. Empty for a new directory."""
    run_dir = layout.run_dir
    if not run_dir.exists() and not run_dir.is_symlink():
        return []
    if not run_dir.is_dir():
        return [run_dir]
    outs = {**run_outputs(layout), **(outputs or {})}
    containers = [layout.tokens_root, *layout.stage_containers()]
    top = [
        *RUN_FILES,
        *(f"{p.relative_to(run_dir)}/*" for p in [*outs, *containers] if p.is_relative_to(run_dir)),
    ]
    found = [run_dir / rel for rel in foreign_files(run_dir, top)]
    config = layout.config
    if config.is_file() and not config.is_symlink():
        with open(config, encoding="utf-8", errors="replace") as f:
            if RESOLVED_CONFIG_MARK not in f.readline():
                found.append(config)
    elif config.exists() or config.is_symlink():
        found.append(config)
    tokenizer = layout.tokenizer
    if tokenizer.exists() and not file_meta_path(tokenizer).is_file():
        found.append(tokenizer)
    for root in containers:
        if root.is_dir():  # only stage folders, the marker and the lock in between
            found += [
                root / rel
                for rel in foreign_files(root, ())
                if (root / rel.split("/")[0]) not in outs
            ]
    for folder, stage in outs.items():
        if folder.is_dir():
            owned = _stage_owns(folder, stage)
            found += [folder / rel for rel in foreign_files(folder, owned)]
            found += [folder / rel for rel in misplaced(folder, owned, stage)]
    return sorted(set(found))
