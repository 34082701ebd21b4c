-- Each model against the reference: the gap per slice and the share of it the AR slice explains.
-- delta_log_ppl_T = mean_nll_model(T) - mean_nll_reference(T); delta_ppl_T = ppl_model(T) - ppl_reference(T);
-- ar_share_of_gap = sum over AR hits of (nll_model - nll_reference) / the same sum over all tokens
-- (a fraction: 1.0 = 100%; it may exceed 1 or be negative; NULL where the total gap is exactly 0).
-- Both models score the same tokens (one loss per tag row), so the paired sums are differences of sums.
-- The slices T are Table 1's (ar_slicing/analysis/slices.py), from which results.duckdb's table macro
-- `gap_vs_reference(reference)` is made.
-- $reference  the reference model, a losses folder name; `arslice query` uses the run's
--             default reference (its attention model) when it is not given
SELECT * FROM gap_vs_reference($reference::VARCHAR) ORDER BY model;
