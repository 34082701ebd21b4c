"""Atomic output files, completion markers and the `meta.json` every stage writes beside its outputs.

A stage's outputs are complete exactly when its `meta.json` exists: it is written last, atomically,
after every data file has been renamed into place. Readers and `make` both rely on that.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from ar_slicing import __version__
from ar_slicing.machinery.layout import META_NAME, TMP_SUFFIX, is_complete, is_temporary, meta_path

__all__ = ["META_NAME", "is_complete"]  # (their home is ar_slicing.machinery.layout)
# Keys of meta.json that legitimately differ between two identical runs.
VOLATILE_META_KEYS = ("wall_time_s", "throughput", "created_at", "tokens_per_s", "host")


def tmp_path_for(path: str | os.PathLike) -> Path:
    """A temporary sibling of `path` (same directory, so the final rename is atomic). Every
    temporary name of the project is made here, so `sweep_temporaries` finds them all."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def aside_path_for(path: str | os.PathLike) -> Path:
    """Where `atomic_dir` moves the directory it replaces, until the new one is in place."""
    path = Path(path)
    return path.with_name(f".{path.name}.old{TMP_SUFFIX}")


def sweep_temporaries(directory: str | os.PathLike) -> int:
    """Remove the temporaries (files and directories) that killed runs left anywhere under
    `directory`; returns how many. Called by a stage before it writes into its output."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    # a kill between atomic_dir's two renames leaves the old directory aside: put it back
    for old in directory.rglob(f".*.old{TMP_SUFFIX}"):
        original = old.with_name(old.name[1 : -len(f".old{TMP_SUFFIX}")])
        if old.is_dir() and not original.exists():
            old.replace(original)
    found = sorted(
        (p for p in directory.rglob(".*") if is_temporary(p.name)), key=lambda p: len(p.parts)
    )
    removed = 0
    for p in found:
        if not p.exists() and not p.is_symlink():
            continue  # inside a directory removed just before
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed += 1
    return removed


def read_only_reason(path: str | os.PathLike) -> str | None:
    """Why nothing can be written at `path` (a file or folder, there or to be made), or None
    when the nearest folder that exists may be written: on a read-only file system, or not
    writable by this user. (`os.access` asks the kernel, so a read-only mount is one for root
    too.)"""
    here = Path(os.path.abspath(path))
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    folder = here if here.is_dir() else here.parent
    if os.access(folder, os.W_OK):
        return None
    with contextlib.suppress(OSError):
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    return f"{folder} is not writable by this user"


def require_writable(path: str | os.PathLike, what: str, fix: str) -> None:
    """Refuse, before anything is written, to write `what` (naming it) at `path` where nothing
    can be written (`read_only_reason`); `fix` says what to do instead."""
    from ar_slicing.errors import ArSliceError

    reason = read_only_reason(path)
    if reason is not None:
        raise ArSliceError(f"{what}: cannot be written ({reason}); {fix}")


_FILE_MODE: int | None = None


def file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file (0o666 less the umask): what every
    output gets, whichever library wrote it (safetensors writes 0o600)."""
    global _FILE_MODE
    if _FILE_MODE is None:
        umask = None
        with contextlib.suppress(OSError, ValueError):  # Linux: read it without changing it
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
        if umask is None:
            umask = os.umask(0o022)
            os.umask(umask)
        _FILE_MODE = 0o666 & ~umask
    return _FILE_MODE


def _settle(tmp: Path) -> None:
    """Flush a finished temporary file to disk and give it the outputs' common mode."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, file_mode())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write to; rename it onto `path` only if the block succeeds.

    >>> with atomic_path("out/x.parquet") as tmp:   # doctest: +SKIP
    ...     pq.write_table(table, tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        yield tmp
        if tmp.exists():
            _settle(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory to fill; it replaces the directory `path` only if the block
    succeeds (the old one is moved aside first and removed after, so a kill leaves either)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    old = aside_path_for(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _settle(f)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.replace(old)
        tmp.replace(path)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextlib.contextmanager
def os_errors_of(path: str | os.PathLike) -> Iterator[None]:
    """Around a library's write of `path`: an I/O error it reports in its own exception with
    only the errno in the text (safetensors: "I/O error: No space left on device (os error
    28)") is raised as the OSError it is, so a full disk reads as one wherever it happens."""
    import re

    try:
        yield
    except Exception as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if isinstance(e, OSError) or found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_parquet_atomic(path: str | os.PathLike, table) -> None:
    """Write a pyarrow Table (or a polars DataFrame) to `path` as one Parquet file, whole or not
    at all (`atomic_path`)."""
    import pyarrow.parquet as pq

    if not hasattr(table, "schema") or not hasattr(table, "num_rows"):  # a polars DataFrame
        table = table.to_arrow()
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    text = json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(path, text.encode())


