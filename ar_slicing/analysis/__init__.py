"""Analysis: slices, metrics, Table 1, copy length, emergence, results.duckdb, SQL and the Python API."""
