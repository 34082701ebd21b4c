"""`arslice report`: Table 1, Figure 1 and a browsable HTML report of a run.

Reads the run's tags, every complete `losses/<model>/` and `probes/<model>/` (through `results.duckdb`, built or
refreshed first) and writes, under `<run>/report/`:

  report.md            Table-1-style summary: per model, parameters, perplexity on all tokens /
                       AR hits / other tokens with bootstrap 95% intervals over windows, Δ log-ppl
                       vs the reference per slice, and the AR share of the gap; then the gap,
                       per-subset and example tables
  report.html          one self-contained file (figures inline as base64, no external assets):
                       the same tables, the figures, and a passage viewer showing validation
                       windows token by token, AR hits underlined, coloured by each model's loss
  frequency_curve.png  log perplexity per training-count decade bucket, repeats vs non-repeats,
                       one colour per model (the paper's Figure 1)
  slice_bars.png       perplexity per slice per model with the bootstrap intervals
  emergence.png        in a run with checkpoints along training: the recall gain against the
                       training tokens seen, one line per model (with its table in report.md)
  probes.png           in a run with probes (`arslice probe`): the induction loss by position,
                       zero-shot recall accuracy against k and the loss by window position per
                       slice, one colour per model (with the probes' table in report.md)
  probes_training.png  with probed checkpoints too: the induction score, zero-shot recall and the
                       recall gain against the training tokens seen
  *.csv                every table: table1, and one per query of queries/ (and emergence, probes)
  meta.json            written last (inputs signature, resolved config, counts, timings)

Every table except Table 1 is the result of the same `queries/*.sql` file that `arslice query`
runs, so the report and ad-hoc SQL agree by construction. A complete report is skipped unless
`--overwrite` or its inputs (tags, losses, config) changed since it was written.
"""

from pipeline.report.config import ReportConfig
from pipeline.report.passages import choose_windows, decode_pieces, load_passages
from pipeline.report.stage import COMMAND, run_report

__all__ = [
    "COMMAND",
    "ReportConfig",
    "choose_windows",
    "decode_pieces",
    "load_passages",
    "run_report",
]
