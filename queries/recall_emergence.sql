-- Recall emergence: the in-context recall gain of every model at each point of its training
-- (its evaluated checkpoints and, when it records its step, the model itself: `final`), with
-- the gain at training count 0 (bigrams never seen in training) and the perplexity on AR hits
-- and on other tokens. Every point of a model is scored on the windows all of its points
-- scored (`checkpoint_windows`), so its rows compare the same tokens; the gain is
-- recall_gain.sql's: per training-count bucket (0, 1-9, 10-99, ...), mean loss of the
-- non-repeats minus that of the repeats, averaged over the buckets holding both, weighted by
-- their repeats; recall_gain_count0 is bucket 0's alone (NULL when it lacks either kind).
-- Bootstrap intervals: `open_run(RUN).emergence()` and the report. Empty without checkpoints.
WITH bucketed AS (
    SELECT
        model,
        checkpoint,
        window_id,
        is_repeat,
        is_ar_hit,
        nll,
        count_bucket(train_count) AS bucket
    FROM checkpoint_token_losses
),
per_bucket AS (
    SELECT
        model,
        checkpoint,
        bucket,
        count(*) FILTER (WHERE is_repeat) AS n_repeats,
        fsum(nll::DOUBLE) FILTER (WHERE NOT is_repeat) / count(*) FILTER (WHERE NOT is_repeat)
            - fsum(nll::DOUBLE) FILTER (WHERE is_repeat) / count(*) FILTER (WHERE is_repeat)
            AS gain
    FROM bucketed
    GROUP BY model, checkpoint, bucket
    HAVING count(*) FILTER (WHERE is_repeat) > 0 AND count(*) FILTER (WHERE NOT is_repeat) > 0
),
gains AS (
    SELECT
        model,
        checkpoint,
        fsum(n_repeats * gain) / sum(n_repeats) AS recall_gain,
        max(gain) FILTER (WHERE bucket = 0) AS recall_gain_count0
    FROM per_bucket
    GROUP BY model, checkpoint
),
slices AS (
    SELECT
        model,
        checkpoint,
        count(DISTINCT window_id) AS n_windows,
        count(*) AS n_tokens,
        count(*) FILTER (WHERE is_ar_hit) AS n_ar_hits,
        exp(fsum(nll::DOUBLE) FILTER (WHERE is_ar_hit) / count(*) FILTER (WHERE is_ar_hit))
            AS ppl_ar,
        exp(fsum(nll::DOUBLE) FILTER (WHERE NOT is_ar_hit) / count(*) FILTER (WHERE NOT is_ar_hit))
            AS ppl_other
    FROM bucketed
    GROUP BY model, checkpoint
)
SELECT
    c.model,
    c.checkpoint,
    c.step,
    c.tokens_seen,
    c.final,
    s.n_windows,
    s.n_tokens,
    s.n_ar_hits,
    g.recall_gain,
    g.recall_gain_count0,
    s.ppl_ar,
    s.ppl_other
FROM checkpoints AS c
JOIN slices AS s ON s.checkpoint = c.checkpoint
LEFT JOIN gains AS g ON g.checkpoint = c.checkpoint
ORDER BY c.model, c.step, c.final, c.checkpoint;
