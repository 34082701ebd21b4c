"""A stage's parts under its ledger (`StageParts`): which are done, which are left, and the one
way the parts left are done, here or in worker processes, each recorded as it finishes.

    parts = StageParts(stage, [Part(t.path.name, (t.path,), t) for t in tasks])  # expects files
    log.info("%d parts (%d already done)", len(parts.all), len(parts.facts))
    for part, facts in parts.run(tag_part, executor):   # recorded, then yielded
        bar.update(facts["rows"])
    parts.facts                                          # every part's facts, by name

Only the process holding the stage's lock records (`StageDir.record`); workers only do parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Part:
    """One part of a stage: its name in the ledger, the files it writes and, for a part done by
    a worker process, the (picklable) task that says what to do."""

    name: str
    files: tuple[Path, ...]
    task: Any = None


class StageParts:
    """The `parts` of an open stage: their files expected at once (before any is written or
    handed to a worker), `facts` of those the ledger holds (recorded by an earlier run), `todo`
    the others, in order."""

    def __init__(self, stage, parts: Iterable[Part]):
        self.stage = stage
        self.all = list(parts)
        stage.expect(f for part in self.all for f in part.files)
        self.facts: dict[str, dict] = {}
        for part in self.all:
            done = stage.done(part.name)
            if done is not None:
                self.facts[part.name] = done
        self.todo = [part for part in self.all if part.name not in self.facts]

    def run(self, do: Callable[[Any], dict], executor=None) -> Iterator[tuple[Part, dict]]:
        """Do the parts left: `do(part.task)` writes a part's files and returns the facts to
        record with it; in `executor.map_unordered`'s worker processes when given (`do` then a
        module-level function, the tasks what the executor's workers are handed), else here in
        order. Each part is recorded as it finishes and then yielded with its facts."""
        if executor is None:
            return self.record_each((part, do(part.task)) for part in self.todo)
        part_of = {id(part.task): part for part in self.todo}  # (the executor yields the task)
        finished = executor.map_unordered(do, [part.task for part in self.todo])
        return self.record_each((part_of[id(task)], facts) for task, facts in finished)

    def record_each(
        self,
        finished: Iterable[tuple[Part, Any]],
        facts: Callable[[Any], dict] | None = None,
    ) -> Iterator[tuple[Part, Any]]:
        """Record each part of `finished` ((part, its result), from whatever did it: a pool, the
        actors, a loop of the stage's own) as it comes, with `facts(result)` (the result itself
        by default), and yield it on."""
        for part, result in finished:
            kept = facts(result) if facts is not None else result
            self.stage.record(part.name, part.files, **kept)
            self.facts[part.name] = kept
            yield part, result

    def in_order(self) -> dict[str, dict]:
        """Every part's facts by name, in the parts' order (once `run` is exhausted)."""
        return {part.name: self.facts[part.name] for part in self.all}
