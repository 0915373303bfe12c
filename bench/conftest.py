"""Benchmark parametrisation: one case per (shape, backend), torch-baseline first in each shape."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import runner
from layerbench.common.errors import Unsupported
from layerbench.common.registry import PEERS, peers_first
from layerbench.common.results import append_json_line
from layerbench.common.selection import selected_backends, selected_shapes

BASELINE = PEERS[0]


def pytest_generate_tests(metafunc):
    if "bench_case" not in metafunc.fixturenames:
        return
    # torch-baseline first, then the other peers, so each backend is ranked against them.
    backends = peers_first(selected_backends(metafunc.config))
    params = [pytest.param((shape, name), id=f"{shape.id}-{name}")
              for shape in selected_shapes(metafunc.config) for name in backends]
    metafunc.parametrize("bench_case", params)


class ShapeState:
    """The inputs, reference and baseline layer of the shape being benchmarked (one at a time,
    so that a huge shape's buffers are freed before the next shape starts)."""

    def __init__(self, device, seed, padding=0.0, dtype=torch.float32):
        self.device, self.seed, self.padding, self.dtype = device, seed, padding, dtype
        self.shape = None
        self.prepared = self.reference = self.baseline = None
        self.baseline_reason = ""
        self.baseline_bench_ms = None
        self.passed_peers_ms: dict[str, float] = {}

    def enter(self, shape):
        """Make shape current, preparing its inputs and torch-baseline on first use."""
        if shape is self.shape:
            return self
        self.prepared = self.reference = self.baseline = self.baseline_bench_ms = None
        self.baseline_reason = ""
        self.passed_peers_ms = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.shape = shape
        self.prepared = runner.prepare(shape, padding=self.padding, dtype=self.dtype,
                                       seed=self.seed, device=self.device)
        try:
            self.baseline = runner.build(BASELINE, self.prepared)
        except Unsupported as exc:
            self.baseline_reason = str(exc)
        return self

    def best_peer(self, exclude: str) -> tuple[str, float] | None:
        """(name, benchmark median ms) of the fastest peer that passed here, other than exclude."""
        timed = {k: v for k, v in self.passed_peers_ms.items() if k != exclude}
        return min(timed.items(), key=lambda kv: kv[1]) if timed else None


@pytest.fixture(scope="session")
def shape_state(device, seed, pytestconfig) -> ShapeState:
    """The session's current-shape state; inputs padded at the first --padding ratio (else 0)
    and of the first --dtype (else float32)."""
    dtype = runner.DTYPES[(pytestconfig.getoption("--dtype") or ["float32"])[0]]
    return ShapeState(device, seed, (pytestconfig.getoption("--padding") or [0.0])[0], dtype)


@pytest.fixture(scope="session")
def bench_results_log(pytestconfig):
    """Appends one JSON line per checked benchmark case to --results-file, if given."""
    path = pytestconfig.getoption("--results-file")
    return lambda row: append_json_line(path, row) if path else None
