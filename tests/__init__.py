"""The test suite, one folder per package it tests (`ar_slicing/`, `models/`, `pipeline/`,
`queries/`), the helpers they share beside this file, and `fixtures/`."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# checkpoints and their losses made by upstream code (fixtures/upstream/make_*.py)
UPSTREAM = FIXTURES / "upstream"
