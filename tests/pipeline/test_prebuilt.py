"""Prebuilt models (`pipeline.train.prebuilt`): a run's trained models written to a folder in bf16
(`arslice export-models`, `make demo-models`), taken by another run instead of trained when they
were made with the same settings from the same token streams, refused otherwise, and trained
with `--train-here`; the losses are the same both ways."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import tomllib

from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import read_json
from pipeline.runner.run import RunConfig, run_pipeline
from pipeline.train.prebuilt import PrebuiltMismatch
from tests.conftest import small_pipeline_config

UP_TO_TRAIN = ["tokenizer", "tokenize", "train"]


def config_text(root: Path, run: str, *, prebuilt: Path | None = None, **train: str) -> str:
    """The small pipeline under `root/<run>`, its models saved in bf16 and keeping step 1
    (`prebuilt`: taken from that folder); `train` adds or replaces [train] keys."""
    text = small_pipeline_config(root).replace(f'"{root}/run"', f'"{root}/{run}"')
    lines = {"saved_dtype": '"bf16"', "keep_checkpoints": "[1]", **train}
    if prebuilt is not None:
        lines["prebuilt"] = f'"{prebuilt}"'
    head = "[train]\n"
    body = "".join(f"{k} = {v}\n" for k, v in lines.items())
    for key in lines:  # (a key of the small config is replaced)
        text = "\n".join(r for r in text.split("\n") if r.split("=")[0].strip() != key)
    return text.replace(head, head + body)


def run(root: Path, name: str, stages=None, train_here: bool = False, **kw) -> Path:
    config = root / f"{name}.toml"
    config.write_text(config_text(root, name, **kw))
    args = {"stage": stages} if stages else {}
    run_pipeline(RunConfig(config=str(config), train_here=train_here, **args))
    return config


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


MODELS = ("attention", "base_conv")
WEIGHTS = [f"models/{m}/{f}" for m in MODELS for f in ("model.safetensors", "checkpoints/step-1/model.safetensors")]  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Run `made` trains the models here (bf16, keeping step 1) and evaluates them; its models are
    exported to `folder` as `make demo-models` does."""
    from pipeline.export_models import ExportConfig, run_export

    root = tmp_path_factory.mktemp("prebuilt")
    config = run(root, "made")
    folder = root / "demo-models"
    run_export(ExportConfig(config=str(config), out=str(folder), command="make demo-models"))
    return {"root": root, "folder": folder}


def losses(run_dir: Path, name: str) -> np.ndarray:
    frame = pl.read_parquet(run_dir / "losses" / name / "losses-*.parquet").sort("window_id", "pos")
    return frame["nll"].to_numpy()


def test_the_folder_holds_bf16_weights_and_says_how_it_was_made(made):
    from safetensors import safe_open

    folder, made_run = made["folder"], made["root"] / "made"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", *MODELS]
    for model in MODELS:
        assert sorted(str(p.relative_to(folder / model)) for p in (folder / model).rglob("*")) == [
            "checkpoints",
            "checkpoints/step-1",
            "checkpoints/step-1/config.json",
            "checkpoints/step-1/model.safetensors",
            "config.json",
            "model.safetensors",
            "prebuilt.json",
        ]
        with safe_open(str(folder / model / "model.safetensors"), "pt") as f:
            dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118
        assert "torch.bfloat16" in dtypes
        size = (folder / model / "model.safetensors").stat().st_size
        assert size < 0.6 * (made_run / "models" / model / "model.safetensors").stat().st_size
        record = read_json(folder / model / "prebuilt.json")
        assert record["settings"]["saved_dtype"] == "bf16"
        assert record["settings"]["keep_checkpoints"] == [1]
        assert len(record["tokens_sha256"]) == 64 and record["made"]["torch"]
    readme = (folder / "README.md").read_text()
    assert "Made by `make demo-models`" in readme and "DEMO_TRAIN=1" in readme
    assert "Python " in readme and "machine: " in readme and "MB in all" in readme


def test_a_matching_prebuilt_model_is_taken_and_gives_the_same_losses(made):
    root, folder = made["root"], made["folder"]
    run(root, "taken", prebuilt=folder)
    trained, taken = root / "made", root / "taken"
    for path in WEIGHTS:  # the bytes the trainer writes, upcast from the folder's bf16
        assert sha256(taken / path) == sha256(trained / path), path
    for model in MODELS:
        meta = read_json(taken / "models" / model / "meta.json")
        assert meta["prebuilt"]["folder"] == str((folder / model).resolve())
        assert meta["prebuilt"]["made"]["command"] == "make demo-models"
        made_meta = read_json(trained / "models" / model / "meta.json")
        assert meta["plan"]["settings"] == made_meta["plan"]["settings"]
        assert meta["final_val_loss"] == made_meta["final_val_loss"]
        assert "kept 00000001" in meta["ledger"]  # its kept checkpoint, a part like a trained one
        np.testing.assert_array_equal(losses(taken, model), losses(trained, model))
    # the report's numbers, both ways
    assert (taken / "report/table1.csv").read_bytes() == (
        trained / "report/table1.csv"
    ).read_bytes()


