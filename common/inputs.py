"""The official inputs (docs/spec.md): seeded randn rows, padding at the end of sequences."""
from __future__ import annotations

import torch

from .config import LayerConfig


def make_inputs(config: LayerConfig, *, padding_ratio: float = 0.0, seed: int = 0,
                device="cpu", dtype: torch.dtype = torch.float32, input_scale: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [B,S,D], valid_token_mask [B,S]); padded positions are invalid and their x rows zero.

    With padding_ratio p, each sequence's length is uniform in [max(1, round(S(1-p))), S].
    The mask is always a tensor (all True when p == 0), as the official inputs pass it.
    """
    if not 0.0 <= padding_ratio < 1.0:
        raise ValueError(f"padding_ratio must be in [0, 1), got {padding_ratio}")
    device = torch.device(device)
    b, s, d = config.batch_size, config.seq_len, config.d_model
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, s, d, generator=gen, device=device, dtype=torch.float32)
    if input_scale != 1.0:
        x.mul_(input_scale)
    x = x.to(dtype)
    if padding_ratio > 0:
        shortest = max(1, round(s * (1 - padding_ratio)))
        lengths = torch.randint(shortest, s + 1, (b,), generator=gen, device=device)
        mask = torch.arange(s, device=device)[None, :] < lengths[:, None]
        x.masked_fill_(~mask[..., None], 0.0)
    else:
        mask = torch.ones(b, s, dtype=torch.bool, device=device)
    return x, mask


def prefix_lengths(valid_token_mask: torch.Tensor) -> torch.Tensor | None:
    """Per-sequence valid lengths if every row of the mask is a prefix of Trues, else None.

    This costs one device-to-host sync; suffix padding (the official inputs') makes key masking a
    no-op for every valid causal query, which backends may use.
    """
    lengths = valid_token_mask.sum(dim=1)
    positions = torch.arange(valid_token_mask.shape[1], device=valid_token_mask.device)
    if bool(((positions[None, :] < lengths[:, None]) == valid_token_mask).all()):
        return lengths
    return None
