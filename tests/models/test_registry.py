"""The checkpoint-format registry: every format is found among the modules of models/checkpoints,
and what the project knows of a format (its prefix, the hub rules, --model-config) is its
registration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ar_slicing.errors import ArSliceError
from models import load_model
from models.checkpoints import registry


def test_the_formats_are_found_in_their_package_in_listing_order():
    found = registry.formats()
    names = ["hf", "zoology", "safari", "based", "native", "h3", "retnet"]
    assert [f.prefix for f in found] == names
    assert {f.prefix for f in found if f.hub} == {"hf", "safari", "based", "h3"}
    assert {f.prefix for f in found if f.model_config} == {
        "zoology", "safari", "based", "h3", "retnet"
    }  # fmt: skip
    assert [f.load.__module__ for f in found] == [f"models.checkpoints.{name}" for name in names]


def test_a_registered_format_is_accepted_listed_and_loaded(monkeypatch):
    registry.formats()  # the package's own formats, found first
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    requests = []

    @registry.register_loader("toy", order=9, hub=True)
    def load_toy(request):
        requests.append(request)
        return "the toy model"

    parsed = registry.ModelSpec.parse("toy:owner/name@v1")
    assert (parsed.prefix, parsed.target, parsed.revision, parsed.is_hub) == (
        "toy", "owner/name", "v1", True,
    )  # fmt: skip
    assert registry.reads_hub_models("toy") and not registry.reads_hub_models("native")
    with pytest.raises(
        ArSliceError, match="one of hf:, zoology:, safari:, based:, native:, h3:, retnet:, toy:"
    ):
        registry.ModelSpec.parse("gguf:model.bin")
    assert registry.spec_forms().endswith(
        ", native:<dir>, h3:<hub id, file or dir>, retnet:<file or dir>, toy:<hub id or dir>"
    )
    with pytest.raises(ArSliceError, match="; hf:, native: and toy: directories carry"):
        load_model("toy:./weights", model_config="config.json")
    # a bare name is a hub id only for a format registered with bare_hub_ids (hf:)
    assert not registry.ModelSpec.parse("toy:gpt2").is_hub
    assert registry.ModelSpec.parse("hf:gpt2").is_hub
    assert registry.ModelSpec.parse("toy:gpt2").path == Path("gpt2")
    with pytest.raises(ArSliceError, match=r"toy:gpt2@v1: a revision \(@v1\) applies to hub ids"):
        registry.ModelSpec.parse("toy:gpt2@v1")
    assert load_model("toy:./weights", device="cpu") == "the toy model"
    (request,) = requests
    assert (request.spec, request.target, request.is_hub, request.commit) == (
        "toy:./weights", "./weights", False, None,
    )  # fmt: skip


def test_eval_help_lists_the_formats_as_registered():
    from pipeline.cli import build_parser

    text = " ".join(build_parser("eval")[0].format_help().split())
    forms = "hf:<hub id or dir>, zoology:<file or dir>, safari:<hub id, file or dir>, "
    more = "native:<dir>, h3:<hub id, file or dir>, retnet:<file or dir>"
    assert f"--model MODEL model spec: {forms}based:<hub id or dir>, {more}" in text
    assert (
        "--model-config MODEL_CONFIG zoology:, safari:, based:, h3: or retnet: model config file"
        in text
    )


def test_reading_a_spec_imports_neither_torch_nor_transformers():
    """Finding the formats imports every module of models/checkpoints: each keeps its heavy
    imports inside its functions, so checking a spec (as every --dry-run does) stays fast."""
    code = (
        "import sys\n"
        "from models.checkpoints.registry import ModelSpec, formats\n"
        "ModelSpec.parse('hf:gpt2'); assert len(formats()) == 7\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
