"""Operation counts of the stack and the fp16 tensor-core floor of known GPUs."""
from __future__ import annotations

import os

import torch

from .config import LayerConfig

# Dense fp16/bf16 tensor-core rate (datasheet, TFLOP/s) by a substring of the device name.
FP16_TENSOR_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0,
                      "RTX 4090": 165.2, "A10": 125.0}


def forward_flops(config: LayerConfig) -> float:
    """FLOPs of one forward: the four projections, the FFN and causal attention (half counted)."""
    t, d, f, s = config.tokens, config.d_model, config.ffn_dim, config.seq_len
    linear = 2 * t * d * (4 * d + 2 * f)
    pairs = s * (s + 1) / 2 if config.causal else s * s
    attention = 2 * 2 * config.batch_size * pairs * d  # QK^T and PV over all heads
    return float(config.num_layers * (linear + attention))


def fp16_peak_tflops(device) -> float | None:
    """The device's dense fp16 tensor-core rate; LAYERBENCH_PEAK_TFLOPS overrides the table."""
    if os.environ.get("LAYERBENCH_PEAK_TFLOPS"):
        return float(os.environ["LAYERBENCH_PEAK_TFLOPS"])
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in FP16_TENSOR_TFLOPS.items():
        if key in name:
            return value
    return None


def throughput(config: LayerConfig, median_ms: float, device) -> dict:
    """Achieved TFLOP/s and the fraction of the fp16 tensor-core floor for one median time."""
    flops = forward_flops(config)
    tflops = flops / (median_ms * 1e-3) / 1e12
    peak = fp16_peak_tflops(device)
    return {"tflops": tflops, "fraction_of_fp16_floor": None if peak is None else tflops / peak}
