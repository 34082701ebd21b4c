"""ar-slicing: split a corpus's validation tokens into associative-recall hits and other tokens.

From Python: `from ar_slicing import open_run; run = open_run("runs/demo")` (`ar_slicing.analysis.api`).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `open_run` and `Run` load on first use, so the CLI and the data stages start without them
    if name in ("open_run", "Run"):
        from ar_slicing.analysis import api

        return getattr(api, name)
    raise AttributeError(f"module 'ar_slicing' has no attribute {name!r}")