def test_the_switch_trains_here_to_the_same_weights(made):
    root, folder = made["root"], made["folder"]
    run(root, "here", stages=UP_TO_TRAIN, prebuilt=folder, train_here=True)
    resolved = tomllib.loads((root / "here" / "config.toml").read_text())
    assert "prebuilt" not in resolved["train"]  # the resolved config says what ran
    for model in MODELS:
        assert "prebuilt" not in read_json(root / "here" / "models" / model / "meta.json")
    for path in WEIGHTS:
        assert sha256(root / "here" / path) == sha256(root / "made" / path), path


def test_another_setting_is_refused_before_anything_runs(made):
    root, folder = made["root"], made["folder"]
    with pytest.raises(BadInput) as err:  # (both models: one message naming each problem)
        run(root, "lr", stages=UP_TO_TRAIN, prebuilt=folder, lr="0.002")
    message = str(err.value)
    assert f"the prebuilt model {folder / 'attention'} was made with other settings" in message
    assert "settings.lr: 0.003 -> 0.002" in message
    assert "make all DEMO_TRAIN=1" in message and "min on" in message
    assert not (root / "lr").exists()  # refused before any stage wrote anything


def with_records(folder: Path, to: Path, change) -> Path:
    """A copy of the prebuilt `folder` whose records' settings `change(settings)` edits."""
    import json

    shutil.copytree(folder, to)
    for model in MODELS:
        path = to / model / "prebuilt.json"
        record = read_json(path)
        change(record["settings"])
        path.write_text(json.dumps(record, indent=2, sort_keys=True))
    return to


def test_a_folder_made_before_the_pin_is_taken_as_its_files(made, tmp_path):
    """A record without `cpu_kernels` (exported before training pinned them) is taken, said so
    in meta.json; one made under other kernels is refused naming them."""
    root = made["root"]
    assert read_json(made["folder"] / "attention" / "prebuilt.json")["settings"]["cpu_kernels"]
    before = with_records(made["folder"], tmp_path / "before", lambda s: s.pop("cpu_kernels"))
    run(root, "before", stages=UP_TO_TRAIN, prebuilt=before)
    for path in WEIGHTS:
        assert sha256(root / "before" / path) == sha256(root / "made" / path), path
    meta = read_json(root / "before" / "models" / "attention" / "meta.json")
    assert meta["prebuilt"]["cpu_kernels"] == "not pinned (made before)"
    assert meta["cpu_kernels"]  # (the steps it trained itself: pinned)
    other = with_records(
        made["folder"],
        tmp_path / "other",
        lambda s: s.update(cpu_kernels="ATEN_CPU_CAPABILITY=avx512"),
    )
    with pytest.raises(BadInput, match=r'settings\.cpu_kernels: "ATEN_CPU_CAPABILITY=avx512" ->'):
        run(root, "other", stages=UP_TO_TRAIN, prebuilt=other)
    assert not (root / "other" / "models").exists()


def test_another_token_stream_is_refused_naming_it(made, tmp_path):
    root, folder = made["root"], made["folder"]
    config = root / "stream.toml"
    text = config_text(root, "stream", prebuilt=folder)
    # the tokenized corpus without argparse.py: the same settings, other tokens
    old = 'glob = "a*.py"\nsplit_fraction = 0.3\nworkers'
    assert old in text
    config.write_text(text.replace(old, old.replace("a*.py", "a[!r]*.py")))
    with pytest.raises(PrebuiltMismatch) as err:
        run_pipeline(RunConfig(config=str(config), stage=UP_TO_TRAIN))
    message = str(err.value)
    assert "tokens_sha256: " in message and "settings." not in message
    assert "train it here instead: `make all DEMO_TRAIN=1`" in message
    assert not (root / "stream" / "models" / "attention" / "model.safetensors").exists()
    # a model the folder does not hold
    shutil.copytree(folder, tmp_path / "half")
    shutil.rmtree(tmp_path / "half" / "base_conv")
    with pytest.raises(PrebuiltMismatch, match=r"no prebuilt model .*half/base_conv"):
        run(root, "half", stages=UP_TO_TRAIN, prebuilt=tmp_path / "half")


