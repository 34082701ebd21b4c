"""`arslice verify`: check the invariants of a run directory and print every one that fails.

Checks, stage by stage (each prints `ok` or `FAIL` with the file and the numbers involved):
  tokens/*     tokens.bin holds exactly n_tokens x itemsize bytes; docs.parquet has n_docs rows
               whose offsets tile the stream; every id is below the vocabulary size; the store's
               tokenizer.json has the fingerprint its meta.json records
  counts       bigrams.parquet: (prev, next) strictly increasing (sorted and unique), every count
               positive, the counts sum to total_pairs and the rows number distinct_bigrams
  tags         windows.parquet is the window table of the validation stream; tag rows are sorted
               by (window_id, pos) and cover every target of the stream exactly once; token and
               prev equal the stream; train_count equals the counts; is_ar_hit follows its rule;
               a repeat's prev_pos is an earlier position of its window with the same bigram;
               recomputed from the stream, every repeat is found and prev_pos is the latest;
               match_len is >= 1 exactly for repeats and equals its recomputation from the
               stream; span_train_count is set exactly for repeats, the bigram's count at 1
  models/*     each model was trained on a store of the run's tokenizer
  losses/*     exactly one loss row per tag row (of the windows evaluated), every nll finite
  everywhere   one tokenizer fingerprint across stores, counts, tags, models and losses

Exit status 0 when every check passes, 2 (with the list of failures) otherwise. Incomplete
outputs (no meta.json: a stage still running or interrupted) are reported and not checked.
"""

from pipeline.verify.checks import Checks, VerifyConfig
from pipeline.verify.run import COMMAND, verify_run

__all__ = ["COMMAND", "Checks", "VerifyConfig", "verify_run"]
