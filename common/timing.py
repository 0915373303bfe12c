"""GPU timing: CUDA events around each call, warm-up first, median of many; CPU uses a clock."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of fn: CUDA events on a GPU, perf_counter after a sync on CPU."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def replayed(fn: Callable[[], object], repeats: int, device) -> Callable[[], None]:
    """A callable that replays one CUDA graph of `repeats` calls of fn (run once first,
    outside the capture): timing it leaves out the host's time between launches, which
    rivals a kernel of under a tenth of a millisecond. Divide its time by repeats.
    The callable holds fn, so the arrays fn's launches use live as long as the graph."""
    device = torch.device(device)
    fn()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(repeats):
            fn()

    def replay() -> None:
        graph.replay()
    replay.captured = fn
    return replay


def alternating_medians_ms(fns: Sequence[Callable[[], object]], device, *, warmup: int = 3,
                           rounds: int = 20, max_seconds: float = 20.0) -> list[float]:
    """Median ms of each fn, timed in alternating rounds (fn0, fn1, fn0, ...) after warm-up.

    Alternation keeps clock and thermal drift out of the ratios between the functions.
    Rounds stop early once max_seconds have passed, after at least min(rounds, 3) rounds.
    """
    device = torch.device(device)
    for fn in fns:
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: list[list[float]] = [[] for _ in fns]
    started = time.perf_counter()
    for r in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(time_once_ms(fn, device))
        if r >= 2 and time.perf_counter() - started > max_seconds:
            break
    return [statistics.median(s) for s in samples]
