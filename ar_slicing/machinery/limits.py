"""What this machine allows, and the checks that refuse a setting beyond it before any work: the
memory a step would need (against the machine's, its cgroup's and the process's own limit) and
the time a computation would take (against a day), each refused in one line saying the estimate,
the limit and what to change."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path

from ar_slicing.errors import ArSliceError

# what a stage may take before it is refused as a mistake (`require_time`): a day
LONGEST_S = 24 * 3600


def machine_memory() -> tuple[int, str]:
    """(bytes, what they are) of the memory this process may use at most: the least of the
    machine's physical memory, its cgroup's limit and its own address-space limit."""
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's"))
    with contextlib.suppress(OSError, ValueError):
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text != "max":
            limits.append((int(text), "its cgroup's"))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "this process's address-space limit of"))
    return min(limits) if limits else (1 << 62, "unlimited")


def shown_bytes(n: float) -> str:
    """`3.2 GiB`, `1.1 PiB`: a size as a person reads it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shown_duration(seconds: float) -> str:
    """`45 s`, `3.5 h`, `12 days`, `3,170 years`: a time as a person reads it."""
    for unit, length in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * length or (unit == "h" and seconds >= length):
            return f"{seconds / length:,.1f} {unit}"
    return f"{seconds:,.0f} s"


def require_memory(estimate: float, what: str, fix: str) -> None:
    """Refuse `what` ("--batch-size 1000000000: one step") when its `estimate` in bytes is more
    than this process may use (`machine_memory`), before anything is allocated."""
    limit, whose = machine_memory()
    if estimate > limit:
        raise ArSliceError(
            f"{what} needs about {shown_bytes(estimate)} of memory, more than {whose} "
            f"{shown_bytes(limit)}; {fix}"
        )


def require_time(estimate_s: float, what: str, fix: str, limit_s: float = LONGEST_S) -> None:
    """Refuse `what` when it would take longer than `limit_s` (a day) by `estimate_s`."""
    if estimate_s > limit_s:
        raise ArSliceError(
            f"{what} would take about {shown_duration(estimate_s)} here, more than the "
            f"{shown_duration(limit_s)} a run may take; {fix}"
        )
