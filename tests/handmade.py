"""Outputs made by hand for the tests and benchmarks that need one without running its stage:
the meta.json that marks such a folder complete, as the stage would write it."""

from __future__ import annotations

from pathlib import Path


def write_handmade_meta(out, stage: str, *, counts: dict | None = None, **fields) -> Path:
    """`out`'s meta.json as `stage` writes it (`ar_slicing.machinery.io.build_meta`): no config, inputs or
    timings of its own, `counts` and `fields` as given."""
    from ar_slicing.machinery.io import build_meta, write_meta

    meta = build_meta(stage, config={}, inputs={}, counts=counts or {}, wall_time_s=0, **fields)
    return write_meta(out, meta)