def test_export_refuses_models_saved_in_fp32(made, tmp_path):
    from pipeline.export_models import ExportConfig, run_export

    root = made["root"]
    config = run(root, "fp32", stages=UP_TO_TRAIN, saved_dtype='"fp32"')
    with pytest.raises(BadInput, match='saved in fp32; .* saved_dtype = "bf16"'):
        run_export(ExportConfig(config=str(config), out=str(tmp_path / "f")))
    # bf16 rounding of the parameters is the only difference between the two trainings' weights
    import torch
    from safetensors.torch import load_file

    from models.checkpoints.native import load_native

    rounded = load_file(str(root / "made/models/attention/model.safetensors"))
    full = load_file(str(root / "fp32/models/attention/model.safetensors"))
    parameters = {n for n, _ in load_native(root / "fp32/models/attention").named_parameters()}
    assert parameters & set(full) and any(not torch.equal(full[k], rounded[k]) for k in full)
    for k, v in full.items():
        assert torch.equal(v.to(torch.bfloat16).float() if k in parameters else v, rounded[k]), k


def test_early_checkpoints_are_trained_here_and_the_folder_holds_the_later_ones(tmp_path):
    """With train_here_until, the folder holds the later checkpoints and the final model only,
    and a run taking the models trains the first steps itself to the same weights."""
    from pipeline.export_models import ExportConfig, run_export

    keep = {"keep_checkpoints": "[1, 2]", "train_here_until": "1"}
    config = run(tmp_path, "made", **keep)
    folder = tmp_path / "models"
    run_export(ExportConfig(config=str(config), out=str(folder), command="make demo-models"))
    for model in MODELS:
        kept = sorted(p.name for p in (folder / model / "checkpoints").iterdir())
        assert kept == ["step-2"]  # step 1 is left to the run that takes the model
        assert read_json(folder / model / "prebuilt.json")["checkpoints_in_folder"] == [2]
    assert "2 (and 1, which a run taking it trains itself)" in (folder / "README.md").read_text()
    run(tmp_path, "taken", stages=UP_TO_TRAIN, prebuilt=folder, **keep)
    for model in MODELS:
        for path in ("model.safetensors", "checkpoints/step-1/model.safetensors",
                     "checkpoints/step-2/model.safetensors"):  # fmt: skip
            made = tmp_path / "made" / "models" / model / path
            assert sha256(tmp_path / "taken" / "models" / model / path) == sha256(made), path
        ledger = read_json(tmp_path / "taken" / "models" / model / "meta.json")["ledger"]
        assert "kept 00000001" in ledger and "kept 00000002" in ledger
    # without train_here_until the folder lacks step 1: refused before anything runs, naming
    # the step and the fix
    with pytest.raises(BadInput) as err:
        run(tmp_path, "all", stages=UP_TO_TRAIN, prebuilt=folder, keep_checkpoints="[1, 2]")
    message = str(err.value)
    assert "lacks the kept checkpoint(s) of step(s) 1 (it holds 2)" in message
    assert "raise train_here_until to 1, or keep only steps the folder holds" in message
    assert not (tmp_path / "all").exists()


def test_a_run_may_keep_other_checkpoints_than_the_folder_was_made_keeping(tmp_path):
    """Which checkpoints a run keeps changes none of its weights, so a folder exported keeping
    [1, 2] (step 1 left to the run) is taken by a run keeping [0, 1, 2] that trains up to step 1
    itself: the same weights at every step, and the run's own list of checkpoints."""
    from pipeline.export_models import ExportConfig, run_export

    config = run(tmp_path, "made", keep_checkpoints="[1, 2]", train_here_until="1")
    folder = tmp_path / "models"
    run_export(ExportConfig(config=str(config), out=str(folder), command="make demo-models"))
    more = {"keep_checkpoints": "[0, 1, 2]", "train_here_until": "1"}
    run(tmp_path, "more", stages=UP_TO_TRAIN, prebuilt=folder, **more)
    for model in MODELS:
        taken = tmp_path / "more" / "models" / model
        for path in ("model.safetensors", "checkpoints/step-1/model.safetensors",
                     "checkpoints/step-2/model.safetensors"):  # fmt: skip
            assert sha256(taken / path) == sha256(tmp_path / "made" / "models" / model / path)
        assert (taken / "checkpoints" / "step-0" / "model.safetensors").is_file()
        meta = read_json(taken / "meta.json")
        assert meta["checkpoints"] == [0, 1, 2] and "prebuilt" in meta


# ---- what is taken is what was exported --------------------------------------------------------


