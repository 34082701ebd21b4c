"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""


class ArSliceError(Exception):
    """A problem with the user's input or environment that the message explains how to fix."""


class TokenizerMismatch(ArSliceError):
    """Two artefacts (stores, counts, tags, models) were made with different tokenizers."""


class BadInput(ArSliceError):
    """A malformed input file: the message names the file and the line or byte offset."""
