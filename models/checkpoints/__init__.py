"""Checkpoint formats, one file per model-spec prefix, and the registry that loads a spec."""
