-- Copy-length slices: mean loss of every model per copy-length bucket of the repeats and span-count
-- bucket (docs/copy-length.md). Copy buckets by match_len: 1, 2-3, 4-7, 8-15, 16+ (bucket b >= 1
-- holds 2^(b-1) .. 2^b - 1, the last one everything from there up); bucket 0 'none' holds the
-- non-repeats (match_len 0, no span count). Span buckets by span_train_count: 0 (the copied span
-- never occurs in training), 1-T (rare: T is the run's AR threshold), above T.
-- $max_bucket  the last copy bucket, which holds every longer copy: 5 gives 16+ (default: 5)
-- $by_window  'true' adds window_id, one row per window and cell (what a bootstrap resamples) (default: false)
-- $by_subset  'true' adds the Pile subset, one row per subset and cell (default: false)
WITH threshold AS (
    SELECT value::BIGINT AS t FROM run_info WHERE key = 'threshold'
),
bucketed AS (
    SELECT
        model,
        CASE WHEN $by_window::BOOLEAN THEN window_id END AS window_id,
        CASE WHEN $by_subset::BOOLEAN THEN coalesce(subset, '(none)') END AS subset,
        nll,
        CASE
            WHEN match_len = 0 THEN 0
            -- floor(log2(m)) + 1, computed on m + 0.5 so that no power of two rounds down
            ELSE least(floor(log2(match_len + 0.5))::INTEGER + 1, $max_bucket::INTEGER)
        END AS copy_bucket,
        CASE
            WHEN match_len = 0 THEN NULL
            WHEN span_train_count = 0 THEN 0
            WHEN span_train_count <= (SELECT t FROM threshold) THEN 1
            ELSE 2
        END AS span_bucket
    FROM token_losses
)
SELECT
    model,
    window_id,
    subset,
    copy_bucket,
    CASE
        WHEN copy_bucket = 0 THEN 'none'
        WHEN copy_bucket = $max_bucket::INTEGER THEN (1 << (copy_bucket - 1))::VARCHAR || '+'
        WHEN copy_bucket = 1 THEN '1'
        ELSE (1 << (copy_bucket - 1))::VARCHAR || '-' || ((1 << copy_bucket) - 1)::VARCHAR
    END AS copy_label,
    span_bucket,
    CASE span_bucket
        WHEN 0 THEN '0'
        WHEN 1 THEN '1-' || (SELECT t FROM threshold)::VARCHAR
        WHEN 2 THEN '>' || (SELECT t FROM threshold)::VARCHAR
    END AS span_label,
    count(*) AS n_tokens,
    fsum(nll::DOUBLE) AS sum_nll,
    fsum(nll::DOUBLE) / count(*) AS mean_nll,
    exp(fsum(nll::DOUBLE) / count(*)) AS ppl
FROM bucketed
GROUP BY model, window_id, subset, copy_bucket, span_bucket
ORDER BY model, subset, copy_bucket, span_bucket NULLS FIRST, window_id;
