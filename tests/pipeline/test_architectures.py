"""The one table of architectures (pipeline/architectures.py): every name the trainer takes
builds a model through the trainer's own path, every name mqar takes builds Figure 2's model,
and both commands' choices and help texts are the table's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.architectures import (
    ARCHITECTURE_TABLE,
    MQAR_ARCHITECTURES,
    MQAR_DEFAULT,
    TRAIN_ARCHITECTURES,
)


def choices(config_cls, name: str) -> list[str]:
    return next(f for f in dataclasses.fields(config_cls) if f.name == name).metadata["choices"]


@pytest.mark.parametrize("arch", TRAIN_ARCHITECTURES)
def test_every_trained_architecture_builds_through_the_trainer(arch):
    from pipeline.train import TrainConfig, model_config_for
    from pipeline.train.state import build_model

    cfg = TrainConfig(arch=arch, tokens="-", out="-", d_model=32, n_layers=2, seq_len=64)
    model = build_model(model_config_for(cfg, vocab_size=128), device="cpu")
    assert model(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 128)


@pytest.mark.parametrize("arch", MQAR_ARCHITECTURES)
def test_every_mqar_architecture_builds_figure_2s_model(arch):
    from pipeline.mqar import build_model

    model = build_model(arch, d_model=32, seq_len=64, vocab_size=128)
    assert model(torch.zeros(1, 64, dtype=torch.long)).shape == (1, 64, 128)


def test_the_commands_choices_and_help_are_the_tables(capsys):
    from pipeline.cli import main
    from pipeline.mqar import MqarConfig
    from pipeline.train import TrainConfig

    names = [a.name for a in ARCHITECTURE_TABLE]
    assert len(set(names)) == len(names)
    assert choices(TrainConfig, "arch") == TRAIN_ARCHITECTURES
    assert choices(MqarConfig, "archs") == MQAR_ARCHITECTURES
    assert MqarConfig(out="-").archs == MQAR_DEFAULT
    assert "transformer_pp" in TRAIN_ARCHITECTURES and "transformer_pp" not in MQAR_ARCHITECTURES
    assert "based" in MQAR_DEFAULT and "based" not in TRAIN_ARCHITECTURES
    for command, listed in (("train", TRAIN_ARCHITECTURES), ("mqar", MQAR_ARCHITECTURES)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for arch in ARCHITECTURE_TABLE:
            assert (f"{arch.name} ({arch.what})" in text) == (arch.name in listed), (command, arch)
