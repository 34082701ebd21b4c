-- Zoology Figure 1: mean loss per decade bucket of the bigram's training count, repeats vs
-- non-repeats, per model. Buckets: 0 (never seen in training), 1-9, 10-99, 100-999, ...
-- `bucket` is the number of decimal digits of train_count (0 for a count of 0).
-- Parameters: none.
WITH bucketed AS (
    SELECT
        model,
        is_repeat,
        nll,
        CASE WHEN train_count <= 0 THEN 0 ELSE length(train_count::VARCHAR) END AS bucket
    FROM token_losses
)
SELECT
    model,
    bucket,
    CASE WHEN bucket = 0 THEN 0 ELSE pow(10, bucket - 1)::BIGINT END AS count_lo,
    CASE WHEN bucket = 0 THEN 0 ELSE pow(10, bucket)::BIGINT - 1 END AS count_hi,
    CASE
        WHEN bucket = 0 THEN '0'
        ELSE pow(10, bucket - 1)::BIGINT::VARCHAR || '-' || (pow(10, bucket)::BIGINT - 1)::VARCHAR
    END AS bucket_label,
    is_repeat,
    count(*) AS n_tokens,
    fsum(nll::DOUBLE) / count(*) AS mean_nll,
    exp(fsum(nll::DOUBLE) / count(*)) AS ppl
FROM bucketed
GROUP BY model, bucket, is_repeat
ORDER BY model, is_repeat DESC, bucket;
