"""Sequence and state mixers, one file per mixer as Zoology keeps `zoology/mixers/`."""
