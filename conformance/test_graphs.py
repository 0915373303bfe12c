"""CUDA-graph replay (common/graphs.py): a replay reads the caller's current buffers, writes
into out when given, keeps earlier results, and evicts the least recently used graph."""
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
