"""Compiled kernels made on first use: one numba switch (ARSLICE_NO_NUMBA=1) for every stage."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)


def lazily_compiled(jit_all: Callable[[Callable], dict]) -> Callable[[], dict | None]:
    """A function that returns `jit_all(jit)` (the kernels by name; `jit` is numba's `njit`,
    cached on disk, releasing the GIL), made on its first call, or None (the numpy fallback)
    without numba or while ARSLICE_NO_NUMBA is set. Safe to call from several threads: a stage
    may load a table on one thread while another asks for the kernels."""
    made: list[dict] = []
    lock = threading.Lock()

    def compiled() -> dict | None:
        if os.environ.get("ARSLICE_NO_NUMBA"):
            return None
        with lock:
            if not made:
                try:
                    import numba
                except ImportError:
                    log.info("numba is not installed: running the numpy fallback (slower)")
                    made.append({})
                else:
                    made.append(jit_all(numba.njit(cache=True, nogil=True)))
        return made[0] or None

    compiled.__doc__ = jit_all.__doc__
    return compiled


def read_only(array) -> np.ndarray:
    """A read-only view of `array`: kernels are given their inputs so, and compiled once for
    them whatever the caller's flags (a memory-mapped store is read-only, a test's array is not)."""
    view = np.asarray(array).view()
    view.flags.writeable = False
    return view
