"""The Makefile's stage rules, written from the run layout and the stage table.

`arslice run --make-rules` writes them to `<run_dir>/.settings/stages.mk` (only when they change)
and the Makefile includes that file, so the make targets name exactly the files the stages
write, and each stage target depends on the stage's settings file and on the markers of the
stages it reads::

    MARK_tag := runs/demo/tags/meta.json
    runs/demo/tags/meta.json: runs/demo/.settings/tag.json runs/demo/tokens/train/meta.json ...
        $(STAGE) tag
"""

from __future__ import annotations

from ar_slicing.layout import RunLayout
from pipeline.stages import PIPELINE, PIPELINE_STAGES


def _quoted(path) -> str:
    # make splits on spaces and treats $ and # specially
    return str(path).replace("$", "$$").replace("#", "\\#").replace(" ", "\\ ")


def make_rules(layout: RunLayout) -> str:
    lines = [
        "# Written by `arslice run --make-rules` from the run layout (ar_slicing/layout.py) and",
        "# the stage table (pipeline/stages.py); rewritten when they change. Do not edit.",
        "",
    ]
    for stage in PIPELINE_STAGES:
        markers = " ".join(_quoted(p) for p in layout.markers(stage))
        lines.append(f"MARK_{stage} := {markers}")
    lines.append("")
    for stage in PIPELINE_STAGES:
        markers = " ".join(_quoted(p) for p in layout.markers(stage))
        needs = [_quoted(layout.settings(stage))]
        for before in PIPELINE[stage].after:
            needs += [_quoted(p) for p in layout.markers(before)]
        group = " &:" if len(layout.markers(stage)) > 1 else ":"
        lines.append(f"{markers}{group} {' '.join(needs)}")
        lines.append(f"\t$(STAGE) {stage}")
        lines.append("")
    return "\n".join(lines)
