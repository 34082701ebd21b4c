"""Tests of `ar_slicing`: the data side, from readers and token stores to tags and the plan."""
