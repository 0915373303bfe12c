"""Parameter packing: a reference state_dict turned into per-layer tensors on a device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .config import LayerConfig

LAYER_KEYS = (
    "norm1.weight", "norm1.bias",
    "attention.q_proj.weight", "attention.q_proj.bias",
    "attention.k_proj.weight", "attention.k_proj.bias",
    "attention.v_proj.weight", "attention.v_proj.bias",
    "attention.out_proj.weight", "attention.out_proj.bias",
    "norm2.weight", "norm2.bias",
    "ffn_in.weight", "ffn_in.bias", "ffn_out.weight", "ffn_out.bias",
)


def expected_keys(config: LayerConfig) -> list[str]:
    """Every state_dict key a stack of this config has."""
    keys = [f"layers.{i}.{k}" for i in range(config.num_layers) for k in LAYER_KEYS]
    return keys + ["final_norm.weight", "final_norm.bias"]


def check_state_dict(config: LayerConfig, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise KeyError/ValueError unless state_dict has exactly the config's keys and shapes."""
    want = expected_keys(config)
    missing = [k for k in want if k not in state_dict]
    extra = [k for k in state_dict if k not in set(want)]
    if missing or extra:
        raise KeyError(f"state_dict mismatch: missing {missing[:4]}, unexpected {extra[:4]}")
    d, f = config.d_model, config.ffn_dim
    shapes = {"norm1.weight": (d,), "norm1.bias": (d,), "norm2.weight": (d,),
              "norm2.bias": (d,), "ffn_in.weight": (f, d), "ffn_in.bias": (f,),
              "ffn_out.weight": (d, f), "ffn_out.bias": (d,)}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        shapes[f"attention.{proj}.weight"] = (d, d)
        shapes[f"attention.{proj}.bias"] = (d,)
    for key in want:
        suffix = key.split(".", 2)[-1] if key.startswith("layers.") else None
        expected = shapes[suffix] if suffix else (d,)
        if tuple(state_dict[key].shape) != expected:
            raise ValueError(f"{key} has shape {tuple(state_dict[key].shape)}, expected {expected}")


@dataclass
class LayerParams:
    """One block's parameters; qkv_weight/qkv_bias are q, k, v stacked along the output dim."""

    norm1_weight: torch.Tensor
    norm1_bias: torch.Tensor
    qkv_weight: torch.Tensor  # [3D, D]
    qkv_bias: torch.Tensor  # [3D]
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    norm2_weight: torch.Tensor
    norm2_bias: torch.Tensor
    ffn_in_weight: torch.Tensor
    ffn_in_bias: torch.Tensor
    ffn_out_weight: torch.Tensor
    ffn_out_bias: torch.Tensor


@dataclass
class StackParams:
    """All blocks plus the final norm."""

    layers: list[LayerParams]
    final_weight: torch.Tensor
    final_bias: torch.Tensor


def pack_params(config: LayerConfig, state_dict: Mapping[str, torch.Tensor], *,
                device, dtype: torch.dtype = torch.float32,
                weight_dtype: torch.dtype | None = None) -> StackParams:
    """Check and pack a state_dict; matrices in weight_dtype (default dtype), vectors in dtype.

    Every tensor is a fresh allocation (so aligned as the allocator aligns, and independent of
    the caller's tensors, which may be views at any offset of a larger buffer)."""
    check_state_dict(config, state_dict)
    weight_dtype = weight_dtype or dtype

    def get(key, dt):
        return state_dict[key].detach().to(device=device, dtype=dt, copy=True,
                                           memory_format=torch.contiguous_format)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        qkv_w = torch.cat([state_dict[p + f"attention.{n}_proj.weight"].detach()
                           for n in "qkv"]).to(device=device, dtype=weight_dtype).contiguous()
        qkv_b = torch.cat([state_dict[p + f"attention.{n}_proj.bias"].detach()
                           for n in "qkv"]).to(device=device, dtype=dtype).contiguous()
        layers.append(LayerParams(
            get(p + "norm1.weight", dtype), get(p + "norm1.bias", dtype), qkv_w, qkv_b,
            get(p + "attention.out_proj.weight", weight_dtype),
            get(p + "attention.out_proj.bias", dtype),
            get(p + "norm2.weight", dtype), get(p + "norm2.bias", dtype),
            get(p + "ffn_in.weight", weight_dtype), get(p + "ffn_in.bias", dtype),
            get(p + "ffn_out.weight", weight_dtype), get(p + "ffn_out.bias", dtype),
        ))
    return StackParams(layers, get("final_norm.weight", dtype), get("final_norm.bias", dtype))


def param_bytes(config: LayerConfig, bytes_per_element: int = 4) -> int:
    """Bytes of one copy of the stack's parameters."""
    d, f = config.d_model, config.ffn_dim
    per_layer = 4 * d * d + 2 * d * f + 9 * d + f
    return (config.num_layers * per_layer + 2 * d) * bytes_per_element
