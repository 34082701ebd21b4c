"""The stage plan: the settings that decide a stage's output bytes and the identity of each
input, recorded with the output and checked on every rerun. One rule for every stage:

  * same plan as a complete output          -> skip (the output is touched, so `make` sees it fresh)
  * same plan as an unfinished one          -> resume from its finished parts
  * a different plan                        -> refuse, naming each differing field with both
                                               values; `--overwrite` discards the old output
  * `follow_inputs` stages (the report, which keeps no work of its own) are rebuilt when only
    their inputs differ; their own settings follow the rule above.

While a stage runs, its plan is in `OUT/.plan.json`; when it ends, `meta.json` (written last)
carries it under `"plan"`. An input's identity is the digest of its plan (or, for an output made
before plans existed, of its meta.json's stable fields), so an input redone with other
settings, or from other inputs, is a different input, and one redone under the same plan is
the same.

A stage owns only the files of its layout (`ar_slicing.layout.STAGE_FILES`, recorded in its
meta.json as `owns`): a folder holding anything else is refused, whatever the plan says, and
redoing an output removes the owned files one by one, never a tree. From the plan check to the
end of the stage, the output is locked against other writers (`ar_slicing.ownership`).

    plan = StagePlan("tag", settings={"window": 2048, ...}, inputs={"counts": identity(counts)})
    stage = open_stage(out, plan, overwrite=cfg.overwrite)   # locks OUT (when it exists)
    if stage.complete:
        return stage.skip()                    # skipped
    with stage.running():                      # creates OUT, writes .plan.json, sweeps temporaries
        ... write the outputs, each atomically ...
        stage.finish(meta)                     # meta.json with the plan; .plan.json removed
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.io import read_json, stable_meta, sweep_temporaries, to_jsonable, write_json_atomic
from ar_slicing.layout import LOCK_NAME, META_NAME, PLAN_NAME, STAGE_FILES
from ar_slicing.ownership import (
    ForeignFiles,
    LockHold,
    OutputBusy,
    acquire,
    foreign_files,
    holds_work,
    lock_path,
    refuse_foreign,
    remove_if_empty,
    remove_owned,
)

log = logging.getLogger(__name__)

_SHOWN_DIGEST = 12  # hex digits of a digest shown in a message


class PlanMismatch(ArSliceError):
    """An output made with other settings or inputs than the ones asked for."""


_REDO_CHANGED = contextvars.ContextVar("redo_changed", default=False)


@contextlib.contextmanager
def redoing_changed() -> Iterator[None]:
    """Inside, an output whose plan differs is redone instead of refused (same plans still skip):
    what `make ... OVERWRITE=1` asks of `arslice run`, stage by stage."""
    token = _REDO_CHANGED.set(True)
    try:
        yield
    finally:
        _REDO_CHANGED.reset(token)


@dataclass(frozen=True)
class StagePlan:
    stage: str
    settings: Mapping[str, Any]
    inputs: Mapping[str, Any]

    def as_json(self) -> dict:
        return to_jsonable(
            {"stage": self.stage, "settings": dict(self.settings), "inputs": dict(self.inputs)}
        )


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    text = json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def identity(stage_dir: str | os.PathLike) -> str:
    """The identity of a complete stage output: the digest of the plan it was made with (its
    settings and its inputs' identities decide its bytes, so two outputs of one plan are one
    input to the next stage, whatever the worker count, the host or the time); for an output
    that recorded no plan, the digest of its meta.json's stable fields."""
    meta = read_json(Path(stage_dir) / META_NAME)
    plan = meta.get("plan")
    return digest(plan if isinstance(plan, Mapping) and plan else stable_meta(meta))


def file_identity(path: str | os.PathLike) -> dict:
    """A file's (or a directory's files') size and modification time: what identifies an input
    too large to hash on every run, such as a checkpoint."""
    path = Path(path)
    if path.is_dir():
        return {
            p.name: file_identity(p)
            for p in sorted(path.iterdir())
            if p.is_file() and not p.name.startswith(".")
        }
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def _shown(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:_SHOWN_DIGEST] + "…"
    if value is _ABSENT:
        return "(absent)"
    return json.dumps(value, default=str)


_ABSENT = object()


def differences(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """`["settings.threshold: 8 -> 100", ...]`, one line per differing leaf field."""
    a, b = _flat(old or {}), _flat(new)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {_shown(a.get(k, _ABSENT))} -> {_shown(b.get(k, _ABSENT))}"
        for k in keys
        if a.get(k, _ABSENT) != b.get(k, _ABSENT)
    ]


def _same(old: Any, new: dict) -> bool:
    return json.loads(json.dumps(old, sort_keys=True)) == json.loads(
        json.dumps(new, sort_keys=True)
    )


