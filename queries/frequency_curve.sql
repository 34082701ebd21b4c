-- Zoology Figure 1: mean loss per decade bucket of the bigram's training count, repeats vs
-- non-repeats, per model. Buckets: 0 (never seen in training), 1-9, 10-99, 100-999, ...
-- `bucket` is the number of decimal digits of train_count (0 for a count of 0): results.duckdb's
-- macro count_bucket, with count_bucket_lo/_hi/_label (ar_slicing/analysis/slices.py).
-- Parameters: none.
WITH bucketed AS (
    SELECT
        model,
        is_repeat,
        nll,
        count_bucket(train_count) AS bucket
    FROM token_losses
)
SELECT
    model,
    bucket,
    count_bucket_lo(bucket) AS count_lo,
    count_bucket_hi(bucket) AS count_hi,
    count_bucket_label(bucket) AS bucket_label,
    is_repeat,
    count(*) AS n_tokens,
    fsum(nll::DOUBLE) / count(*) AS mean_nll,
    exp(fsum(nll::DOUBLE) / count(*)) AS ppl
FROM bucketed
GROUP BY model, bucket, is_repeat
ORDER BY model, is_repeat DESC, bucket;
