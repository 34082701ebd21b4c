"""The stage plan: what decides a stage's output (`stage_plan`), the one rule a rerun follows
with the output it finds (`stage_dir`) and the kinds of output (`kinds`); the parts it records
are its ledger (`ar_slicing.machinery.ledger`)."""

from ar_slicing.machinery.plan.kinds import MarkerDir, StageFile, open_marker, open_stage
from ar_slicing.machinery.plan.stage_dir import StageDir, redoing_changed
from ar_slicing.machinery.plan.stage_plan import (
    PlanMismatch,
    StagePlan,
    differences,
    digest,
    file_identity,
    identity,
    recorded_plan,
    settings_differences,
)

__all__ = [
    "MarkerDir",
    "PlanMismatch",
    "StageDir",
    "StageFile",
    "StagePlan",
    "differences",
    "digest",
    "file_identity",
    "identity",
    "open_marker",
    "open_stage",
    "recorded_plan",
    "redoing_changed",
    "settings_differences",
]
