"""torch-sdpa: fused QKV projection and scaled_dot_product_attention, TF32 matmuls."""
from __future__ import annotations

import torch

from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import param_bytes

from .layer import SdpaLayer, working_bytes_per_sequence


class TorchSdpaBackend(Backend):
    """PyTorch ops with a fused QKV weight and SDPA; streams the batch when memory is short."""

    name = "torch-sdpa"
    summary = "PyTorch ops: fused QKV, SDPA, mask elision, TF32 matmuls (CUDA), batch streaming"
    capabilities = Capabilities(
        devices=("cuda", "cpu"),
        notes="fp16/bf16 inputs are computed in fp32 and cast back",
    )
    compiled = False
    half = None

    def memory_plan(self, config, dtype):
        """One sequence's working set (the layer streams the batch) plus a weight copy."""
        return MemoryPlan({
            "one sequence": working_bytes_per_sequence(config, general_mask=False),
            PARAMETERS: param_bytes(config),
        })

    def _build(self, config, state_dict, device, dtype):
        return SdpaLayer(self, config, state_dict, device, dtype, compiled=self.compiled,
                         half=self.half)
