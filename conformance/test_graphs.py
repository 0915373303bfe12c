"""CUDA-graph replay (common/graphs.py): a replay reads the caller's current buffers, writes
into out when given, keeps earlier results, evicts the least recently used graph, and a failed capture leaves
the caching allocator able to free memory."""
from __future__ import annotations

import pytest
import torch

from layerbench.common.graphs import GraphedForward

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _forward(calls):
    """A forward that counts its eager calls: out = 2 x + mask (as 0/1) per row."""
    def forward(x, mask, out=None):
        calls.append(1)
        result = x * 2 + (0 if mask is None else mask[..., None].to(x.dtype))
        return result if out is None else out.copy_(result)
    return forward


def _expected(x, mask):
    return x * 2 + mask[..., None].to(x.dtype)


def test_cpu_inputs_run_eagerly():
    """Without CUDA tensors every call is eager and right."""
    calls = []
    graphed = GraphedForward(_forward(calls))
    x, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    for _ in range(3):
        assert torch.equal(graphed(x, mask), _expected(x, mask))
    assert len(calls) == 3 and not graphed.graphs


@needs_gpu
def test_replay_reads_current_buffers():
    """Changing x and the mask in place between calls changes the replayed result."""
    graphed = GraphedForward(_forward([]))
    x = torch.randn(2, 3, 4, device="cuda")
    mask = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    first = graphed(x, mask)
    graphed(x, mask)  # captured here
    assert graphed.graphs
    x.mul_(-3)
    mask[1, 2] = False
    replayed = graphed(x, mask)
    assert torch.equal(replayed, _expected(x, mask))
    assert not torch.equal(first, replayed)  # the earlier result was not overwritten


@needs_gpu
def test_replay_into_out():
    """With out, the graph writes straight into it, and the result is out itself."""
    graphed = GraphedForward(_forward([]))
    x = torch.randn(2, 3, 4, device="cuda")
    mask = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    out = torch.full_like(x, float("nan"))
    for _ in range(3):
        out.fill_(float("nan"))
        assert graphed(x, mask, out) is out
        assert torch.equal(out, _expected(x, mask))


@needs_gpu
def test_least_recently_used_graph_is_evicted():
    """With room for two graphs, the one used least recently goes; every result stays right."""
    graphed = GraphedForward(_forward([]), max_graphs=2)
    mask = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    xs = [torch.randn(2, 3, 4, device="cuda") for _ in range(3)]
    keys = [GraphedForward._key(x, mask, None) for x in xs]
    for x in xs[:2] * 2:
        assert torch.equal(graphed(x, mask), _expected(x, mask))
    graphed(xs[0], mask)  # xs[0] is now the most recently used
    for _ in range(2):
        assert torch.equal(graphed(xs[2], mask), _expected(xs[2], mask))
    assert set(graphed.graphs) == {keys[0], keys[2]}


@needs_gpu
def test_failed_capture_leaves_cached_memory_releasable():
    """A forward that cannot be captured runs eagerly, and afterwards the caching allocator
    still frees cached blocks when an allocation needs their memory."""
    def forward(x, mask, out=None):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture fails
        return x * 2

    graphed = GraphedForward(forward)
    x = torch.randn(4, device="cuda")
    with pytest.warns(UserWarning, match="capture failed"):
        for _ in range(2):
            assert torch.equal(graphed(x, None), x * 2)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gib = 1 << 30
    total = torch.cuda.get_device_properties(x.device).total_memory
    # Under this cap the second block fits only once the first one's cached memory is freed.
    torch.cuda.set_per_process_memory_fraction(
        (torch.cuda.memory_reserved() + gib * 3 // 2) / total)
    try:
        first = torch.empty(gib, dtype=torch.uint8, device="cuda")
        del first
        second = torch.empty(gib * 5 // 4, dtype=torch.uint8, device="cuda")
        del second
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


class _CudaStandIn:
    """An input that reports a CUDA device and a size, for the dispatch of GraphedForward on
    a machine without one."""

    def __init__(self, index: int, elements: int):
        self.device = torch.device("cuda", index)
        self._elements = elements

    def numel(self) -> int:
        """The element count GraphedForward compares with max_elements."""
        return self._elements


def test_eager_paths_run_on_the_inputs_device(monkeypatch):
    """Inputs too large for a graph, and calls inside a caller's capture, run eagerly with
    the input's device current (Triton launches on the current device, not its tensors')."""
    import contextlib

    current = ["cuda:0"]

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], str(torch.device(d))
        try:
            yield
        finally:
            current[0] = before

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    seen = []
    graphed = GraphedForward(lambda x, mask, out=None: seen.append(current[0]), max_elements=4)
    graphed(_CudaStandIn(1, 5), None)  # above max_elements
    capturing[0] = True
    graphed(_CudaStandIn(1, 3), None)  # inside a capture
    assert seen == ["cuda:1", "cuda:1"] and current[0] == "cuda:0"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_large_input_on_a_device_that_is_not_current():
    """An input above max_elements on cuda:1 while cuda:0 is current runs with cuda:1
    current, and its result is right."""
    seen = []

    def forward(x, mask, out=None):
        seen.append(torch.cuda.current_device())
        return _forward([])(x, mask, out)

    graphed = GraphedForward(forward, max_elements=1)
    x = torch.randn(2, 3, 4, device="cuda:1")
    mask = torch.ones(2, 3, dtype=torch.bool, device="cuda:1")
    with torch.cuda.device(0):
        assert torch.equal(graphed(x, mask), _expected(x, mask))
    assert seen == [1]
