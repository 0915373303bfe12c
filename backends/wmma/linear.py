"""Linear-layer launches (linear.cu): a @ w^T + bias with a fused epilogue on wmma."""
from __future__ import annotations

import torch

# The Epilogue values of common.cuh.
HALF, GELU_PAIR, RESIDUAL_UPDATE, RESIDUAL_SUM = 0, 1, 2, 3

Pair = tuple[torch.Tensor, "torch.Tensor | None"]


def linear(ext, a: Pair, w: Pair, bias: torch.Tensor, *, epilogue: int, tile: int,
           out: torch.Tensor | None = None, out_pair: Pair | None = None,
           residual: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None
           ) -> None:
    """Run one linear: a and w are fp16 (hi, lo) pairs ([M, K] and [N, K]; lo None for one
    product); HALF writes out_pair[0], GELU_PAIR both of out_pair, the residual epilogues
    out (fp32, may be residual itself)."""
    out_hi, out_lo = out_pair if out_pair is not None else (None, None)
    ext.linear(a[0], a[1], w[0], w[1], bias, epilogue, residual, valid_rows, out, out_hi, out_lo,
               tile)
