"""Tests of `queries`: every question of queries/*.sql on runs built by hand."""
