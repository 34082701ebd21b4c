-- Per-slice perplexity of every model within each Pile subset (docs.parquet `subset`, e.g.
-- "Github", "ArXiv"; "(none)" where the corpus records none): the columns of slice_perplexity,
-- from results.duckdb's view `slice_perplexity_by_subset` (ar_slicing/analysis/slices.py). Parameters: none.
SELECT * FROM slice_perplexity_by_subset ORDER BY model, n_tokens DESC, subset;
