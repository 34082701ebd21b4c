-- Loss by position on the run's own windows (docs/design.md, "Probes of a checkpoint"): per
-- probed model or checkpoint and window position (1..L), the tokens of the slice there and their
-- mean NLL, over the windows the model scored. The in-context learning score compares two of
-- these positions (probe_scores.sql). Empty without `arslice probe`.
-- $slice  a slice of Table 1: all, ar (AR hits) or other (default: all)
SELECT model, pos, tokens, mean_nll
FROM probe_position
WHERE slice = $slice::VARCHAR
ORDER BY model, pos;
