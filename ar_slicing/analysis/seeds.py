"""Runs of one recipe: models trained the same way from other seeds (docs/design.md, "Runs of one
recipe").

A model named `<recipe>-seed<n>` is run `n` of the recipe `<recipe>`; every other model is a
recipe of its own, and a model named `<recipe>` itself is one more run of it. This is how
published seed suites are named (`EleutherAI/pythia-160m` and `pythia-160m-seed1` ..
`pythia-160m-seed9`), so naming the models of a config after their hub ids groups them:

    >>> recipe_of("pythia-160m-seed3"), recipe_of("pythia-160m"), recipe_of("seed7")
    ('pythia-160m', 'pythia-160m', 'seed7')

Where a recipe has two runs or more, the spread across them is reported point by point (the same
step of every run): the runs' mean, least and greatest value of each statistic.

    >>> rows = [
    ...     {"model": "t", "step": 800, "tokens_seen": 16, "gain": 0.1},
    ...     {"model": "t-seed1", "step": 800, "tokens_seen": 16, "gain": 0.3},
    ...     {"model": "t-seed2", "step": 800, "tokens_seen": 16, "gain": 0.5},
    ...     {"model": "t-seed1", "step": 1600, "tokens_seen": 32, "gain": 0.7},
    ...     {"model": "h", "step": 800, "tokens_seen": 16, "gain": 0.0},
    ... ]
    >>> [(r["recipe"], r["step"], r["runs"], r["gain"], r["gain_min"], r["gain_max"])
    ...  for r in spread_rows(rows, ("gain",))]
    [('t', 800, 3, 0.3, 0.1, 0.5), ('t', 1600, 1, 0.7, 0.7, 0.7)]

(`h` is one run, so it has no spread; `t` at step 1600 has one run there, reported with `runs`
1 so that a table says where the spread is missing.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

SEED_SUFFIX = re.compile(r"^(?P<recipe>.+)-seed(?P<seed>[0-9]+)$")

# results.duckdb's macros of the same rule (`ar_slicing.analysis.slices.definitions_sql`).
MACROS_SQL = (
    "CREATE MACRO recipe_of(model) AS regexp_replace(model, '(.)-seed[0-9]+$', '\\1')",
    "CREATE MACRO seed_of(model) AS "
    "TRY_CAST(regexp_extract(model, '.-seed([0-9]+)$', 1) AS INTEGER)",
)


def recipe_of(model: str) -> str:
    """The recipe a model is a run of: its name less a `-seed<n>` ending."""
    m = SEED_SUFFIX.match(model)
    return m["recipe"] if m else model


def seed_of(model: str) -> int | None:
    """The `n` of a model named `<recipe>-seed<n>`, None for any other name."""
    m = SEED_SUFFIX.match(model)
    return int(m["seed"]) if m else None


def recipes(models: Iterable[str]) -> dict[str, list[str]]:
    """The recipes of `models` (in the order they first appear) with their runs (in order)."""
    out: dict[str, list[str]] = {}
    for model in dict.fromkeys(models):
        out.setdefault(recipe_of(model), []).append(model)
    return out


def seeded(models: Iterable[str]) -> dict[str, list[str]]:
    """The recipes of `models` that have two runs or more."""
    return {r: runs for r, runs in recipes(models).items() if len(runs) > 1}


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def spread_rows(rows: list[dict], keys: tuple[str, ...], model_key: str = "model") -> list[dict]:
    """One row per recipe with two runs or more and per step of any of its runs (by recipe, then
    step): `recipe`, `step`, `tokens_seen`, `runs` (how many runs have the step), `models` (which,
    comma-separated) and for each of `keys` the runs' mean as `<key>`, least `<key>_min` and
    greatest `<key>_max` (over the runs with a value; NaN where none has). `rows` are points with
    `model_key`, `step` and `tokens_seen`; rows without a step (a model that does not record
    where its training ended) are left out."""
    groups = seeded(r[model_key] for r in rows)
    out = []
    for recipe, runs in groups.items():
        mine = [r for r in rows if r[model_key] in runs and r.get("step") is not None]
        for step in sorted({r["step"] for r in mine}):
            at = [r for r in mine if r["step"] == step]
            row = {
                "recipe": recipe,
                "step": step,
                "tokens_seen": at[0].get("tokens_seen"),
                "runs": len(at),
                "models": ",".join(r[model_key] for r in at),
            }
            for key in keys:
                values = [float(r[key]) for r in at if _finite(r.get(key))]
                row[key] = sum(values) / len(values) if values else math.nan
                row[f"{key}_min"] = min(values) if values else math.nan
                row[f"{key}_max"] = max(values) if values else math.nan
            out.append(row)
    return out
