-- Zero-shot key-value recall of every probed model and checkpoint, per k pairs in context
-- (docs/design.md, "Probes of a checkpoint"): the accuracy (argmax = the value at its query) and
-- the mean NLL of the value there, each with its 95% bootstrap interval over sequences; the
-- model's NLL of the same values where their pair states them (nothing predicts them there);
-- and the baselines: a model uniform over its head (chance_accuracy 1/V, chance_nll ln V) and
-- one that knows a value follows but not which of the k (guess_accuracy 1/k, guess_nll ln k).
-- By distance from pair to query: the view probe_recall_by_distance.
-- $model  one model or checkpoint (a probes folder name), or * for every one (default: *)
SELECT
    r.model,
    p.checkpoint_of,
    p.step,
    r.k,
    r.queries,
    r.accuracy,
    r.accuracy_lo,
    r.accuracy_hi,
    r.nll,
    r.nll_lo,
    r.nll_hi,
    r.pair_value_nll,
    r.chance_accuracy,
    r.chance_nll,
    r.guess_accuracy,
    r.guess_nll
FROM probe_recall_by_k AS r
JOIN probes AS p ON p.model = r.model
WHERE $model::VARCHAR = '*' OR r.model = $model::VARCHAR
ORDER BY coalesce(p.checkpoint_of, r.model), p.step NULLS LAST, r.model, r.k;
