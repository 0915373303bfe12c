"""Latency of every backend on every shape, checked for correctness before it is timed.

Method: the measured callable runs one forward and then synchronises the device, so each
pytest-benchmark round is the wall time of a finished forward (launches included). Rounds
are sized to about two seconds per case after a warm-up. Beside it, extra_info holds CUDA-event
medians of the backend and of torch-baseline timed in alternating rounds (the speedup), their
agreement with the benchmark's own median, TFLOP/s, the fraction of the fp16 tensor-core floor
and the peak memory of one forward.
"""
from __future__ import annotations

import pytest
import torch

from layerbench.common import runner
from layerbench.common.errors import Unsupported
from layerbench.common.flops import forward_flops

from .conftest import BASELINE


LONG_CASE_FLOPS = 5e13  # above this (shape 14) a case is timed in one round


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def test_forward(benchmark, bench_case, shape_state, device):
    """Check, then time, one backend on one shape."""
    shape, name = bench_case
    benchmark.group = shape.id
    state = shape_state.enter(shape)
    prepared = state.prepared
    try:
        layer = state.baseline if name == BASELINE else runner.build(name, prepared)
        if layer is None:
            raise Unsupported(state.baseline_reason)
    except Unsupported as exc:
        pytest.skip(str(exc))
    report, state.reference = runner.check(layer, prepared, state.reference)
    benchmark.extra_info.update({"backend": name, "shape": shape.number,
                                 "shape_kind": shape.kind, "passed": report.passed,
                                 "max_abs_error": report.max_abs_error})
    if not report.passed:
        pytest.fail(f"not timed, output is wrong: {report.summary()}")

    baseline = None if name == BASELINE else state.baseline
    # The check above was the warm-up; a forward of many seconds is timed only once more.
    long_case = forward_flops(shape.config) > LONG_CASE_FLOPS
    timing = runner.time_against_baseline(layer, prepared, baseline,
                                          rounds=1 if long_case else 20,
                                          warmup=0 if long_case else 3)
    baseline_ms = timing.median_ms if name == BASELINE else timing.baseline_ms
    x, mask = prepared.x, prepared.mask

    def forward_and_sync():
        with torch.no_grad():
            layer(x, mask)
        _sync(device)

    rounds = int(min(200, max(1 if long_case else 3, 2000.0 / max(timing.median_ms, 1e-3))))
    benchmark.pedantic(forward_and_sync, rounds=rounds, warmup_rounds=0 if long_case else 1,
                       iterations=1)
    bench_ms = None
    if benchmark.stats is not None:
        bench_ms = benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update({
        "events_median_ms": timing.median_ms,
        "baseline_events_median_ms": baseline_ms,
        "speedup": None if baseline_ms is None else baseline_ms / timing.median_ms,
        "benchmark_over_events": None if bench_ms is None else bench_ms / timing.median_ms,
        "tflops": timing.extra["tflops"],
        "fraction_of_fp16_floor": timing.extra["fraction_of_fp16_floor"],
        "peak_memory_bytes": report.peak_memory_bytes,
    })
