"""LayerNorm over whole rows: the final norm (invalid rows zeroed, cast to the output dtype)
and the pre-GEMM norms of wide layers (written as an fp16 high/low pair)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .precision import store_rows


@triton.jit
def layer_norm_kernel(x_ptr, out_ptr, out_lo_ptr, w_ptr, b_ptr, valid_ptr, M, D, eps,
                      HAS_VALID: tl.constexpr, SPLIT_OUT: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """ROWS rows of out = where(valid, LayerNorm(x), 0), or its (hi, lo) fp16 split."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    col_ok = cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    diff = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    y = diff * rstd[:, None] * w[None, :] + b[None, :]
    if HAS_VALID:
        valid = tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0
        y = tl.where(valid[:, None], y, 0.0)
    offsets = rows[:, None] * D + cols[None, :]
    store_rows(out_ptr, out_lo_ptr, offsets, y, ok, SPLIT_OUT)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out,
               valid: torch.Tensor | None = None, eps: float = 1e-5):
    """out[M, D] = LayerNorm(x[M, D]) with invalid rows zeroed; out may be an fp16 (hi, lo) pair."""
    m, d = x.shape
    out_hi, out_lo = out if isinstance(out, tuple) else (out, out)
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block_d))
    layer_norm_kernel[(triton.cdiv(m, rows),)](
        x, out_hi, out_lo, weight, bias, valid if valid is not None else x, m, d, eps,
        HAS_VALID=valid is not None, SPLIT_OUT=isinstance(out, tuple), ROWS=rows,
        BLOCK_D=block_d, num_warps=4)
    return out
