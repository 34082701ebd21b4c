"""`python -m tests.pipeline.mqar_cell ARCH D_MODEL SEQ_LEN LR`: one MQAR cell trained with the
defaults, as `arslice mqar` trains it (one torch thread), its result as JSON."""

from __future__ import annotations

import json
import sys

import torch

from pipeline.mqar import MqarConfig, train_cell

if __name__ == "__main__":
    arch, d_model, seq_len, lr = sys.argv[1:]
    torch.set_num_threads(1)
    cell = train_cell(MqarConfig(out="unused"), arch, int(d_model), int(seq_len), float(lr))
    print(json.dumps(cell))
