"""The strict-fp32 truth for a case: the baseline where its scores fit, else the streaming oracle."""
from __future__ import annotations

import torch

from layerbench.common.config import LayerConfig
from layerbench.common.errors import MemoryPlanError
from layerbench.common.memory import MemoryPlan, check_fits
from layerbench.common.params import param_bytes

from .model import BaselineStack, reference_forward
from .oracle import streaming_forward


def baseline_plan(config: LayerConfig) -> MemoryPlan:
    """Bytes the strict baseline needs: fp32 scores (three live copies) and activations."""
    b, s, h = config.batch_size, config.seq_len, config.num_heads
    return MemoryPlan({"scores": 3 * 4 * b * h * s * s,
                       "activations": 4 * config.tokens * (12 * config.d_model + 3 * config.ffn_dim),
                       "parameters": param_bytes(config)})


@torch.no_grad()
def exact_output(model: BaselineStack, x: torch.Tensor, mask: torch.Tensor | None, *,
                 oracle_sequences: int = 2, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, list[int] | None]:
    """(reference fp32 output, batch indices it covers or None for all) on x's device.

    The whole batch comes from the strict baseline when its plan fits the device; otherwise
    the streaming oracle computes oracle_sequences sequences: the last one and random others.
    """
    config = LayerConfig(x.shape[0], x.shape[1], model.config.d_model, model.config.num_heads,
                         model.config.ffn_dim, model.config.num_layers, model.config.causal)
    try:
        check_fits(baseline_plan(config), x.device, what="strict baseline")
    except MemoryPlanError:
        count = min(oracle_sequences, x.shape[0])
        others = torch.randperm(x.shape[0] - 1, generator=generator)[:count - 1].tolist()
        indices = sorted(set(others + [x.shape[0] - 1]))
        out = streaming_forward(model.state_dict(), config, x, mask, indices, device=x.device)
        return out, indices
    device_model = model.to(x.device)
    try:
        return reference_forward(device_model, x.float(), mask, precision="ieee"), None
    finally:
        model.to("cpu")
