-- Per-slice perplexity of every model within each Pile subset (docs.parquet `subset`, e.g.
-- "Github", "ArXiv"; "(none)" where the corpus records none). Parameters: none.
SELECT
    model,
    coalesce(subset, '(none)') AS subset,
    count(*) AS n_tokens,
    count(*) FILTER (WHERE is_ar_hit) AS n_ar_hits,
    100.0 * count(*) FILTER (WHERE is_ar_hit) / count(*) AS pct_ar_hits,
    fsum(nll::DOUBLE) / count(*) AS mean_nll_all,
    exp(fsum(nll::DOUBLE) / count(*)) AS ppl_all,
    fsum(nll::DOUBLE) FILTER (WHERE is_ar_hit)
        / nullif(count(*) FILTER (WHERE is_ar_hit), 0) AS mean_nll_ar,
    exp(fsum(nll::DOUBLE) FILTER (WHERE is_ar_hit)
        / nullif(count(*) FILTER (WHERE is_ar_hit), 0)) AS ppl_ar,
    fsum(nll::DOUBLE) FILTER (WHERE NOT is_ar_hit)
        / nullif(count(*) FILTER (WHERE NOT is_ar_hit), 0) AS mean_nll_other,
    exp(fsum(nll::DOUBLE) FILTER (WHERE NOT is_ar_hit)
        / nullif(count(*) FILTER (WHERE NOT is_ar_hit), 0)) AS ppl_other
FROM token_losses
GROUP BY model, coalesce(subset, '(none)')
ORDER BY model, n_tokens DESC, subset;