class StageDir:
    """A stage's output directory and what a rerun with `plan` must do with it.

    From the plan check until the stage ends (`skip()`, or the end of `running()`), it holds the
    output's lock (`ar_slicing.ownership`): when OUT exists, from here on; when it does not, from
    when `running()` makes it."""

    single_file = False

    def __init__(self, out: Path, plan: StagePlan, *, overwrite: bool, follow_inputs: bool):
        self.out = out
        self.plan = plan.as_json()
        self.meta: dict | None = None  # the complete output's meta.json, when it is kept
        self._clear = False
        self._lock: LockHold | None = None
        self._owns = STAGE_FILES.get(plan.stage, ())
        self._check_kind()
        if self._lock_dir.is_dir():
            self._take_lock()
        try:
            self._check_plan(overwrite, follow_inputs)
        except BaseException:
            self.release()
            raise

    @property
    def _lock_dir(self) -> Path:
        return self.out

    def _check_kind(self) -> None:
        if self.out.is_symlink() and not self.out.exists():
            raise PlanMismatch(
                f"{self.out}: a link to {os.readlink(self.out)}, which does not exist; make that "
                "folder or remove the link"
            )
        if self.out.exists() and not self.out.is_dir():
            raise PlanMismatch(f"{self.out}: a file, not a folder; choose another output")

    def _take_lock(self) -> None:
        self._lock = acquire(lock_path(self.out, self.single_file), self.out)
        weakref.finalize(self, self._lock.release)  # a stage left before it ran lets go too

    def _check_plan(self, overwrite: bool, follow_inputs: bool) -> None:
        out, meta_path, plan_path = self.out, self.meta_path, self.plan_path
        found_meta = meta_path.is_file() and self._output_present()
        meta = read_json(meta_path) if found_meta else None
        if meta is not None:
            self._owns = tuple(dict.fromkeys([*self._owns, *_recorded_owns(meta)]))
        self._refuse_foreign()
        if meta is not None:
            old = meta.get("plan")
            if overwrite:
                self._clear = True
            elif _same(old, self.plan):
                self.meta = meta
            elif follow_inputs and _same(_without_inputs(old), _without_inputs(self.plan)):
                log.info("%s: its inputs changed; rebuilding it", out)
                for line in differences(old, self.plan):
                    log.info("  %s", line)
                self._clear = True
            else:
                self._refuse(old, "holds a complete output")
        elif plan_path is not None and plan_path.is_file():
            old = read_json(plan_path)
            if overwrite:
                self._clear = True
            elif not _same(old, self.plan):
                self._refuse(old, "holds the finished parts of an unfinished run")
        elif self._holds_work():
            if not overwrite:
                raise PlanMismatch(
                    f"{out}: holds files this stage did not write (no {meta_path.name} "
                    "recording how it was made); choose another output, or pass --overwrite "
                    "to replace what is there"
                )
            self._clear = True

    @property
    def meta_path(self) -> Path:
        return self.out / META_NAME

    @property
    def plan_path(self) -> Path | None:
        return self.out / PLAN_NAME

    def _output_present(self) -> bool:
        return True

    def _holds_work(self) -> bool:
        return holds_work(self.out)

    def _refuse_foreign(self) -> None:
        """Refuse an output folder holding anything this stage does not own."""
        refuse_foreign(
            self.out,
            foreign_files(self.out, self._owns),
            self._owns,
            f"the {self.plan['stage']} stage",
        )

    def _refuse(self, old: Any, what: str) -> None:
        lines = differences(old, self.plan) if isinstance(old, Mapping) else []
        if _REDO_CHANGED.get():
            log.info("%s %s made with other settings or inputs; redoing it", self.out, what)
            for line in lines:
                log.info("  %s", line)
            self._clear = True
            return
        if not lines:
            lines = ["(made by an older version, which recorded no plan)"]
        raise PlanMismatch(
            f"{self.out} {what} made with other settings or inputs than asked for:\n    "
            + "\n    ".join(lines)
            + "\n  pass --overwrite to redo it (make: OVERWRITE=1), or choose another output"
        )

    @property
    def complete(self) -> bool:
        """True when the output is complete under this plan (nothing to do)."""
        return self.meta is not None

    def release(self) -> None:
        """Let go of the output's lock (done by `skip()` and at the end of `running()`)."""
        if self._lock is not None:
            self._lock.release()

    def skip(self) -> dict:
        """The complete output's meta.json, its mtime moved on (confirmed up to date, so make
        sees it fresh)."""
        with contextlib.suppress(OSError):
            os.utime(self.meta_path)
        self.release()
        return self.meta

    def reopen(self) -> None:
        """Turn a complete output back into an unfinished one under the same plan (a partial
        evaluation extended to more windows)."""
        (self.out / META_NAME).unlink(missing_ok=True)
        self.meta = None

    def _prepare(self) -> list[Path]:
        """Make the folder that holds the lock, take the lock if not yet held, and clear what
        the plan check said to; returns the folders made here."""
        made = _missing_folders(self._lock_dir)
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        if self._lock is None:
            self._take_lock()
            if self._holds_work():  # another writer made and filled it since the plan check
                raise OutputBusy(
                    f"{self.out}: another process wrote it while this one was getting ready; "
                    "rerun to check what it holds"
                )
        if self._clear:
            self._remove()
        return made

    def _remove(self) -> None:
        remove_owned(self.out, self._owns)

    @contextlib.contextmanager
    def running(self, keep_if: Callable[[Path], bool] | None = None) -> Iterator[StageDir]:
        """Prepare OUT for this plan and yield, holding its lock; on failure, remove OUT again
        if this run made it (or cleared it) and kept no work in it (an early error leaves no
        directory behind). Work is any file but the plan, or what `keep_if(out)` says for
        stages whose first files are not work."""
        try:
            made = self._prepare()
            fresh = bool(made) or self._clear
            sweep_temporaries(self.out)  # (under the lock: no live writer's files among them)
            write_json_atomic(self.out / PLAN_NAME, self.plan)
            try:
                yield self
            except BaseException:
                kept = keep_if(self.out) if keep_if else not _holds_nothing_but_the_plan(self.out)
                if fresh and not kept:
                    self._remove()
                    self.release()
                    remove_if_empty([self.out, *made])
                raise
        finally:
            self.release()

    def finish(self, meta: Mapping[str, Any]) -> dict:
        """Write `meta.json` (with the plan and what the stage owns) last, and drop
        `.plan.json`."""
        meta = {**meta, "plan": self.plan}
        if self._owns:
            meta["owns"] = list(self._owns)
        write_json_atomic(self.meta_path, meta)
        if self.plan_path is not None:
            self.plan_path.unlink(missing_ok=True)
        self.meta = meta
        return meta


