"""Pipeline config files: read a TOML file with its `{run_dir}`/`{stdlib}`/`{torch}` placeholders
(its tables are the pipeline stages' own), and write the resolved configuration back as TOML
(`<run_dir>/config.toml`)."""

from __future__ import annotations

import json
import math
import os
import re
import sysconfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ar_slicing.errors import BadInput
from ar_slicing.machinery.io import text_of
from pipeline.runner.registry import stage_names

# ---- reading the config -------------------------------------------------------------------------


def stdlib_dir() -> str:
    """This interpreter's standard-library source directory (the demo corpus)."""
    return sysconfig.get_paths()["stdlib"]


# The torch release whose Python sources `{torch}` names (the demo corpus): the one `make install`
# pins. Every wheel of a release holds the same .py files, CPU or CUDA, Linux or macOS, whatever the
# Python version, except torch/version.py (the build's local version and CUDA release), which the
# demo's glob patterns leave out; another release is another corpus, so it is refused.
TORCH_CORPUS_VERSION = "2.13.0"


def torch_dir() -> str:
    """The installed torch package's directory, refused (BadInput) unless it is torch
    TORCH_CORPUS_VERSION (any local build label: "+cpu", "+cu126")."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or version.split("+")[0] != TORCH_CORPUS_VERSION:
        found = "no torch" if version is None else f"torch {version}"
        raise BadInput(
            f"{{torch}} names the sources of torch {TORCH_CORPUS_VERSION} (the release `make "
            f"install` pins), so that the corpus is the same on every machine; this environment "
            f"has {found}: pip install torch=={TORCH_CORPUS_VERSION}"
        )
    return importlib.util.find_spec("torch").submodule_search_locations[0]


def _mentions(value: Any, text: str) -> bool:
    if isinstance(value, str):
        return text in value
    if isinstance(value, Mapping):
        return any(_mentions(v, text) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, text) for v in value)
    return False


def resolve_placeholders(value: Any, placeholders: Mapping[str, str]) -> Any:
    """`value` with every `{name}` of `placeholders` replaced inside its strings, recursively.

    Only the named placeholders are touched, so other braces in strings survive.
    """
    if isinstance(value, str):
        for name, replacement in placeholders.items():
            value = value.replace("{" + name + "}", replacement)
        return value
    if isinstance(value, Mapping):
        return {k: resolve_placeholders(v, placeholders) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_placeholders(v, placeholders) for v in value]
    return value


def load_pipeline_config(path: str | Path) -> dict:
    """Parse a pipeline config and resolve its placeholders; refuses unknown top-level keys."""
    path = Path(path)
    try:
        raw = tomllib.loads(text_of(path, "pipeline config"))
    except FileNotFoundError:
        raise BadInput(f"pipeline config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"pipeline config {path}: not valid TOML ({e})") from None
    if not isinstance(raw.get("run_dir"), str) or not raw["run_dir"]:
        raise BadInput(f'pipeline config {path}: needs a top-level `run_dir = "runs/<name>"`')
    tables = stage_names()
    allowed = {"run_dir", "description", *tables}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise BadInput(
            f"pipeline config {path}: unknown top-level key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(sorted(allowed))}"
        )
    for name in tables:
        if name in raw and not isinstance(raw[name], dict):
            raise BadInput(f"pipeline config {path}: `{name}` must be a table ([{name}])")
    placeholders = {"stdlib": stdlib_dir()}
    if _mentions(raw, "{torch}"):  # only a config that reads torch's sources checks its version
        try:
            placeholders["torch"] = torch_dir()
        except BadInput as e:
            raise BadInput(f"pipeline config {path}: {e}") from None
    run_dir = os.path.expanduser(resolve_placeholders(raw["run_dir"], placeholders))
    placeholders["run_dir"] = run_dir
    return {**resolve_placeholders(raw, placeholders), "run_dir": run_dir}


# ---- writing the resolved config ----------------------------------------------------------------


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes (\" \\ \n \t \uXXXX) are all valid in a TOML basic string; DEL is
        # the one control character JSON leaves raw and TOML does not allow
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def dumps_toml(mapping: Mapping[str, Any], _prefix: str = "") -> str:
    """A TOML document for `mapping` (tables, strings, numbers, bools and lists of them).

    None values are left out (TOML has no null; a missing key means the stage's default).
    """
    lines = [
        f"{_toml_key(k)} = {_toml_value(v)}"
        for k, v in mapping.items()
        if v is not None and not isinstance(v, Mapping)
    ]
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            name = f"{_prefix}{_toml_key(key)}"
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
            body = dumps_toml(value, name + ".")
            if body:
                lines.append(body.rstrip("\n"))
    return "\n".join(lines) + "\n" if lines else ""
