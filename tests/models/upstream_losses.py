"""The upstream fixtures' recorded losses and how far `models.load_model` is from them.

Run as `python -m tests.models.upstream_losses CASE...` it prints, as JSON, each case's largest
|Δ nll| per token, computed as `arslice eval` computes it: in a process whose CPU kernels are
whatever this machine picks. The test session pins them for the training it runs in-process
(`models.cpu_kernels`), and under MKL's COMPATIBLE mode the products' last bits differ; the
safari fixtures' implicit filter (an MLP whose three Sin activations have frequencies near 14,
as safari's hyena-small has) multiplies such a difference by about 10^4, 1.5e-3 nats at the
head, where every MKL instruction-set branch of this machine agrees with safari's run to 2e-6.
"""

from __future__ import annotations

import json
import sys

import torch

from models import load_model
from models.nll import per_token_nll
from tests import UPSTREAM
from tests.unpinned import run_unpinned

CASES = sorted(p.parent.name for p in UPSTREAM.glob("*/expected.json"))


def expected(case: str) -> dict:
    return json.loads((UPSTREAM / case / "expected.json").read_text())


def load_case(case: str, **kwargs):
    data = expected(case)
    prefix, target = data["spec"].split(":", 1)
    config = data.get("model_config")
    return load_model(
        f"{prefix}:{UPSTREAM / case / target}",
        model_config=None if config is None else UPSTREAM / case / config,
        **kwargs,
    )


def max_nll_error(loaded, windows) -> float:
    """Largest |Δ nll| of `loaded` against `windows`' recorded `nll` (their `inputs` and
    `targets`)."""
    worst = 0.0
    for window in windows:
        inputs = torch.tensor([window["inputs"]])
        targets = torch.tensor([window["targets"]])
        got = per_token_nll(loaded, inputs, targets)[0]
        worst = max(worst, (got - torch.tensor(window["nll"])).abs().max().item())
    return worst


def errors_unpinned(cases) -> dict[str, float]:
    """`max_nll_error` of each case against its upstream losses, from a child process without the
    kernel pin (see the module's docstring)."""
    return run_unpinned("tests.models.upstream_losses", *cases)


def main(cases) -> None:
    torch.set_num_threads(1)  # tiny tensors
    print(
        json.dumps(
            {case: max_nll_error(load_case(case), expected(case)["windows"]) for case in cases}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
