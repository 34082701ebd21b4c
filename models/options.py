"""Typed mixer options: each mixer's keyword options are one `@dataclass`, and a key it does not
define is refused by name (with the mixer and the keys it accepts), never silently dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from ar_slicing.errors import ArSliceError

T = TypeVar("T")


def options_from(cls: type[T], values: Mapping[str, Any] | T | None, mixer: str) -> T:
    """`cls(**values)`, refusing keys `cls` does not define. `mixer` names it in the message,
    e.g. "sequence mixer 'hyena'"."""
    if isinstance(values, cls):
        return values
    values = dict(values or {})
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(accepted))
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        raise ArSliceError(
            f"{mixer}: unknown option{'s' if len(unknown) > 1 else ''} {keys}; "
            f"it accepts {', '.join(accepted) if accepted else 'no options'}"
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ArSliceError(f"{mixer}: {e}") from None


def options_dict(options) -> dict[str, Any]:
    """The resolved options as a plain dict (what a saved config records)."""
    return dataclasses.asdict(options)
