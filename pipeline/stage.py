"""The one way a stage runs (`run_stage`) and does its parts (`run_parts`).

A stage declares its plan (its settings and the identities of its inputs), the function that
does its work inside its output, and how its skip is worded; `run_stage` does the rest, the same
for every stage: the plan check and the lock (`ar_slicing.machinery.plan.open_stage`: skip,
resume, refuse or redo), the one wording of a skip (`skip_complete`), the checks
that must pass before the output is made (a failure there leaves nothing behind and the lock
released), the output's making, sweeping and removal on an early failure
(`StageDir.running`), and its finishing: the work ends with a `Finished` (the facts meta.json
records, the summary lines, the caller's result), the runner writes meta.json and says the
lines, so no stage writes its own:

    return run_stage(
        "tag", out, plan, lambda stage, checked: _tag_into(stage, cfg, checked),
        overwrite=cfg.overwrite,
        prepare=lambda: open_inputs(cfg),        # before OUT is made
        detail=lambda meta: f"{meta['counts']['tokens']:,} tokens",
    )

A stage in parts hands them to `run_parts` (or, to report on them as they finish, to
`StageParts`), which expects their files, does each part the ledger does not hold, here or in
worker processes, and records it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ar_slicing.machinery.plan import StagePlan, open_stage
from ar_slicing.machinery.plan.stage_parts import Part, StageParts
from pipeline.config import say

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """What a stage's work ends with, for `run_stage` to finish: the facts its meta.json records
    (`meta`; the runner adds the plan), the summary lines said once it is written, and what the
    stage's caller gets (`result`; the finished meta.json's content when None)."""

    meta: Mapping[str, Any]
    lines: Sequence[str] = ()
    result: Any = None


def run_stage(
    label: str,
    out: str | Path,
    plan: StagePlan,
    work: Callable[[Any, Any], Finished],
    *,
    overwrite: bool,
    prepare: Callable[[], Any] | None = None,
    detail: Callable[[dict], str] | str = "",
    skipped: Callable[[dict], Any] | None = None,
    quiet: bool = False,
    reopen_if: Callable[[dict], bool] | None = None,
    work_is_parts: bool = False,
    single_file: bool = False,
    follow_inputs: bool = False,
) -> Any:
    """Run one stage into `out` under `plan`: `work(stage, prepared)` does the work inside the
    output and ends with what to finish it with (`Finished`): the runner writes its meta.json,
    says its summary lines and returns its result. For an output complete under the same plan,
    `skipped(meta)` (its meta.json by default).

    `label` names the stage in its messages ("tag", "eval pythia-160m"); `detail(meta)` adds to
    the skip's line what the complete output holds; `quiet` only logs it (a library call).
    `prepare()` runs after the plan check and before OUT is made (loading and checking what the
    work needs: its failure leaves no output behind), its result handed to `work`.
    `reopen_if(meta)`: a complete output that is to be extended under the same plan (a partial
    evaluation asked for more windows) is reopened instead of skipped. `work_is_parts`: a failed
    run keeps its output only when the ledger holds a finished part (its first files, say a
    copy of its tokenizer, are no work; otherwise any file but the plan is, `StageDir.running`).
    `single_file` and `follow_inputs` are `open_stage`'s."""
    stage = open_stage(
        Path(out), plan, overwrite=overwrite, follow_inputs=follow_inputs, single_file=single_file
    )
    reopen = False
    if stage.complete:
        if reopen_if is not None and reopen_if(stage.meta):
            reopen = True
        else:
            more = detail(stage.meta) if callable(detail) else detail
            meta = skip_complete(stage, label, more, quiet=quiet)
            return skipped(meta) if skipped is not None else meta
    try:
        prepared = prepare() if prepare is not None else None
    except BaseException:
        stage.release()  # (an existing OUT is locked from the plan check on)
        raise
    keep_if = (lambda _: bool(stage.ledger.parts)) if work_is_parts else None
    with stage.running(keep_if=keep_if):
        if reopen:
            stage.reopen()  # incomplete again until its meta.json is rewritten, its parts kept
        done = work(stage, prepared)
        if not isinstance(done, Finished):
            raise TypeError(f"the work of stage {label!r} must end with a Finished, not {done!r}")
        meta = stage.finish(done.meta)
        for line in done.lines:
            say(line)
        return meta if done.result is None else done.result


def skip_complete(stage, label: str, detail: str = "", quiet: bool = False) -> dict:
    """Skip a stage whose output is complete under its plan (`StageDir.skip`) and say so, in the
    one wording every stage uses: "<label>: <out> is complete (<detail>); skipped (--overwrite
    to redo)" (`quiet`: only logged). The output's meta.json."""
    meta = stage.skip()
    more = f" ({detail})" if detail else ""
    line = f"{label}: {stage.out} is complete{more}; skipped (--overwrite to redo)"
    if quiet:
        log.debug(line)
    else:
        say(line)
    return meta


def run_parts(stage, parts: Sequence[Part], do: Callable[[Part], dict]) -> dict[str, dict]:
    """Do here, in order, the `parts` the ledger does not hold (`StageParts`; parts done in
    worker processes go through `StageParts.run`): their files are expected before any is
    written, `do(part)` writes a part's files and returns the facts recorded with it. The facts
    of every part, by name, in order (recorded now or by an earlier run)."""
    parts = StageParts(stage, parts)
    parts.record_all((part, do(part)) for part in parts.todo)
    return parts.in_order()
