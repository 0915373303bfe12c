"""Linear-layer launches (linear.cu): a @ w^T + bias with a fused epilogue on wmma."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .norm import LN_EPS

# The Epilogue values of common.cuh.
HALF, GELU_PAIR, RESIDUAL_UPDATE, RESIDUAL_SUM = 0, 1, 2, 3

Pair = tuple[torch.Tensor, "torch.Tensor | None"]


class RowNorm(NamedTuple):
    """The norm epilogue of a residual linear: out = LayerNorm(each written fp32 row) * weight +
    bias. An fp16 out receives the hi part (and lo, if given, the lo part: fp16 (hi, lo) pair);
    fp32/bf16 out the rows in its dtype. zero_invalid: rows with valid_rows 0 are written as 0
    (the final norm; without it they are normalised like any row)."""
    weight: torch.Tensor
    bias: torch.Tensor
    out: torch.Tensor
    lo: torch.Tensor | None = None
    zero_invalid: bool = False


def linear(ext, a: Pair, w: Pair, bias: torch.Tensor, *, epilogue: int, tile: int,
           out: torch.Tensor | None = None, out_pair: Pair | None = None,
           residual: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
           norm: RowNorm | None = None) -> None:
    """Run one linear: a and w are fp16 (hi, lo) pairs ([M, K] and [N, K]). Both lo parts
    given: three products (a_lo*w_hi + a_hi*w_lo + a_hi*w_hi); w's lo None: two (a_lo*w_hi +
    a_hi*w_hi); both None: one (a_hi*w_hi); a w lo without an a lo is refused. tile is a
    GEMM_TILES index (tiles.py; the stream variants need K <= 128). HALF writes out_pair[0],
    GELU_PAIR both of out_pair, the residual epilogues out (fp32, may be residual itself).
    norm (residual epilogues, a stream tile whose columns hold N, two or three products) also
    writes the LayerNorm of each row (RowNorm); out may then be None. norm.out may be a's own
    buffers (each CTA holds the rows it writes)."""
    out_hi, out_lo = out_pair if out_pair is not None else (None, None)
    if norm is None:
        ext.linear(a[0], a[1], w[0], w[1], bias, epilogue, residual, valid_rows, out, out_hi,
                   out_lo, tile)
    else:
        ext.linear(a[0], a[1], w[0], w[1], bias, epilogue, residual, valid_rows, out, out_hi,
                   out_lo, tile, norm.weight, norm.bias, norm.out, norm.lo, norm.zero_invalid,
                   LN_EPS)
