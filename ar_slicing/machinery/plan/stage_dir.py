"""A stage's output folder under its plan (`StageDir`): the plan (`stage_plan`) is recorded with
the output and checked on every rerun. One rule for every stage:

  * same plan as a complete output          -> skip (the output is touched, so `make` sees it fresh)
  * same plan as an unfinished one          -> resume from its finished parts
  * a different plan                        -> refuse, naming each differing field with both
                                               values; `--overwrite` discards the old output
  * `follow_inputs` stages (the report, which keeps no work of its own) are rebuilt when only
    their inputs differ; their own settings follow the rule above.

While a stage runs, its plan is in `OUT/.plan.json`; when it ends, `meta.json` (written last)
carries it under `"plan"`. The outputs that are not such a folder (a marker over other outputs,
a single file) are its kinds (`kinds`).

**Parts.** A stage that works in parts asks the plan which are done and records each one it
finishes, with the files it wrote and the facts it needs back (`ar_slicing.machinery.ledger`: a part is
done when the ledger records it and its files are there whole). A plan's `scope` says which
parts are asked for without changing any part's bytes (an MQAR sweep's grid): a complete output
of the same plan but another scope is reopened, its finished parts kept.

**Ownership** follows the ledger, file by file: meta.json records exactly the files the stage
wrote (`written`), and a complete output owns those; an unfinished one owns the files its
ledger records or expects (a stage calls `expect` before it writes or hands out files under
final names, so a file put in place but killed before its record is still its own); only one
made before the ledger owns the names of its layout (`ar_slicing.machinery.layout.STAGE_FILES`, recorded
as `owns`). A folder holding anything else is refused, whatever the plan says, and so is a link
among its own names (a scratch folder replaced by a link); redoing an output removes the owned
files one by one, never a tree. From the plan check to the end of the stage, the output is
locked against other writers (`ar_slicing.machinery.ownership`). A rerun that finds the output complete
removes what a kill after its meta.json left of the running stage (its plan, its ledger, its
folder of unfinished work), and says so.

    plan = StagePlan("tag", settings={"window": 2048, ...}, inputs={"counts": identity(counts)})
    stage = open_stage(out, plan, overwrite=cfg.overwrite)   # locks OUT (when it exists)
    if stage.complete:
        return stage.skip()                    # skipped
    with stage.running():                      # creates OUT, writes .plan.json, sweeps temporaries
        stage.expect(out / p.file for p in parts)   # before any of them is written
        for part in parts:
            if stage.done(part.name) is None:  # (the facts recorded with it, when it is done)
                ... write the part's files, each atomically ...
                stage.record(part.name, files, rows=n)
        stage.finish(meta)                     # meta.json with the plan and the ledger, last
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.machinery.io import (
    read_json,
    require_writable,
    sweep_temporaries,
    write_json_atomic,
)
from ar_slicing.machinery.layout import LEDGER_NAME, LOCK_NAME, META_NAME, PLAN_NAME, STAGE_WORK
from ar_slicing.machinery.ledger import Ledger
from ar_slicing.machinery.ownership import (
    LockHold,
    OutputBusy,
    acquire,
    files_of,
    holds_work,
    lock_path,
    refuse_not_owned,
    remove_if_empty,
    remove_owned,
    remove_work,
    stage_owns,
    stage_patterns,
    unfinished_owns,
    written_files,
)
from ar_slicing.machinery.plan.stage_plan import (
    PlanMismatch,
    StagePlan,
    differences,
    same_plan,
    without,
)

log = logging.getLogger(__name__)

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


class StageDir:
    """A stage's output directory and what a rerun with `plan` must do with it.

    From the plan check until the stage ends (`skip()`, or the end of `running()`), it holds the
    output's lock (`ar_slicing.machinery.ownership`): when OUT exists, from here on; when it does not, from
    when `running()` makes it."""

    single_file = False
    wait = False  # a second writer waits for the lock instead of being refused
    keeps_ledger = True  # (a marker over other outputs has no parts)

    def __init__(self, out: Path, plan: StagePlan, *, overwrite: bool, follow_inputs: bool):
        self.out = out
        self.plan = plan.as_json()
        self.meta: dict | None = None  # the complete output's meta.json, when it is kept
        self._clear = False
        self._reopen: dict | None = None  # a complete output of another scope, to reopen
        self._lock: LockHold | None = None
        self._ledger: Ledger | None = None
        self._patterns = stage_patterns(plan.stage)  # the names of its layout
        self._owns = self._patterns  # what it may keep and remove here
        self._check_kind()
        if self._lock_dir.is_dir():
            self._take_lock()
        try:
            self._check_plan(overwrite, follow_inputs)
            if not self.complete:
                self._require_writable()
        except BaseException:
            self.release()
            raise

    @property
    def _lock_dir(self) -> Path:
        return self.out

    @property
    def _work(self) -> str | None:
        """The folder of the stage's unfinished work inside OUT (dropped when it finishes)."""
        return STAGE_WORK.get(self.plan["stage"])

    def _check_kind(self) -> None:
        problem = output_kind_problem(self.out, self.single_file)
        if problem is not None:
            raise PlanMismatch(problem)

    def _require_writable(self) -> None:
        """Refuse an output nothing can be written to (a read-only mount, a folder of another
        user's) before any work, in one line; a complete output there is still skipped."""
        require_writable(self.out, str(self.out), "choose an output on a writable disk")

    def _take_lock(self) -> None:
        self._lock = acquire(lock_path(self.out, self.single_file), self.out, wait=self.wait)
        weakref.finalize(self, self._lock.release)  # a stage left before it ran lets go too

    def _check_plan(self, overwrite: bool, follow_inputs: bool) -> None:
        out, meta_path, plan_path = self.out, self.meta_path, self.plan_path
        found_meta = meta_path.is_file() and self._output_present()
        meta = read_json(meta_path) if found_meta else None
        if meta is not None:
            self._patterns = stage_patterns(self.plan["stage"], meta)
            self._owns = stage_owns(self.plan["stage"], meta)
        elif not self.single_file:
            self._owns = unfinished_owns(self.plan["stage"], self.out, self.ledger)
        self._refuse_foreign()
        if meta is not None:
            old = meta.get("plan")
            if overwrite:
                self._clear = True
            elif same_plan(old, self.plan):
                self.meta = meta
            elif same_plan(without(old, "scope"), without(self.plan, "scope")):
                self._reopen = meta  # other parts asked for: the finished ones are kept
            elif follow_inputs and same_plan(without(old, "inputs"), without(self.plan, "inputs")):
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
            elif not same_plan(without(old, "scope"), without(self.plan, "scope")):
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
        """Refuse an output folder holding anything this stage does not own, or a link among
        its own names."""
        refuse_not_owned(self.out, self.plan["stage"], self._owns, self._patterns)

    def _refuse(self, old: Any, what: str) -> None:
        if isinstance(old, Mapping):
            lines = differences(without(old, "scope"), without(self.plan, "scope"))
        else:
            lines = []
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
        sees it fresh), without what a kill after its meta.json left (`_drop_leftovers`)."""
        self._drop_leftovers()
        with contextlib.suppress(OSError):
            os.utime(self.meta_path)
        self.release()
        return self.meta

    def _drop_leftovers(self) -> None:
        """Remove what the stage keeps only while it runs (its plan, its ledger, its folder of
        unfinished work) from a complete output: `finish` drops them after meta.json, so a kill
        between the two leaves them for ever otherwise. Only the stage's own files go (the
        folder's, file by file), and the log says so; a folder that may only be read keeps
        them."""
        left = [p for p in (self.plan_path, self.out / LEDGER_NAME) if p is not None]
        left = [p for p in left if p.is_file() and not p.is_symlink()]
        work = self.out / self._work if self._work else None
        if work is not None and work.is_dir() and not work.is_symlink():
            left.append(work)
        if not left:
            return
        names = ", ".join(p.name + ("/" if p == work else "") for p in left)
        try:
            for path in left:
                if path == work:
                    remove_work(path)
                else:
                    path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s: could not remove %s, left by a killed run (%s)", self.out, names, e)
            return
        log.info(
            "%s: removed %s, left by a run killed after it wrote %s",
            self.out,
            names,
            self.meta_path.name,
        )

    # -- the parts ---------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.out)
        return self._ledger

    def done(self, part: str) -> dict | None:
        """The facts recorded with `part` when it is done (recorded, its files whole), else None."""
        return self.ledger.done(part)

    def expect(self, files: Iterable[str | os.PathLike]) -> None:
        """Say, before writing them (or handing them to workers), which files under final names
        the stage is about to write: from then on they are its own, whether or not a kill
        comes before their record (`ar_slicing.machinery.ledger`). Files of the folder of unfinished work
        need not be expected (that folder is the stage's own)."""
        self.ledger.expect(files)

    def record(self, part: str, files: Iterable[str | os.PathLike], **facts: Any) -> None:
        """Record `part` done: its `files` (their paths, in place under their final names) and
        `facts` (what the stage needs back without reading the part again).
        Called by the process holding the lock (the stage's driver), never by a worker."""
        self.ledger.record(part, files, facts)

    def reopen(self) -> None:
        """Turn a complete output back into an unfinished one under the same plan: its plan in
        .plan.json, the parts its meta.json kept back in the ledger (a partial evaluation
        extended to more windows, an MQAR grid grown). Its layout's names are its own again."""
        meta = self._reopen or self.meta or {}
        write_json_atomic(self.out / PLAN_NAME, self.plan)
        kept = meta.get("ledger")
        if isinstance(kept, Mapping):
            self.ledger.write(kept)
        written = written_files(meta)
        if written is None:  # (made before the ledger: its layout's names were its own)
            written = files_of(self.out, self._patterns, leave_out=self._work)
        self.ledger.expect(self.out / rel for rel in written)
        (self.out / META_NAME).unlink(missing_ok=True)
        self.meta = self._reopen = None
        self._owns = stage_owns(self.plan["stage"], None, self.ledger.owned())

    # -- running -----------------------------------------------------------------------------

    def _prepare(self) -> list[Path]:
        """Make the folder that holds the lock, take the lock if not yet held, and clear what
        the plan check said to; returns the folders made here."""
        self._require_writable()  # (a complete output reopened here too)
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
            self._owns = stage_owns(self.plan["stage"], None)
            self._ledger = None  # (its file is gone with the rest)
        return made

    def _remove(self) -> None:
        remove_owned(self.out, (*self._owns, *map(glob.escape, self.ledger.owned())))

    def _sweep(self) -> None:
        sweep_temporaries(self.out)

    @contextlib.contextmanager
    def running(self, keep_if: Callable[[Path], bool] | None = None) -> Iterator[StageDir]:
        """Prepare OUT for this plan and yield, holding its lock; on failure, remove OUT again
        if this run made it (or cleared it) and kept no work in it (an early error leaves no
        directory behind). Work is any file but the plan, or what `keep_if(out)` says for
        stages whose first files are not work."""
        try:
            made = self._prepare()
            fresh = bool(made) or self._clear
            self._sweep()  # (under the lock: no live writer's files among them)
            if self._reopen is not None:
                self.reopen()
            write_json_atomic(self.out / PLAN_NAME, self.plan)
            if self.keeps_ledger:  # (its ledger names what it expects: `unfinished_owns`)
                self.ledger.expect([])
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
        """Write `meta.json` last, with the plan, the files the stage wrote (`written`) and the
        ledger's finished parts (`ledger`), then drop `.plan.json`, the ledger and the folder of
        unfinished work."""
        work = self._work
        meta = {**meta, "plan": self.plan}
        if self._patterns:
            meta["owns"] = list(self._patterns)
        kept = self.ledger.finished(exclude=work)
        recorded = [rel for part in kept.values() for rel in part["files"]]
        mine = map(glob.escape, [*recorded, *self.ledger.expected()])
        meta["written"] = files_of(self.out, mine, leave_out=work)
        if kept:
            meta["ledger"] = kept
        write_json_atomic(self.meta_path, meta)
        if self.plan_path is not None:
            self.plan_path.unlink(missing_ok=True)
        (self.out / LEDGER_NAME).unlink(missing_ok=True)
        if work:
            remove_work(self.out / work)
        self.meta = meta
        return meta


def output_kind_problem(out: str | os.PathLike, single_file: bool = False) -> str | None:
    """Why `out` cannot be a stage's output (a folder; a file with `single_file`), or None: a
    file where a folder is asked for, the other way round, or a link to nothing. What a stage
    refuses before its plan check, and `--dry-run` with it."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        return (
            f"{out}: a link to {os.readlink(out)}, which does not exist; make that "
            f"{'file' if single_file else 'folder'} or remove the link"
        )
    if single_file and out.is_dir():
        return f"{out}: a folder, not a file; choose another output"
    if not single_file and out.exists() and not out.is_dir():
        return f"{out}: a file, not a folder; choose another output"
    return None


def _missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet (what a mkdir -p would make)."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _holds_nothing_but_the_plan(out: Path) -> bool:
    for root, _dirs, files in os.walk(out):
        for name in files:
            # (the ledger alone is no work: it records parts only once their files are there)
            if not (Path(root) == out and name in (PLAN_NAME, LOCK_NAME, LEDGER_NAME)):
                return False
    return True
