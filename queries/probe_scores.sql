-- Probes of every model and checkpoint (docs/design.md, "Probes of a checkpoint"), one row
-- each, by model then step: the induction score on repeated random tokens (mean first-copy NLL
-- minus mean second-copy NLL, nats, with its 95% bootstrap interval over sequences) and the
-- argmax accuracy on the second copy; zero-shot key-value recall accuracy averaged over the k
-- probed (each k weighted alike; per k: probe_recall.sql) and at the largest k; and the
-- in-context learning score on the run's windows (mean NLL at the late position minus the
-- early one, negative when later tokens are predicted better) for all tokens, AR hits and the
-- other tokens. `checkpoint_of` and `step` place a checkpoint along its model's training (its
-- recall gain there: recall_emergence.sql). Empty without `arslice probe`. Parameters: none.
WITH recall AS (
    SELECT
        model,
        avg(accuracy) AS recall_accuracy,
        arg_max(accuracy, k) AS recall_accuracy_max_k,
        max(k) AS max_k
    FROM probe_recall_by_k
    GROUP BY model
),
icl AS (
    SELECT
        model,
        any_value(early) AS icl_early,
        any_value(late) AS icl_late,
        max(score) FILTER (WHERE slice = 'all') AS icl_all,
        max(score) FILTER (WHERE slice = 'ar') AS icl_ar,
        max(score) FILTER (WHERE slice = 'other') AS icl_other
    FROM probe_icl
    GROUP BY model
)
SELECT
    p.model,
    coalesce(p.checkpoint_of, p.model) AS of_model,
    p.step,
    p.tokens_seen,
    i.score AS induction_score,
    i.score_lo AS induction_score_lo,
    i.score_hi AS induction_score_hi,
    i.first_nll,
    i.second_nll,
    i.second_accuracy,
    r.recall_accuracy,
    r.max_k,
    r.recall_accuracy_max_k,
    c.icl_early,
    c.icl_late,
    c.icl_all,
    c.icl_ar,
    c.icl_other
FROM probes AS p
JOIN probe_induction_scores AS i ON i.model = p.model
JOIN recall AS r ON r.model = p.model
JOIN icl AS c ON c.model = p.model
ORDER BY of_model, p.step NULLS LAST, p.model;