_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS = {  # (UTF-32's before UTF-16's: one starts with the other)
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


def text_of(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of the file `path` (a `what`: "pipeline config", "JSON file"), a
    byte-order mark dropped; refused in one line when it is a binary file, text in another
    encoding, or not UTF-8 (naming the first bad byte's line and column). FileNotFoundError
    is the caller's to word."""
    from ar_slicing.errors import BadInput

    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{what} {path}: a folder, not a file")
    data = path.read_bytes()
    for bom, encoding in _OTHER_BOMS.items():
        if data.startswith(bom):
            raise BadInput(f"{what} {path}: {encoding} text; save it as UTF-8")
    if b"\0" in data:
        raise BadInput(f"{what} {path}: a binary file (it holds NUL bytes), not text")
    data = data.removeprefix(_UTF8_BOM)  # (what some editors write first; it means nothing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise BadInput(
            f"{what} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column "
            f"{column}); save it as UTF-8"
        ) from None


def read_json(path: str | os.PathLike) -> dict:
    from ar_slicing.errors import BadInput

    path = Path(path)
    try:
        return json.loads(text_of(path, "JSON file"))
    except FileNotFoundError:
        raise BadInput(
            f"{path}: not found (was the stage that writes it run to completion?)"
        ) from None
    except json.JSONDecodeError as e:
        raise BadInput(
            f"{path}: not valid JSON ({json_error(e)}); delete it and rerun the stage"
        ) from None


def json_error(e: json.JSONDecodeError, line: bool = True) -> str:
    """`Expecting value at line 3, column 7` (json's own text for some errors already ends in
    "at", as in "Unterminated string starting at")."""
    msg = e.msg.removesuffix(" at")
    return f"{msg} at line {e.lineno}, column {e.colno}" if line else f"{msg} at column {e.colno}"


def to_jsonable(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    return obj


_GIT_HASH: str | None = None


def git_hash() -> str | None:
    """The commit of the installed source tree, or None outside a git checkout."""
    global _GIT_HASH
    if _GIT_HASH is None:
        root = Path(__file__).resolve().parents[2]  # the checkout holding ar_slicing/
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
            )
            _GIT_HASH = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            _GIT_HASH = ""
    return _GIT_HASH or None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def build_meta(
    stage: str,
    *,
    config: Any,
    inputs: Any,
    counts: Mapping[str, Any],
    wall_time_s: float,
    throughput: Mapping[str, float] | None = None,
    skipped: Mapping[str, int] | None = None,
    **extra: Any,
) -> dict:
    """The common `meta.json` body: what was read, how, by which code, and what was counted."""
    return {
        "stage": stage,
        "version": __version__,
        "git_hash": git_hash(),
        "python": platform.python_version(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": to_jsonable(config),
        "inputs": to_jsonable(inputs),
        "counts": to_jsonable(dict(counts)),
        "skipped": to_jsonable(dict(skipped or {})),
        "wall_time_s": round(wall_time_s, 3),
        "throughput": to_jsonable(dict(throughput or {})),
        **to_jsonable(extra),
    }


def write_meta(out_dir: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write `meta.json` last: it marks the directory complete."""
    path = meta_path(out_dir)
    write_json_atomic(path, meta)
    return path


def stable_meta(meta: Mapping[str, Any]) -> dict:
    """`meta` without the keys that differ between identical runs (timings, timestamps)."""
    return {k: v for k, v in meta.items() if k not in VOLATILE_META_KEYS}
