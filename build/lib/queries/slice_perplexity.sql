-- Per-slice perplexity of every model (Zoology Table 1): all tokens, AR hits, other tokens.
-- mean_nll = mean natural-log loss over the slice, ppl = exp(mean_nll); pct_ar_hits = share of
-- scored tokens that are AR hits. Parameters: none.
SELECT
    tl.model,
    any_value(m.architecture) AS architecture,
    any_value(m.n_params) AS n_params,
    count(*) AS n_tokens,
    count(*) FILTER (WHERE tl.is_ar_hit) AS n_ar_hits,
    100.0 * count(*) FILTER (WHERE tl.is_ar_hit) / count(*) AS pct_ar_hits,
    fsum(tl.nll::DOUBLE) / count(*) AS mean_nll_all,
    exp(fsum(tl.nll::DOUBLE) / count(*)) AS ppl_all,
    fsum(tl.nll::DOUBLE) FILTER (WHERE tl.is_ar_hit)
        / nullif(count(*) FILTER (WHERE tl.is_ar_hit), 0) AS mean_nll_ar,
    exp(fsum(tl.nll::DOUBLE) FILTER (WHERE tl.is_ar_hit)
        / nullif(count(*) FILTER (WHERE tl.is_ar_hit), 0)) AS ppl_ar,
    fsum(tl.nll::DOUBLE) FILTER (WHERE NOT tl.is_ar_hit)
        / nullif(count(*) FILTER (WHERE NOT tl.is_ar_hit), 0) AS mean_nll_other,
    exp(fsum(tl.nll::DOUBLE) FILTER (WHERE NOT tl.is_ar_hit)
        / nullif(count(*) FILTER (WHERE NOT tl.is_ar_hit), 0)) AS ppl_other
FROM token_losses AS tl
LEFT JOIN models AS m ON m.model = tl.model
GROUP BY tl.model
ORDER BY tl.model;
