"""Code run as the commands that do not train run it: in a child process whose environment lacks
the CPU-kernel pin that this session sets for the training it does in-process (tests/conftest.py,
`models.cpu_kernels`). `arslice eval` and `arslice mqar` run with the CPU's own kernels, and
results sensitive to the last bits of a product (a Hyena filter with high Sin frequencies, an
MQAR run's steps to 0.99) are checked as those commands compute them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests import REPO


def run_unpinned(module: str, *args: str, timeout: float = 900) -> object:
    """`python -m MODULE ARGS...` without the pin; the JSON its last line of stdout holds."""
    from models import cpu_kernels

    env = {k: v for k, v in os.environ.items() if k not in cpu_kernels.PIN}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"python -m {module} {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])
