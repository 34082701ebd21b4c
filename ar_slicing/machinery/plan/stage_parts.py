"""A stage's parts under its ledger (`StageParts`): which are done, which are left, and the one
way the parts left are done, here or in worker processes, each recorded as it finishes.

    parts = StageParts(stage, [Part(t.path.name, (t.path,), t) for t in tasks])  # expects files
    log.info("%d parts (%d already done)", len(parts.all), len(parts.facts))
    for part, facts in parts.run(tag_part, executor):   # recorded, then yielded
        bar.update(facts["rows"])
    parts.facts                                          # every part's facts, by name

Parts whose results come from a loop of the stage's own are recorded by `record_each` (as they
come) or `record_all`; `of_tasks` maps the (task, result) pairs that loop gives back to parts.

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
        finished = executor.map_unordered(do, [part.task for part in self.todo])
        return self.record_each(self.of_tasks(finished))

    def of_tasks(self, finished: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Part, Any]]:
        """(part, result) for each (task, result) of `finished`, the part whose task it is: the
        parts left are handed out as their `task` objects (to a pool, the actors, an evaluator
        of the stage's own), and those give back the same objects with their results."""
        part_of = {id(part.task): part for part in self.todo}
        for task, result in finished:
            yield part_of[id(task)], result

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

    def record_all(
        self,
        finished: Iterable[tuple[Part, Any]],
        facts: Callable[[Any], dict] | None = None,
    ) -> None:
        """Record every part of `finished` (as `record_each`, to the end)."""
        for _ in self.record_each(finished, facts):
            pass

    def held(self, parts: Iterable[Part]) -> dict[str, dict]:
        """The facts of those of `parts` the ledger holds (or that were recorded since), by
        name."""
        return {part.name: self.facts[part.name] for part in parts if part.name in self.facts}

    def in_order(self) -> dict[str, dict]:
        """Every part's facts by name, in the parts' order (once `run` is exhausted)."""
        return {part.name: self.facts[part.name] for part in self.all}
