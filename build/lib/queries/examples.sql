-- Windows where a model loses most against the reference on AR hits: per model, the $limit
-- windows with the largest excess loss summed over their AR hits (nats), worst first. `start` is
-- the stream index of the window's first context token (tags/windows.parquet).
-- $reference  the reference model, a losses folder name; `arslice query` uses the run's
--             default reference (its attention model) when it is not given
-- $limit      windows per model (default: 10)
WITH ar AS (
    SELECT window_id, pos FROM tags WHERE is_ar_hit
),
ref AS (
    SELECT window_id, pos, nll FROM losses WHERE model = $reference::VARCHAR
),
per_window AS (
    SELECT
        l.model,
        l.window_id,
        count(*) AS n_ar_hits,
        fsum(l.nll::DOUBLE - r.nll::DOUBLE) AS excess_nll_ar,
        fsum(l.nll::DOUBLE) / count(*) AS mean_nll_ar,
        fsum(r.nll::DOUBLE) / count(*) AS reference_mean_nll_ar
    FROM losses AS l
    JOIN ar ON ar.window_id = l.window_id AND ar.pos = l.pos
    JOIN ref AS r ON r.window_id = l.window_id AND r.pos = l.pos
    WHERE l.model <> $reference::VARCHAR
    GROUP BY l.model, l.window_id
)
SELECT
    p.model,
    p.window_id,
    w.start,
    w.n_targets,
    p.n_ar_hits,
    p.excess_nll_ar,
    p.mean_nll_ar,
    p.reference_mean_nll_ar
FROM per_window AS p
JOIN windows AS w ON w.window_id = p.window_id
QUALIFY row_number() OVER (PARTITION BY p.model ORDER BY p.excess_nll_ar DESC, p.window_id)
    <= $limit::BIGINT
ORDER BY p.model, p.excess_nll_ar DESC, p.window_id;
