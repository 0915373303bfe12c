"""LayerNorm launches (norm.cu): rows into an fp16 (hi, lo) pair, or the final norm."""
from __future__ import annotations

import torch

LN_EPS = 1e-5


def norm_split(ext, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor | None], copy: torch.Tensor | None = None
               ) -> None:
    """out = fp16 (hi, lo) parts of LayerNorm(x [M, D]) (lo None: hi only); copy, if given,
    receives x in fp32."""
    ext.norm_split(x, weight, bias, out[0], out[1], copy, LN_EPS)


def norm_out(ext, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
             valid_rows: torch.Tensor | None) -> None:
    """out [M, D] (its own dtype) = LayerNorm(x [M, D] fp32); rows with valid_rows 0 are 0."""
    ext.norm_out(x, weight, bias, out, valid_rows, LN_EPS)
