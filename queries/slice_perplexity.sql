-- Per-slice perplexity of every model (Zoology Table 1): all tokens, AR hits, other tokens.
-- mean_nll = mean natural-log loss over the slice, ppl = exp(mean_nll); pct_ar_hits = share of
-- scored tokens that are AR hits. The slices are Table 1's, each declared once with its SQL
-- predicate in ar_slicing/analysis/slices.py, from which results.duckdb's view `slice_perplexity` is
-- made (`slice_token_losses` holds every declared slice). Parameters: none.
SELECT * FROM slice_perplexity ORDER BY model;
