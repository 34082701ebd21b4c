"""ar-slicing: split a corpus's validation tokens into associative-recall hits and other tokens."""

__version__ = "0.1.0"