class StageFile(StageDir):
    """A stage whose output is one file (a tokenizer): written atomically, so it is never
    unfinished; its meta sits beside it as `<stem>.meta.json`, its lock as `.<name>.lock`."""

    single_file = True

    @property
    def _lock_dir(self) -> Path:
        return self.out.parent

    def _check_kind(self) -> None:
        if self.out.is_dir():
            raise PlanMismatch(f"{self.out}: a folder, not a file; choose another output")

    @property
    def meta_path(self) -> Path:
        return self.out.with_name(self.out.stem + ".meta.json")

    @property
    def plan_path(self) -> Path | None:
        return None

    def _output_present(self) -> bool:
        return self.out.is_file()

    def _holds_work(self) -> bool:
        return False

    def _refuse_foreign(self) -> None:
        if self.out.exists() and not self.meta_path.is_file():
            raise ForeignFiles(
                f"{self.out}: a file this stage did not write (there is no {self.meta_path.name} "
                "beside it); move it away or choose another output. Nothing was changed (not "
                "even with --overwrite: a stage removes only its own files)"
            )

    def _remove(self) -> None:
        self.out.unlink(missing_ok=True)
        self.meta_path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def running(self, keep_if=None) -> Iterator[StageFile]:
        try:
            self._prepare()
            yield self
        finally:
            self.release()


def _recorded_owns(meta: Mapping[str, Any]) -> list[str]:
    owns = meta.get("owns")
    if isinstance(owns, list) and all(isinstance(p, str) for p in owns):
        return owns
    return []


def _missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet (what a mkdir -p would make)."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _without_inputs(plan: Any) -> Any:
    if not isinstance(plan, Mapping):
        return plan
    return {k: v for k, v in plan.items() if k != "inputs"}


def _holds_nothing_but_the_plan(out: Path) -> bool:
    for root, _dirs, files in os.walk(out):
        for name in files:
            if not (Path(root) == out and name in (PLAN_NAME, LOCK_NAME)):
                return False
    return True


def open_stage(
    out: str | os.PathLike,
    plan: StagePlan,
    *,
    overwrite: bool = False,
    follow_inputs: bool = False,
    single_file: bool = False,
) -> StageDir:
    """What a run with `plan` must do with `out` (see the module docstring). Raises
    `PlanMismatch` before anything is touched when the plan differs and `overwrite` is off.
    `single_file`: `out` is one file, its meta beside it (`StageFile`)."""
    kind = StageFile if single_file else StageDir
    return kind(Path(out), plan, overwrite=overwrite, follow_inputs=follow_inputs)


def recorded_plan(out: str | os.PathLike, single_file: bool = False) -> dict | None:
    """The plan a complete output was made with (None: no complete output, or no plan)."""
    out = Path(out)
    meta = out.with_name(out.stem + ".meta.json") if single_file else out / META_NAME
    if not meta.is_file() or (single_file and not out.is_file()):
        return None
    plan = read_json(meta).get("plan")
    return plan if isinstance(plan, Mapping) else {}
