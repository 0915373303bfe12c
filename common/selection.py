"""Test-matrix selection from the suites' command-line options."""
from __future__ import annotations

import torch

from .registry import resolve_backends
from .shapes import NONCAUSAL, Shape, resolve_shapes

# What the conformance suite runs when --shapes is not given.
CONFORMANCE_DEFAULT = {"cuda": "official,noncausal,headdims", "cpu": "ci,ci-noncausal,headdims"}
# Head-dim shapes and non-causal CI shapes run this (dtype, padding) case only.
SMALL_SHAPE_CASE = ("float32", 0.25)


def skip_unless_selected(config, backend: str) -> None:
    """Skip the calling test unless the options select backend."""
    import pytest

    if backend not in selected_backends(config):
        pytest.skip(f"{backend} is not among the selected backends")


def selected_backends(config) -> list[str]:
    """Backends named by --backend (default: all registered)."""
    return resolve_backends(config.getoption("--backend") or ["all"])


def _device_type(config) -> str:
    device = config.getoption("--device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return "cuda" if device.startswith("cuda") else "cpu"


def selected_shapes(config) -> list[Shape]:
    """Shapes named by --shapes (default: official on a GPU run, ci on a CPU run)."""
    spec = config.getoption("--shapes")
    if spec is None:
        spec = "official" if _device_type(config) == "cuda" else "ci"
    return resolve_shapes(spec)


def conformance_shapes(config) -> list[Shape]:
    """Shapes named by --shapes; by default also the non-causal and head-dim shapes
    (GPU: official + non-causal 1, 8, 13 + head dims; CPU: ci + non-causal ci + head dims)."""
    spec = config.getoption("--shapes")
    return resolve_shapes(spec if spec is not None else CONFORMANCE_DEFAULT[_device_type(config)])


def selected_cases(config) -> list[tuple[str, float]]:
    """(dtype name, padding ratio) pairs: float32 at every padding, half dtypes at the first."""
    dtypes = config.getoption("--dtype") or ["float32", "float16", "bfloat16"]
    paddings = config.getoption("--padding") or [0.0, 0.25]
    cases = [("float32", p) for p in paddings] if "float32" in dtypes else []
    cases += [(d, paddings[0]) for d in dtypes if d != "float32"]
    return cases


# CI variants at least this wide (shapes 8 and 14 at d_model 1024) take a CPU kernel
# interpreter 10-20 s a case: they run one case, as the head-dim shapes do, and no
# determinism case (the narrower CI shapes run every dtype and the determinism case).
WIDE_CI_D_MODEL = 1024


def wide_ci(shape: Shape) -> bool:
    """Whether shape is a CI variant of at least WIDE_CI_D_MODEL columns."""
    return shape.table == "ci" and shape.config.d_model >= WIDE_CI_D_MODEL


def runs_one_case(shape: Shape) -> bool:
    """Whether shape runs SMALL_SHAPE_CASE alone: head-dim shapes, the non-causal CI shapes
    (which keep the CPU suite short; the official non-causal shapes run every case) and the
    wide CI shapes (wide_ci)."""
    return shape.table == "headdim" or shape.kind == "ci" + NONCAUSAL or wide_ci(shape)


def shape_cases(shape: Shape, config) -> tuple[list[tuple[str, float]], str]:
    """The (dtype, padding) cases the options select for shape, and why there are none if so.

    Huge shapes run the float32 cases only; the shapes of runs_one_case run float32 at
    padding 0.25 only.
    """
    cases = selected_cases(config)
    dtypes = ", ".join(config.getoption("--dtype") or [])
    if runs_one_case(shape):
        if any(d == "float32" for d, _ in cases):
            return [SMALL_SHAPE_CASE], ""
        return [], (f"{shape.id}: head-dim, non-causal CI and d_model-{WIDE_CI_D_MODEL} CI "
                    f"shapes run float32 at padding {SMALL_SHAPE_CASE[1]:g} only, and --dtype "
                    f"selected {dtypes}")
    if shape.huge:
        kept = [c for c in cases if c[0] == "float32"]
        if not kept:
            return [], (f"{shape.id} runs float32 cases only (half-precision cases are left "
                        f"out on huge shapes), and --dtype selected {dtypes}")
        return kept, ""
    return cases, ""


def determinism_reason(shape: Shape) -> str:
    """Why the determinism case of shape is not run, or '' when it is."""
    if shape.huge:
        return f"{shape.id}: the determinism case is not run on huge shapes"
    if shape.kind == "ci" + NONCAUSAL:
        return f"{shape.id}: determinism is run on the causal CI shapes"
    if wide_ci(shape):
        return (f"{shape.id}: determinism is run on the CI shapes narrower than d_model "
                f"{WIDE_CI_D_MODEL}")
    return ""
