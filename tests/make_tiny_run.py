"""Write the tiny hand-built run of tests/queries/test_queries.py (docs/design.md's worked
example, three models) to a directory, for trying `arslice query` and `arslice report` on numbers
worked out by hand:

    python tests/make_tiny_run.py runs/tiny
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# run as a script: the repository root, so that the `tests` package imports
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import read_stdlib_texts, train_bpe_tokenizer  # noqa: E402
from tests.queries.test_queries import build_tiny_run  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    run = Path(argv[0])
    if run.exists():
        print(f"{run} exists; choose a new directory", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_bpe_tokenizer(read_stdlib_texts(), Path(tmp) / "tokenizer.json")
        build_tiny_run(run, tokenizer)
    print(f"wrote the tiny run to {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
