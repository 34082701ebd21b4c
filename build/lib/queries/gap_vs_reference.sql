-- Each model against the reference: the gap per slice and the share of it the AR slice explains.
-- delta_log_ppl_T = mean_nll_model(T) - mean_nll_reference(T); delta_ppl_T = ppl_model(T) - ppl_reference(T);
-- ar_share_of_gap = sum over AR hits of (nll_model - nll_reference) / the same sum over all tokens
-- (a fraction: 1.0 = 100%; it may exceed 1 or be negative; NULL where the total gap is exactly 0).
-- Both models score the same tokens (one loss per tag row), so the paired sums are differences of sums.
-- $reference  the reference model, a losses folder name; `arslice query` uses the run's
--             default reference (its attention model) when it is not given
WITH per_model AS (
    SELECT
        model,
        count(*) AS n_all,
        count(*) FILTER (WHERE is_ar_hit) AS n_ar,
        fsum(nll::DOUBLE) AS s_all,
        coalesce(fsum(nll::DOUBLE) FILTER (WHERE is_ar_hit), 0) AS s_ar
    FROM token_losses
    GROUP BY model
),
slices AS (
    SELECT
        model, n_all, n_ar, s_all, s_ar,
        s_all / n_all AS mean_all,
        s_ar / nullif(n_ar, 0) AS mean_ar,
        (s_all - s_ar) / nullif(n_all - n_ar, 0) AS mean_other
    FROM per_model
),
ref AS (
    SELECT * FROM slices WHERE model = $reference::VARCHAR
)
SELECT
    m.model,
    r.model AS reference,
    m.n_all AS n_tokens,
    m.mean_all - r.mean_all AS delta_log_ppl_all,
    m.mean_ar - r.mean_ar AS delta_log_ppl_ar,
    m.mean_other - r.mean_other AS delta_log_ppl_other,
    exp(m.mean_all) - exp(r.mean_all) AS delta_ppl_all,
    exp(m.mean_ar) - exp(r.mean_ar) AS delta_ppl_ar,
    exp(m.mean_other) - exp(r.mean_other) AS delta_ppl_other,
    (m.s_ar - r.s_ar) / nullif(m.s_all - r.s_all, 0) AS ar_share_of_gap
FROM slices AS m
CROSS JOIN ref AS r
ORDER BY m.model;
