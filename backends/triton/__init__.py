"""triton: the whole stack in Triton kernels (fused block kernels, split-fp16 GEMMs, flash
attention)."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import param_bytes
from layerbench.common.precision import deep_stack

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

    def __init__(self, precision: Precision | None = None):
        # None: DEFAULT_PRECISION, its Q/K/V at three products in deep stacks (precision_for)
        self.precision = DEFAULT_PRECISION if precision is None else precision
        self.depth_aware = precision is None

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
            "one sequence": working_bytes_per_sequence(config, self.precision_for(config)),
            PARAMETERS: param_bytes(config),
        })

    def precision_for(self, config) -> Precision:
        """The precision a layer of config runs: the one given, or DEFAULT_PRECISION with
        Q/K/V at three fp16 products (not one) in stacks deeper than
        common.precision.DEEP_STACK_BLOCKS, where its rounding error grows past the contract
        (bench/depth_study.py)."""
        if self.depth_aware and deep_stack(config):
            return replace(self.precision, qkv=None)
        return self.precision

    def _build(self, config, state_dict, device, dtype):
        return TritonLayer(self, config, state_dict, device, dtype, self.precision_for(config))
