"""CUDA-graph capture and replay of a built layer's forward, keyed by its input buffers."""
from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from typing import Callable

import torch


# Inputs larger than this run eagerly: launches are a negligible part of their time, and a
# graph's private memory pool would hold a second copy of the workspace.
MAX_GRAPH_ELEMENTS = 1 << 26
MAX_SEEN = 64  # buffer keys remembered for capture on their second use


class GraphedForward:
    """Replays a captured graph when called again with the same input buffers and shapes.

    The graph reads x and the mask straight from the caller's buffers (no copy in). Without
    an out buffer it writes into a private output, cloned on return so earlier outputs stay
    valid; with one (keyed like the inputs) it writes straight into it. Any other buffers run
    the eager forward and are captured on their second use.
    """

    def __init__(self, forward: Callable[..., torch.Tensor],
                 max_graphs: int = 2, max_elements: int = MAX_GRAPH_ELEMENTS):
        self.forward = forward
        self.max_graphs = max_graphs
        self.max_elements = max_elements
        # Least recently used first; the keys of buffers seen once, also bounded.
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = (
            OrderedDict())
        self.seen: OrderedDict[tuple, None] = OrderedDict()
        self.uncapturable: set[tuple] = set()

    @staticmethod
    def _key(x, mask, out):
        mask_key = None if mask is None else (mask.data_ptr(), tuple(mask.shape))
        return (x.data_ptr(), tuple(x.shape), x.dtype, mask_key,
                None if out is None else out.data_ptr())

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Forward of (x, mask) into out (or a new tensor), through a graph once these
        buffers have been seen twice."""
        if x.device.type != "cuda":
            return self.forward(x, mask, out)
        eager = x.numel() > self.max_elements or torch.cuda.is_current_stream_capturing()
        # Launch, capture and replay on x's device, also where another device is current:
        # launchers such as Triton's take the current device, not their tensors'.
        with torch.cuda.device(x.device):
            return self.forward(x, mask, out) if eager else self._graphed(x, mask, out)

    def _graphed(self, x, mask, out):
        """__call__ for CUDA inputs on the current device."""
        key = self._key(x, mask, out)
        if key in self.uncapturable:
            return self.forward(x, mask, out)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            graph, result = self.graphs[key]
            graph.replay()
            return result if out is not None else result.clone()
        if key not in self.seen:
            self.seen[key] = None
            if len(self.seen) > MAX_SEEN:
                self.seen.popitem(last=False)
            return self.forward(x, mask, out)
        try:
            graph, result = self._capture(x, mask, out)
        except RuntimeError as exc:  # capture refused: run these buffers eagerly from now on
            first = exc
            while first.__context__ is not None:  # the error that broke the capture comes first
                first = first.__context__
            cause = "" if first is exc else f" (first error: {first})"
            warnings.warn(f"CUDA graph capture failed, running eagerly: {exc}{cause}")
            self.uncapturable.add(key)
            return self.forward(x, mask, out)
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        self.graphs[key] = (graph, result)
        graph.replay()
        return result if out is not None else result.clone()

    def _capture(self, x, mask, out):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(x, mask, out)  # warm-up: compile and autotune outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        # Dead layers (reference cycles) may hold graphs: free them now, not in mid-capture.
        gc.collect()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=pool):
                result = self.forward(x, mask, out)
        except RuntimeError:
            _end_allocation_to_pool(x.device, pool)
            raise
        return graph, result


def _end_allocation_to_pool(device: torch.device, pool) -> None:
    """Stop the caching allocator routing allocations to a failed capture's pool.

    Some PyTorch releases skip this step when the capture fails; the allocator then believes
    a capture is still under way and never frees cached memory to satisfy a later allocation,
    so the process runs out of memory long after the failure."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:  # this release already ended it
        pass
