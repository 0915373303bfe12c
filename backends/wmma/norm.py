"""LayerNorm launches (norm.cu): rows into an fp16 (hi, lo) pair, or the final norm."""
from __future__ import annotations

import torch

LN_EPS = 1e-5


def norm_split(ext, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor | None], copy: torch.Tensor | None = None,
               in_registers: bool = False) -> None:
    """out = fp16 (hi, lo) parts of LayerNorm(x [M, D]) (lo None: hi only); copy, if given,
    receives x in fp32. in_registers: each warp reads its row once into registers, where D is
    a multiple of 4 up to 1024 and the tensors are aligned for 8- and 16-byte accesses (else
    the row is read three times, element by element)."""
    ext.norm_split(x, weight, bias, out[0], out[1], copy, LN_EPS, in_registers)


def norm_out(ext, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor,
             valid_rows: torch.Tensor | None) -> None:
    """out [M, D] (its own dtype) = LayerNorm(x [M, D] fp32); rows with valid_rows 0 are 0."""
    ext.norm_out(x, weight, bias, out, valid_rows, LN_EPS)
