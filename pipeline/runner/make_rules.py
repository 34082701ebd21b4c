"""The Makefile's stage rules, written from the stages' declarations and the run layout.

`arslice run --make-rules` writes them to `<run_dir>/.settings/stages.mk` (only when they change)
and the Makefile includes that file, so the make targets name exactly the files the stages
write (the markers of each stage's output, `pipeline.wiring`), and each stage target depends on
the stage's settings file and on the markers of the stages it reads::

    MARK_tag := runs/demo/tags/meta.json
    runs/demo/tags/meta.json: runs/demo/.settings/tag.json runs/demo/tokens/train/meta.json ...
        $(STAGE) tag
"""

from __future__ import annotations

from ar_slicing.machinery.layout import RunLayout
from pipeline.runner.registry import after, pipeline_stages


def _quoted(path) -> str:
    # make splits on spaces and treats $ and # specially
    return str(path).replace("$", "$$").replace("#", "\\#").replace(" ", "\\ ")


def make_rules(layout: RunLayout, stages: dict | None = None) -> str:
    """The rules of `stages` (by name, in running order: a run's `Pipeline.run_stages`; every
    pipeline stage by default)."""
    stages = pipeline_stages() if stages is None else stages
    markers = {name: s.pipeline.writes.markers(layout) for name, s in stages.items()}
    lines = [
        "# Written by `arslice run --make-rules` from the run layout (ar_slicing/machinery/layout.py) and",
        "# the stages' declarations (pipeline/runner/registry.py); rewritten when they change.",
        "# Do not edit.",
        "",
    ]
    for name in stages:
        lines.append(f"MARK_{name} := {' '.join(_quoted(p) for p in markers[name])}")
    lines.append("")
    for name, stage in stages.items():
        needs = [_quoted(layout.settings(name))]
        for before in after(stage, stages):
            needs += [_quoted(p) for p in markers[before]]
        group = " &:" if len(markers[name]) > 1 else ":"
        lines.append(f"{' '.join(_quoted(p) for p in markers[name])}{group} {' '.join(needs)}")
        lines.append(f"\t$(STAGE) {name}")
        lines.append("")
    return "\n".join(lines)
