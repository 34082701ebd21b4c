"""A stage's plan (the settings that decide its output's bytes and the identity of each input)
and how two plans differ: the comparison a rerun's check and `arslice run`'s check before
anything runs both make.

An input's identity is the digest of its plan (or, for an output made before plans existed, of
its meta.json's stable fields), so an input redone with other settings, or from other inputs,
is a different input, and one redone under the same plan is the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ar_slicing.errors import ArSliceError
from ar_slicing.machinery.io import read_json, stable_meta, to_jsonable
from ar_slicing.machinery.layout import file_meta_path, meta_path

_SHOWN_DIGEST = 12  # hex digits of a digest shown in a message


class PlanMismatch(ArSliceError):
    """An output made with other settings or inputs than the ones asked for."""


@dataclass(frozen=True)
class StagePlan:
    stage: str
    settings: Mapping[str, Any]
    inputs: Mapping[str, Any]
    # which parts are asked for, when that changes no part's bytes (an MQAR sweep's grid):
    # another scope reopens a complete output instead of being refused
    scope: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict:
        plan = {"stage": self.stage, "settings": dict(self.settings), "inputs": dict(self.inputs)}
        if self.scope:  # (recorded only when there is one: other plans keep their digests)
            plan["scope"] = dict(self.scope)
        return to_jsonable(plan)


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    text = json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def identity(stage_dir: str | os.PathLike) -> str:
    """The identity of a complete stage output: the digest of the plan it was made with (its
    settings and its inputs' identities decide its bytes, so two outputs of one plan are one
    input to the next stage, whatever the worker count, the host or the time); for an output
    that recorded no plan, the digest of its meta.json's stable fields."""
    meta = read_json(meta_path(stage_dir))
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


# ---- comparing plans ---------------------------------------------------------------------------


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


def same_plan(old: Any, new: dict) -> bool:
    """Whether a recorded plan (as read back from JSON) is `new`."""
    return json.loads(json.dumps(old, sort_keys=True)) == json.loads(
        json.dumps(new, sort_keys=True)
    )


def without(plan: Any, key: str) -> Any:
    """A recorded plan without its field `key` (`scope`, `inputs`), to compare the rest."""
    if not isinstance(plan, Mapping):
        return plan
    return {k: v for k, v in plan.items() if k != key}


# ---- the plan a complete output recorded -------------------------------------------------------


def recorded_plan(out: str | os.PathLike, single_file: bool = False) -> dict | None:
    """The plan a complete output was made with (None: no complete output; {}: no plan)."""
    out = Path(out)
    meta = file_meta_path(out) if single_file else meta_path(out)
    if not meta.is_file() or (single_file and not out.is_file()):
        return None
    plan = read_json(meta).get("plan")
    return plan if isinstance(plan, Mapping) else {}


def settings_differences(
    out: str | os.PathLike, settings: Mapping[str, Any], single_file: bool = False
) -> list[str]:
    """How `settings` differ from those the complete output `out` was made with, a line per
    field as a rerun would refuse them (`settings.threshold: 2 -> 3`); empty when they agree or
    there is no complete output. A setting given as None is decided by the stage's inputs (a
    default reference model) and is not compared: what `arslice run` checks before anything
    runs, when the inputs may not exist yet."""
    old = recorded_plan(out, single_file)
    if old is None:
        return []
    asked = {k: v for k, v in settings.items() if v is not None}
    recorded = old.get("settings", {})
    lines = differences({"settings": {k: recorded.get(k) for k in asked}}, {"settings": asked})
    if not old and asked:
        return ["(made by an older version, which recorded no plan)"]
    return lines
