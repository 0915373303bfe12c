"""Latency of every backend on every shape, checked for correctness before it is timed.

Method: the measured callable runs one forward and then synchronises the device, so each
pytest-benchmark round is the wall time of a finished forward (launches included). Rounds
are sized to --benchmark-max-time (at least --benchmark-min-rounds, at most 200) after a
warm-up. extra_info holds the speedup over torch-baseline and over the fastest peer that
passed the contract on the shape (ratios of benchmark medians of this run; the peers run
first in each shape, torch-baseline before them), CUDA-event medians of the backend and of
torch-baseline timed in alternating rounds with their ratio to the benchmark's median,
TFLOP/s, the fraction of the fp16 tensor-core floor, and the peak memory of one forward.
"""
from __future__ import annotations

import warnings

import pytest

from layerbench.common import runner
from layerbench.common.errors import Unsupported
from layerbench.common.flops import forward_flops
from layerbench.common.registry import PEERS

from .conftest import BASELINE


LONG_CASE_FLOPS = 5e13  # above this (shape 14) a case is timed in one round
MAX_ROUNDS = 200


def test_forward(benchmark, bench_case, shape_state, bench_results_log, pytestconfig):
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
    bench_results_log({"backend": name, "shape": shape.number, "shape_kind": shape.kind,
                       "dtype": str(state.dtype).replace("torch.", ""),
                       "padding": state.padding, "seed": state.seed, "source": "bench",
                       "oracle_sequences": state.reference[1], **report.as_dict()})
    benchmark.extra_info.update({"backend": name, "shape": shape.number,
                                 "shape_kind": shape.kind, "padding": state.padding,
                                 "dtype": str(state.dtype).replace("torch.", ""),
                                 "seed": state.seed, "passed": report.passed,
                                 "max_abs_error": report.max_abs_error,
                                 "peak_memory_bytes": report.peak_memory_bytes})
    if not report.passed:
        if name in PEERS and name != BASELINE:
            # A peer that misses the contract is shown as such and ranks nobody on this shape.
            pytest.xfail(f"peer misses the contract, not timed: {report.summary()}")
        if name != BASELINE:
            pytest.fail(f"not timed, output is wrong: {report.summary()}")
        # torch-baseline defines the speedup's denominator, so it is timed all the same.
        warnings.warn(f"torch-baseline misses the contract on {shape.id}: {report.summary()}")

    forward_and_sync = runner.forward_call(layer, prepared, sync=True)
    # The check above was the warm-up; a forward of many seconds is timed only once more.
    long_case = forward_flops(shape.config) > LONG_CASE_FLOPS
    if benchmark.disabled:  # --benchmark-disable: run the measured callable once, time nothing
        benchmark(forward_and_sync)
        return
    if long_case:
        benchmark.pedantic(forward_and_sync, rounds=1, warmup_rounds=0, iterations=1)
    else:
        once = runner.median_forward_ms(layer, prepared, rounds=3)
        max_ms = 1e3 * float(pytestconfig.getoption("benchmark_max_time"))
        min_rounds = int(pytestconfig.getoption("benchmark_min_rounds"))
        rounds = int(min(max(MAX_ROUNDS, min_rounds), max(min_rounds, max_ms / max(once, 1e-3))))
        benchmark.pedantic(forward_and_sync, rounds=rounds, warmup_rounds=1, iterations=1)
    bench_ms = None if benchmark.stats is None else benchmark.stats.stats.median * 1e3
    if name == BASELINE:
        state.baseline_bench_ms = bench_ms

    # CUDA-event medians, this backend and torch-baseline in alternating rounds.
    baseline = None if name == BASELINE else state.baseline
    timing = runner.time_against_baseline(layer, prepared, baseline,
                                          rounds=1 if long_case else 20,
                                          warmup=0 if long_case else 3)
    events_baseline_ms = timing.median_ms if name == BASELINE else timing.baseline_ms
    # Ratios of benchmark medians; without torch-baseline's benchmark (not selected), the
    # alternating CUDA-event medians, and speedup_method says which.
    speedup, method = None, None
    if state.baseline_bench_ms and bench_ms:
        speedup, method = state.baseline_bench_ms / bench_ms, "benchmark medians"
    elif events_baseline_ms is not None:
        speedup, method = events_baseline_ms / timing.median_ms, "alternating CUDA events"
    if name in PEERS and report.passed and bench_ms:
        state.passed_peers_ms[name] = bench_ms
    best = state.best_peer(exclude=name)
    benchmark.extra_info.update({
        "speedup_method": method,
        "best_peer": None if best is None else best[0],
        "best_peer_ms": None if best is None else best[1],
        "speedup_vs_best_peer": None if best is None or not bench_ms else best[1] / bench_ms,
        "events_median_ms": timing.median_ms,
        "baseline_events_median_ms": events_baseline_ms,
        "events_speedup": (None if events_baseline_ms is None
                           else events_baseline_ms / timing.median_ms),
        "speedup": speedup,
        "benchmark_over_events": None if bench_ms is None else bench_ms / timing.median_ms,
        "tflops": timing.extra["tflops"],
        "fraction_of_fp16_floor": timing.extra["fraction_of_fp16_floor"],
    })
