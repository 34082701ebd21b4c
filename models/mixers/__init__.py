"""Sequence and state mixers, one file per mixer as Zoology keeps `zoology/mixers/`, each a
`base.Mixer` whose options are one `@dataclass`."""
