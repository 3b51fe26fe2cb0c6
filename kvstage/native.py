"""kvstage's native pieces: plain C libraries pip builds with the package (setup.py), loaded
with ctypes (no Python API, no Python headers). ``load`` finds one and says why not, where it
was not built or does not load: each caller then takes its Python path and says so once."""

from __future__ import annotations

import ctypes
import importlib.util


def load(module: str) -> tuple[ctypes.CDLL | None, str]:
    """The built library of ``module`` (e.g. ``kvstage.staging._spans``), or None and why."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None, f"{module} is not built (install kvstage with pip, which compiles it)"
    try:
        return ctypes.CDLL(spec.origin), ""
    except OSError as e:
        return None, f"{spec.origin} does not load: {e}"
