"""Benchmark parametrisation: one case per (shape, backend), torch-baseline first in each shape."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import runner
from layerbench.common.errors import Unsupported
from layerbench.common.registry import PEERS
from layerbench.common.selection import selected_backends, selected_shapes

BASELINE = PEERS[0]


def pytest_generate_tests(metafunc):
    if "bench_case" not in metafunc.fixturenames:
        return
    backends = selected_backends(metafunc.config)
    backends = sorted(backends, key=lambda name: name != BASELINE)
    params = [pytest.param((shape, name), id=f"{shape.id}-{name}")
              for shape in selected_shapes(metafunc.config) for name in backends]
    metafunc.parametrize("bench_case", params)


class ShapeState:
    """The inputs, reference and baseline layer of the shape being benchmarked (one at a time,
    so that a huge shape's buffers are freed before the next shape starts)."""

    def __init__(self, device, seed, padding=0.0):
        self.device, self.seed, self.padding = device, seed, padding
        self.shape = None
        self.prepared = self.reference = self.baseline = None
        self.baseline_reason = ""
        self.baseline_bench_ms = None

    def enter(self, shape):
        """Make shape current, preparing its inputs and torch-baseline on first use."""
        if shape is self.shape:
            return self
        self.prepared = self.reference = self.baseline = self.baseline_bench_ms = None
        self.baseline_reason = ""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.shape = shape
        self.prepared = runner.prepare(shape, padding=self.padding, dtype=torch.float32,
                                       seed=self.seed, device=self.device)
        try:
            self.baseline = runner.build(BASELINE, self.prepared)
        except Unsupported as exc:
            self.baseline_reason = str(exc)
        return self


@pytest.fixture(scope="session")
def shape_state(device, seed, pytestconfig) -> ShapeState:
    """The session's current-shape state; inputs padded at the first --padding ratio (else 0)."""
    return ShapeState(device, seed, (pytestconfig.getoption("--padding") or [0.0])[0])
