"""Tests of `pipeline`: each stage, `arslice` and `arslice run`, and the whole CLI under faults."""
