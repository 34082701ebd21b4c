"""The kinds of stage output beside a folder of its own (`StageDir`): a marker over other
stages' outputs and a single file; and `open_stage` / `open_marker`, which pick the kind."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ar_slicing.machinery.io import read_json, write_json_atomic
from ar_slicing.machinery.layout import file_meta_path
from ar_slicing.machinery.ownership import ForeignFiles, foreign_files, is_temporary, refuse_foreign
from ar_slicing.machinery.plan.stage_dir import StageDir
from ar_slicing.machinery.plan.stage_plan import StagePlan, same_plan


class MarkerDir(StageDir):
    """The folder of a marker over other stages' outputs (`models/meta.json` over every
    `models/<name>/`): it owns only its meta.json, its sub-folders are those outputs, and it
    keeps no work, so any other plan rewrites it. A second writer waits for the lock."""

    wait = True
    keeps_ledger = False

    def _check_plan(self, overwrite: bool, follow_inputs: bool) -> None:
        self._refuse_foreign()
        meta = read_json(self.meta_path) if self.meta_path.is_file() else None
        if meta is not None and not overwrite and same_plan(meta.get("plan"), self.plan):
            self.meta = meta

    def _refuse_foreign(self) -> None:
        found = [rel for rel in foreign_files(self.out, ()) if not (self.out / rel).is_dir()]
        refuse_foreign(self.out, found, (), f"the {self.plan['stage']} marker")

    def _holds_work(self) -> bool:
        return False

    def _remove(self) -> None:
        self.meta_path.unlink(missing_ok=True)

    def _sweep(self) -> None:  # (only its own: each sub-folder is swept by its stage)
        for p in self.out.glob(".*"):
            if p.is_file() and is_temporary(p.name):
                p.unlink(missing_ok=True)

    def finish(self, meta: Mapping[str, Any]) -> dict:
        meta = {**meta, "plan": self.plan}
        write_json_atomic(self.meta_path, meta)
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

    @property
    def meta_path(self) -> Path:
        return file_meta_path(self.out)

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

    def finish(self, meta: Mapping[str, Any]) -> dict:
        meta = {**meta, "plan": self.plan}
        if self._patterns:
            meta["owns"] = list(self._patterns)
        write_json_atomic(self.meta_path, meta)
        self.meta = meta
        return meta


def open_stage(
    out: str | os.PathLike,
    plan: StagePlan,
    *,
    overwrite: bool = False,
    follow_inputs: bool = False,
    single_file: bool = False,
) -> StageDir:
    """What a run with `plan` must do with `out` (see `ar_slicing.machinery.plan.stage_dir`). Raises
    `PlanMismatch` before anything is touched when the plan differs and `overwrite` is off.
    `single_file`: `out` is one file, its meta beside it (`StageFile`)."""
    kind = StageFile if single_file else StageDir
    return kind(Path(out), plan, overwrite=overwrite, follow_inputs=follow_inputs)


def open_marker(folder: str | os.PathLike, plan: StagePlan) -> MarkerDir:
    """What a marker over other outputs must do (see `MarkerDir`): complete when its plan (the
    identities of those outputs) is the one it recorded, else rewritten."""
    return MarkerDir(Path(folder), plan, overwrite=False, follow_inputs=True)
