"""Test-matrix selection from the suites' command-line options."""
from __future__ import annotations

import torch

from .registry import resolve_backends
from .shapes import Shape, resolve_shapes


def selected_backends(config) -> list[str]:
    """Backends named by --backend (default: all registered)."""
    return resolve_backends(config.getoption("--backend") or ["all"])


def selected_shapes(config) -> list[Shape]:
    """Shapes named by --shapes (default: official on a GPU run, ci on a CPU run)."""
    spec = config.getoption("--shapes")
    if spec is None:
        device = config.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
        spec = "official" if device.startswith("cuda") else "ci"
    return resolve_shapes(spec)


def selected_cases(config) -> list[tuple[str, float]]:
    """(dtype name, padding ratio) pairs: float32 at every padding, half dtypes at the first."""
    dtypes = config.getoption("--dtype") or ["float32", "float16", "bfloat16"]
    paddings = config.getoption("--padding") or [0.0, 0.25]
    cases = [("float32", p) for p in paddings] if "float32" in dtypes else []
    cases += [(d, paddings[0]) for d in dtypes if d != "float32"]
    return cases
