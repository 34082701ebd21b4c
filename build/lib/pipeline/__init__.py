"""The pipeline stages (tokenize, count, tag, eval, report, ...), their configs and the CLI."""
