"""The strict-fp32 truth for a case: the baseline where its scores fit, else the streaming oracle."""
from __future__ import annotations

import torch

from layerbench.common.config import LayerConfig
from layerbench.common.memory import MemoryPlan, fits
from layerbench.common.params import param_bytes

from .model import BaselineStack, reference_forward
from .oracle import oracle_plan, streaming_forward

ORACLE_SEQUENCES = 2  # sequences the streaming oracle checks when the baseline does not fit


def baseline_plan(config: LayerConfig) -> MemoryPlan:
    """Bytes the strict baseline needs: fp32 scores (three live copies) and activations."""
    b, s, h = config.batch_size, config.seq_len, config.num_heads
    return MemoryPlan({"scores": 3 * 4 * b * h * s * s,
                       "activations": 4 * config.tokens * (12 * config.d_model + 3 * config.ffn_dim),
                       "parameters": param_bytes(config)})


def _whole_batch_plan(config: LayerConfig, input_dtype: torch.dtype) -> MemoryPlan:
    """The baseline's plan plus the output it leaves and the fp32 copy of a half input."""
    rows = 4 * config.tokens * config.d_model
    extra = {"baseline output": rows}
    if input_dtype != torch.float32:
        extra["float32 copy of x"] = rows
    return baseline_plan(config).plus(MemoryPlan(extra))


def streams_reference(config: LayerConfig, device: torch.device,
                      input_dtype: torch.dtype = torch.float32, reserve_bytes: int = 0) -> bool:
    """Whether exact_output uses the streaming oracle: the strict baseline on the whole batch
    does not fit the device beside reserve_bytes of other buffers."""
    return not fits(_whole_batch_plan(config, input_dtype), torch.device(device), reserve_bytes)


def reference_plan(config: LayerConfig, device: torch.device,
                   input_dtype: torch.dtype = torch.float32, *, reserve_bytes: int = 0,
                   oracle_sequences: int = ORACLE_SEQUENCES) -> MemoryPlan:
    """Device bytes exact_output allocates for config (beside reserve_bytes of other buffers):
    the whole-batch baseline's when it fits, else the streaming oracle's on its sequences."""
    if streams_reference(config, device, input_dtype, reserve_bytes):
        return oracle_plan(config, min(oracle_sequences, config.batch_size))
    return _whole_batch_plan(config, input_dtype)


@torch.no_grad()
def exact_output(model: BaselineStack, x: torch.Tensor, mask: torch.Tensor | None, *,
                 oracle_sequences: int = ORACLE_SEQUENCES,
                 generator: torch.Generator | None = None, reserve_bytes: int = 0
                 ) -> tuple[torch.Tensor, list[int] | None]:
    """(reference fp32 output, batch indices it covers or None for all) on x's device.

    The whole batch comes from the strict baseline when its plan fits the device beside
    reserve_bytes (buffers the caller allocates later); otherwise the streaming oracle
    computes oracle_sequences sequences: the last one and random others.
    """
    config = LayerConfig(x.shape[0], x.shape[1], model.config.d_model, model.config.num_heads,
                         model.config.ffn_dim, model.config.num_layers, model.config.causal)
    if streams_reference(config, x.device, x.dtype, reserve_bytes):
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
