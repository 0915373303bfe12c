"""triton: the whole stack in Triton kernels (fused block kernels, split-fp16 GEMMs, flash
attention)."""
from __future__ import annotations

import os

import torch

from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import param_bytes

from .layer import DEFAULT_PRECISION, Precision, TritonLayer, working_bytes_per_sequence

# Every multiple of 8 up to 256; the kernels pad a head to the next power of two (HEAD_PAD).
HEAD_DIMS = tuple(range(8, 257, 8))


class TritonBackend(Backend):
    """The stack in Triton kernels (three per block when rows fit a tile, seven otherwise),
    replayed as one CUDA graph where the input allows."""

    name = "triton"
    summary = "Triton: fused block kernels, split-fp16 GEMMs, flash attention, CUDA graph"
    capabilities = Capabilities(
        devices=("cuda", "cpu"),
        head_dims=HEAD_DIMS,
        notes="cpu runs the Triton interpreter (TRITON_INTERPRET=1); fp32 residual stream",
    )

    def __init__(self, precision: Precision = DEFAULT_PRECISION):
        self.precision = precision

    def unavailable_reason(self, device):
        """Triton must import; on a CPU the interpreter must be switched on."""
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton is not installed ({exc})"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "on a CPU, Triton kernels need TRITON_INTERPRET=1"
        return None

    def memory_plan(self, config, dtype):
        """One sequence's workspace (the layer streams the batch) plus the packed weights."""
        return MemoryPlan({
            "one sequence": working_bytes_per_sequence(config, self.precision),
            PARAMETERS: param_bytes(config),
        })

    def _build(self, config, state_dict, device, dtype):
        return TritonLayer(self, config, state_dict, device, dtype, self.precision)
