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

    plan = StagePlan("tag", settings={"window": 2048, ...}, inputs={"counts": identity(counts)})
    stage = open_stage(out, plan, overwrite=cfg.overwrite)
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
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.io import read_json, stable_meta, sweep_temporaries, to_jsonable, write_json_atomic
from ar_slicing.layout import META_NAME, PLAN_NAME

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
    """A stage's output directory and what a rerun with `plan` must do with it."""

    def __init__(self, out: Path, plan: StagePlan, *, overwrite: bool, follow_inputs: bool):
        self.out = out
        self.plan = plan.as_json()
        self.meta: dict | None = None  # the complete output's meta.json, when it is kept
        self._clear = False
        meta_path, plan_path = self.meta_path, self.plan_path
        if meta_path.is_file() and self._output_present():
            meta = read_json(meta_path)
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
        elif self._foreign():
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

    def _foreign(self) -> bool:
        return self.out.is_dir() and any(self.out.iterdir())

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

    def skip(self) -> dict:
        """The complete output's meta.json, its mtime moved on (confirmed up to date, so make
        sees it fresh)."""
        with contextlib.suppress(OSError):
            os.utime(self.meta_path)
        return self.meta

    def reopen(self) -> None:
        """Turn a complete output back into an unfinished one under the same plan (a partial
        evaluation extended to more windows)."""
        (self.out / META_NAME).unlink(missing_ok=True)
        self.meta = None

    @contextlib.contextmanager
    def running(self, keep_if: Callable[[Path], bool] | None = None) -> Iterator[StageDir]:
        """Prepare OUT for this plan and yield; on failure, remove OUT again if this run made it
        and kept no work in it (an early error leaves no directory behind). Work is any file
        but the plan, or what `keep_if(out)` says for stages whose first files are not work."""
        made = not self.out.exists()
        if self._clear:
            shutil.rmtree(self.out)
            made = True
        self.out.mkdir(parents=True, exist_ok=True)
        sweep_temporaries(self.out)
        write_json_atomic(self.out / PLAN_NAME, self.plan)
        try:
            yield self
        except BaseException:
            kept = keep_if(self.out) if keep_if else not _holds_nothing_but_the_plan(self.out)
            if made and not kept:
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def finish(self, meta: Mapping[str, Any]) -> dict:
        """Write `meta.json` (with the plan) last, and drop `.plan.json`."""
        meta = {**meta, "plan": self.plan}
        write_json_atomic(self.meta_path, meta)
        if self.plan_path is not None:
            self.plan_path.unlink(missing_ok=True)
        self.meta = meta
        return meta


class StageFile(StageDir):
    """A stage whose output is one file (a tokenizer): written atomically, so it is never
    unfinished; its meta sits beside it as `<stem>.meta.json`."""

    @property
    def meta_path(self) -> Path:
        return self.out.with_name(self.out.stem + ".meta.json")

    @property
    def plan_path(self) -> Path | None:
        return None

    def _output_present(self) -> bool:
        return self.out.is_file()

    def _foreign(self) -> bool:
        return self.out.exists()

    @contextlib.contextmanager
    def running(self, keep_if=None) -> Iterator[StageFile]:
        if self._clear:
            self.out.unlink(missing_ok=True)
            self.meta_path.unlink(missing_ok=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        yield self


def _without_inputs(plan: Any) -> Any:
    if not isinstance(plan, Mapping):
        return plan
    return {k: v for k, v in plan.items() if k != "inputs"}


def _holds_nothing_but_the_plan(out: Path) -> bool:
    for root, _dirs, files in os.walk(out):
        for name in files:
            if not (Path(root) == out and name == PLAN_NAME):
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
