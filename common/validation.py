"""Input validation shared by every built layer: one place, one set of messages."""
from __future__ import annotations

import torch

from .config import LayerConfig


def validate_inputs(x, valid_token_mask, *, config: LayerConfig, device: torch.device,
                    dtype: torch.dtype, padding: bool = True, who: str = "layer") -> None:
    """Raise TypeError/ValueError with a clear message if (x, mask) cannot go to this layer.

    Rules: x is a contiguous [B, S, d_model] tensor of the layer's dtype on the layer's device;
    the mask is None or a contiguous bool [B, S] tensor on the same device. B may be 0.
    NaN/Inf values are not checked: they propagate as in the reference.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: x must be a torch.Tensor, got {type(x).__name__}")
    _check_strided(x, "x", who)
    if x.dim() != 3:
        raise ValueError(f"{who}: x must have shape [batch, seq, d_model], got rank {x.dim()}")
    if x.shape[2] != config.d_model:
        raise ValueError(f"{who}: x has d_model {x.shape[2]}, the layer was built for "
                         f"{config.d_model}")
    if x.shape[1] == 0:
        raise ValueError(f"{who}: x has seq_len 0")
    if x.dtype != dtype:
        raise TypeError(f"{who}: x has dtype {x.dtype}, the layer was built for {dtype}")
    if x.device != device:
        raise ValueError(f"{who}: x is on {x.device}, the layer lives on {device}")
    if not x.is_contiguous():
        raise ValueError(f"{who}: x must be contiguous (call x.contiguous())")
    if valid_token_mask is None:
        return
    if not isinstance(valid_token_mask, torch.Tensor):
        raise TypeError(f"{who}: valid_token_mask must be a torch.Tensor or None")
    _check_strided(valid_token_mask, "valid_token_mask", who)
    if valid_token_mask.dtype != torch.bool:
        raise TypeError(f"{who}: valid_token_mask must be bool, got {valid_token_mask.dtype}")
    if tuple(valid_token_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{who}: valid_token_mask has shape {tuple(valid_token_mask.shape)}, "
                         f"expected {tuple(x.shape[:2])}")
    if valid_token_mask.device != device:
        raise ValueError(f"{who}: valid_token_mask is on {valid_token_mask.device}, "
                         f"x is on {device}")
    if not valid_token_mask.is_contiguous():
        raise ValueError(f"{who}: valid_token_mask must be contiguous")
    if not padding:
        raise ValueError(f"{who}: this backend takes no valid_token_mask (pass None)")


def validate_output(out, x, valid_token_mask=None, *, who: str = "layer") -> None:
    """Raise TypeError/ValueError unless out is a contiguous tensor like x, apart from x and the mask."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{who}: out must be a torch.Tensor, got {type(out).__name__}")
    _check_strided(out, "out", who)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{who}: out must match x ({tuple(x.shape)}, {x.dtype}, {x.device}); "
                         f"got ({tuple(out.shape)}, {out.dtype}, {out.device})")
    if not out.is_contiguous():
        raise ValueError(f"{who}: out must be contiguous")
    if _overlap(out, x):
        raise ValueError(f"{who}: out must not overlap x (the stack reads x until the end)")
    if valid_token_mask is not None and _overlap(out, valid_token_mask):
        raise ValueError(f"{who}: out must not overlap valid_token_mask (the stack reads the "
                         "mask until the end)")


def _check_strided(t, name: str, who: str) -> None:
    """Raise TypeError unless t is a dense (strided) tensor."""
    if t.layout != torch.strided:
        raise TypeError(f"{who}: {name} must be a dense tensor, got layout {t.layout}")


def _overlap(a, b) -> bool:
    """Whether the memory spans of two contiguous tensors on one device share a byte."""
    # Addresses, not storage objects: two storages may wrap one buffer (torch.from_dlpack).
    if not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
