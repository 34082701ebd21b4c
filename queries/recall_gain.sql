-- In-context recall gain of every model, in nats, with its breakdown by training-count bucket.
-- No reference model is needed. Within each decade bucket of the training count (0, 1-9,
-- 10-99, ... as in frequency_curve), gain = mean loss of the non-repeats - mean loss of the
-- repeats; the model's gain is the repeat-weighted mean over the buckets holding both kinds,
-- sum(n_repeats * gain) / sum(n_repeats). Positive: a bigram is
-- predicted better when it already occurred in the context than an equally frequent one that
-- did not. Per model: one row with bucket NULL and bucket_label 'all' (the gain; NULL when no
-- bucket holds both kinds), then one row per bucket holding both (its gain and its weight, the
-- bucket's share of the repeats that count); n_* count scored tokens.
-- $max_train_count  only bigrams seen at most this many times in training, -1 for all (default: -1)
WITH bucketed AS (
    SELECT
        model,
        is_repeat,
        nll,
        count_bucket(train_count) AS bucket
    FROM token_losses
    WHERE $max_train_count::BIGINT < 0 OR train_count <= $max_train_count::BIGINT
),
per_bucket AS (
    SELECT
        model,
        bucket,
        count(*) FILTER (WHERE is_repeat) AS n_repeats,
        count(*) FILTER (WHERE NOT is_repeat) AS n_non_repeats,
        fsum(nll::DOUBLE) FILTER (WHERE is_repeat) / count(*) FILTER (WHERE is_repeat)
            AS mean_nll_repeats,
        fsum(nll::DOUBLE) FILTER (WHERE NOT is_repeat) / count(*) FILTER (WHERE NOT is_repeat)
            AS mean_nll_non_repeats
    FROM bucketed
    GROUP BY model, bucket
    HAVING count(*) FILTER (WHERE is_repeat) > 0 AND count(*) FILTER (WHERE NOT is_repeat) > 0
),
gains AS (
    SELECT *, mean_nll_non_repeats - mean_nll_repeats AS gain FROM per_bucket
)
SELECT
    m.model,
    NULL::INTEGER AS bucket,
    'all' AS bucket_label,
    coalesce(sum(g.n_repeats), 0)::BIGINT AS n_repeats,
    coalesce(sum(g.n_non_repeats), 0)::BIGINT AS n_non_repeats,
    NULL::DOUBLE AS mean_nll_repeats,
    NULL::DOUBLE AS mean_nll_non_repeats,
    fsum(g.n_repeats * g.gain) / nullif(sum(g.n_repeats), 0) AS gain,
    CASE WHEN sum(g.n_repeats) > 0 THEN 1.0 END AS weight
FROM models AS m
LEFT JOIN gains AS g ON g.model = m.model
GROUP BY m.model
UNION ALL
SELECT
    model,
    bucket,
    count_bucket_label(bucket) AS bucket_label,
    n_repeats,
    n_non_repeats,
    mean_nll_repeats,
    mean_nll_non_repeats,
    gain,
    n_repeats / sum(n_repeats) OVER (PARTITION BY model) AS weight
FROM gains
ORDER BY model, bucket NULLS FIRST;
