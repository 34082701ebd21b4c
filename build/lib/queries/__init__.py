"""SQL questions over a run's `results.duckdb`, one per `.sql` file (`arslice query NAME`).

The files ship inside the installed package (package data), so `arslice query` and `arslice
report` find them whether the project is installed editable or from a wheel.
"""