def test_the_record_holds_the_sha256_of_every_file_of_the_folder(made):
    folder = made["folder"]
    for model in MODELS:
        record = read_json(folder / model / "prebuilt.json")
        files = {
            p.relative_to(folder / model).as_posix(): sha256(p)
            for p in (folder / model).rglob("*")
            if p.is_file() and p.name != "prebuilt.json"
        }
        assert record["files"] == files
        assert {"config.json", "model.safetensors", "checkpoints/step-1/model.safetensors"} <= set(
            files
        )


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _change(folder: Path, change: str) -> Path:
    """Change one thing of the attention model's folder after export; the file it changed."""
    model = folder / "attention"
    weights = model / "model.safetensors"
    if change == "weight byte":  # the last byte: tensor data, so the header still reads
        _flip(weights, weights.stat().st_size - 1)
        return weights
    if change == "kept checkpoint":
        kept = model / "checkpoints" / "step-1" / "model.safetensors"
        _flip(kept, kept.stat().st_size - 1)
        return kept
    if change == "config":  # another epsilon and activation: other numbers, the same weights
        config = model / "config.json"
        text = config.read_text()
        assert '"layer_norm_epsilon": 1e-05' in text
        config.write_text(text.replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": 0.5'))
        return config
    if change == "header":  # the JSON header after its 8-byte length
        _flip(weights, 9)
        return weights
    if change == "added":
        extra = model / "checkpoints" / "step-2" / "model.safetensors"
        extra.parent.mkdir()
        shutil.copy(weights, extra)
        return extra
    assert change == "removed"
    (model / "config.json").unlink()
    return model / "config.json"


@pytest.mark.parametrize(
    "change", ["weight byte", "kept checkpoint", "config", "header", "added", "removed"]
)
def test_a_folder_changed_after_export_is_refused_naming_the_file(made, tmp_path, change):
    """Before, one flipped weight byte (in the model or a kept checkpoint) and an edited
    config.json were taken silently, and a damaged header stopped the run with a traceback.
    Now the file is named with the sha256 recorded and the one found, before any stage runs."""
    root = made["root"]
    folder = tmp_path / "models"
    shutil.copytree(made["folder"], folder)
    recorded = read_json(folder / "attention" / "prebuilt.json")["files"]
    changed = _change(folder, change)
    rel = changed.relative_to(folder / "attention").as_posix()
    name = f"changed-{change.replace(' ', '-')}"
    with pytest.raises(PrebuiltMismatch) as err:
        run(root, name, stages=UP_TO_TRAIN, prebuilt=folder)
    message = str(err.value)
    assert str(changed) in message and "\n" not in message
    if change == "added":
        assert "not recorded in prebuilt.json" in message
    elif change == "removed":
        assert f"missing (recorded sha256 {recorded[rel]})" in message
    else:
        assert f"sha256 {sha256(changed)}, recorded {recorded[rel]}" in message
    assert "base_conv" not in message  # (the unchanged model is not named)
    assert not (root / name).exists()  # refused before any stage wrote anything


def test_a_damaged_header_is_one_line_from_the_command(made, tmp_path):
    from tests.reliability import run_subprocess

    root = made["root"]
    folder = tmp_path / "models"
    shutil.copytree(made["folder"], folder)
    weights = _change(folder, "header")
    config = tmp_path / "header.toml"
    config.write_text(config_text(root, "header", prebuilt=folder))
    done = run_subprocess("run", "--config", config, "--stage", *UP_TO_TRAIN)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(weights) in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (root / "header").exists()


def test_make_demo_models_trains_only_the_models_the_folder_lacks(tmp_path):
    """A model added to the config is trained and exported; the folder's others are kept as
    they are (not trained again: a run without any of their outputs, as on a fresh clone)."""
    from pipeline.runner.run import RunConfig, prepare_pipeline
    from pipeline.train.prebuilt import held_as_asked
    from tests.pipeline.test_make_path import make, stages_run

    folder = tmp_path / "models"
    first = tmp_path / "first.toml"
    first.write_text(config_text(tmp_path, "first", prebuilt=folder))
    done = make("demo-models", config=first)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", *MODELS]
    kept = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.parent != folder}

    second = tmp_path / "second.toml"
    text = config_text(tmp_path, "second", prebuilt=folder)
    second.write_text(text + '\n[train.models.rwkv]\narch = "rwkv"\n')
    done = make("demo-models", config=second)
    assert done.returncode == 0, done.stderr
    assert "train" in stages_run(done)
    assert sorted(p.name for p in (tmp_path / "second" / "models").iterdir()) == [
        "meta.json",
        "rwkv",
    ]  # (only the new model was trained)
    assert {p: p.read_bytes() for p in kept} == kept  # the others kept byte for byte
    assert read_json(folder / "rwkv" / "prebuilt.json")["settings"]["arch"] == "rwkv"
    readme = (folder / "README.md").read_text()
    assert readme.count("Made by `") == 2 and "(rwkv):" in readme
    assert "(attention, base_conv):" in readme
    pipeline, _, _ = prepare_pipeline(RunConfig(str(second), stage=["train"]))
    assert all(held_as_asked(cfg) for cfg in pipeline.configs("train").values())
