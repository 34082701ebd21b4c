"""`arslice run`: the stages of a pipeline config file, resolved from the stages' declarations
(`registry`), checked before anything runs (`checks`), run in order (`stages_run`), with the
config file itself (`config_file`) and the Makefile's stage rules (`make_rules`)."""
