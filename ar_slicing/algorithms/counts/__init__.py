"""Exact bigram counts of token stores, in modules by job (the stage itself: `pipeline.count`).

keys      counting units, pair keys, `prev` buckets, numpy counting and merging
kernels   the compiled map, merge and hash-table kernels
partials  the map step and its partial files
reduce    the reduce step over one range of `prev`
parquet   bigrams.parquet: schema, the parts reduce tasks write, their join (`parquet_concat`)
regions   the per-`prev` region table that lookups and the tag kernel probe
lookup    `BigramCounts`: a counts directory read back for lookups
"""

from ar_slicing.algorithms.counts.keys import parse_unit
from ar_slicing.algorithms.counts.lookup import BigramCounts
from ar_slicing.algorithms.counts.parquet import bigrams_schema
from ar_slicing.machinery.layout import BIGRAMS_NAME

__all__ = ["BIGRAMS_NAME", "BigramCounts", "bigrams_schema", "parse_unit"]
