"""Tests of `models`: the mixers, the backbone and every checkpoint format."""
