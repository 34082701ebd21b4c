"""The verify command's config and the collector of check outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import say

# Rows read at a time: bounds memory on Pile-sized tables.
BATCH_ROWS = 1 << 22


@dataclass(frozen=True)
class VerifyConfig:
    run: str = field(metadata={"help": "run directory (runs/<name>) to check"})
    scan_tokens: bool = field(
        default=True,
        metadata={
            "help": "read every token of the stores (ids below the vocabulary, tags equal to the "
            "stream); --no-scan-tokens checks sizes, tables and losses only"
        },
    )


class Checks:
    """Collects check outcomes; prints each one as it is decided."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0
        self.notes: list[str] = []

    def ok(self, what: str) -> None:
        self.passed += 1
        say(f"  ok    {what}")

    def fail(self, what: str) -> None:
        self.failures.append(what)
        say(f"  FAIL  {what}")

    def note(self, what: str) -> None:
        self.notes.append(what)
        say(f"  note  {what}")

    def check(self, condition: bool, what: str, why: str = "") -> bool:
        if condition:
            self.ok(what)
        else:
            self.fail(f"{what}: {why}" if why else what)
        return bool(condition)
