"""Checkpoint formats, one file per model-spec prefix, each registering its loader with
`registry.register_loader` (a new format is one new file here), beside what formats share:
weights-only reads (io.py) and the Mamba-1 and RWKV-4 layouts hf: maps onto this project's
forwards (mamba_ssm.py, hf_rwkv.py)."""
