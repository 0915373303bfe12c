"""torch-baseline: the reference stack with TF32 matmuls on CUDA, the denominator of every speedup."""
from __future__ import annotations

from typing import Mapping

import torch

from layerbench.common.interface import Backend, BuiltLayer, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import check_state_dict, param_bytes
from layerbench.reference.model import BaselineStack, reference_forward


class TorchBaselineBackend(Backend):
    """The baseline nn.Module, TF32 on; forms the full [B, H, S, S] score tensor."""

    name = "torch-baseline"
    summary = "reference nn.Module stack (the timing baseline); TF32 matmuls on CUDA"
    capabilities = Capabilities(
        devices=("cuda", "cpu"),
        dtypes=(torch.float32,),
        notes="fp32 only; forms [B,H,S,S] scores; TF32 "
              "applies on CUDA only (on a CPU the matmuls are plain fp32)",
    )

    def memory_plan(self, config, dtype):
        """Scores dominate: fp32 scores, their masked copy and the softmax, per layer."""
        b, s, h = config.batch_size, config.seq_len, config.num_heads
        t, d, f = config.tokens, config.d_model, config.ffn_dim
        return MemoryPlan({
            "attention scores": 4 * b * h * s * s * 4,
            "activations": 4 * t * (10 * d + 3 * f),
            PARAMETERS: param_bytes(config),
        })

    def _build(self, config, state_dict: Mapping[str, torch.Tensor], device, dtype):
        check_state_dict(config, state_dict)
        model = BaselineStack(config)
        model.load_state_dict(state_dict, strict=True)
        return _BaselineLayer(self, config, device, dtype, model.to(device=device, dtype=dtype))


class _BaselineLayer(BuiltLayer):
    def __init__(self, backend, config, device, dtype, model):
        super().__init__(backend, config, device, dtype)
        self.model = model.eval()

    def forward(self, x, valid_token_mask, out=None):
        """The reference module with TF32 matmuls (a caller's autocast switched off)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            result = reference_forward(self.model, x, valid_token_mask, precision="tf32")
        return result if out is None else out.copy_(result)
