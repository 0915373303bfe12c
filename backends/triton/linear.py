"""Linear layers as Triton GEMM kernels with fused epilogues.

y = a @ W^T + bias, then optionally exact GELU, or a residual add with invalid-row zeroing.
fused_linear (the general plan, any precision mode) takes fp32 rows and can apply a
LayerNorm prologue whose row statistics it computes itself (two passes over K);
split_linear (the wide plan) takes operands already split into fp16 (hi, lo) pairs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .precision import INTERPRETER, gelu, mma, mma_split, pad16, split_dot, store_rows

# Where invalid rows are zeroed in the residual epilogue.
ZERO_NONE, ZERO_UPDATE, ZERO_SUM = 0, 1, 2


@triton.jit
def _epilogue(acc, bias_ptr, res_ptr, valid_ptr, rows, cols, row_ok, col_ok, N,
              GELU: tl.constexpr, RESIDUAL: tl.constexpr, ZERO_MODE: tl.constexpr,
              HAS_VALID: tl.constexpr):
    """acc + bias, then exact GELU, or the residual add with invalid rows zeroed (ZERO_MODE);
    returns it with the tile's output offsets and mask (row-major [M, N])."""
    acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if GELU:
        acc = gelu(acc)
    out_ok = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    if RESIDUAL:
        if HAS_VALID:
            valid = tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0
        if ZERO_MODE == 1 and HAS_VALID:
            acc = tl.where(valid[:, None], acc, 0.0)
        acc += tl.load(res_ptr + offsets, mask=out_ok, other=0.0).to(tl.float32)
        if ZERO_MODE == 2 and HAS_VALID:
            acc = tl.where(valid[:, None], acc, 0.0)
    return acc, offsets, out_ok


@triton.jit
def fused_linear_kernel(
    a_ptr, w_ptr, w_lo_ptr, bias_ptr, out_ptr, res_ptr, valid_ptr, ln_w_ptr, ln_b_ptr,
    M, N, K, eps,
    LN: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr, ZERO_MODE: tl.constexpr,
    HAS_VALID: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out = epilogue(prologue(a) @ w^T + bias).

    Programs are numbered column tile fastest, so the programs sharing a row block of a run
    together and read it from L2 instead of from memory once per column tile.
    """
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N

    if LN:
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            tile_ok = row_ok[:, None] & (ks < K)[None, :]
            x = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=tile_ok, other=0.0)
            total += tl.sum(x.to(tl.float32), axis=1)
        mean = total / K
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            tile_ok = row_ok[:, None] & (ks < K)[None, :]
            x = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=tile_ok, other=0.0)
            d = tl.where(tile_ok, x.to(tl.float32) - mean[:, None], 0.0)
            sq += tl.sum(d * d, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        tile_ok = row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=tile_ok, other=0.0)
        a = a.to(tl.float32)
        if LN:
            g = tl.load(ln_w_ptr + ks, mask=k_ok, other=0.0)
            b = tl.load(ln_b_ptr + ks, mask=k_ok, other=0.0)
            a = (a - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
            a = tl.where(tile_ok, a, 0.0)
        w_offsets = cols[None, :] * K + ks[:, None]
        w_ok = col_ok[None, :] & k_ok[:, None]
        w = tl.load(w_ptr + w_offsets, mask=w_ok, other=0.0)
        if PRECISION == "fp16x3":
            w_lo = tl.load(w_lo_ptr + w_offsets, mask=w_ok, other=0.0)
            acc = mma_split(a, w, w_lo, acc)
        else:
            acc = mma(a, w, acc, PRECISION)

    acc, offsets, out_ok = _epilogue(acc, bias_ptr, res_ptr, valid_ptr, rows, cols, row_ok,
                                     col_ok, N, GELU, RESIDUAL, ZERO_MODE, HAS_VALID)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def _interpreter_tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """Large tiles for the CPU interpreter (fewer numpy block ops), one warp group, no stages."""
    return min(128, pad16(m)), min(256, pad16(n)), min(256, pad16(k)), 4, 1


def tile_config(m: int, n: int, k: int, precision: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): 128x128 tiles once the problem is large."""
    if INTERPRETER:
        return _interpreter_tiles(m, n, k)
    four_byte = precision not in ("fp16", "fp16x3")
    block_k = 32 if k <= 32 or four_byte else 64
    if m >= 8192 and n >= 256 and k >= 256:
        return 128, 128, block_k, 8, (2 if precision == "fp16x3" or four_byte else 3)
    return 64, 64, block_k, 4, 3


def fused_linear(a: torch.Tensor, weight, bias: torch.Tensor, out: torch.Tensor,
                 *, precision: str, ln: tuple[torch.Tensor, torch.Tensor] | None = None,
                 gelu: bool = False, residual: torch.Tensor | None = None,
                 zero_mode: int = ZERO_NONE, valid: torch.Tensor | None = None,
                 eps: float = 1e-5) -> torch.Tensor:
    """out[M, N] = epilogue(LN?(a[M, K]) @ weight[N, K]^T + bias); see the kernel's flags.

    weight is one [N, K] tensor, or its (hi, lo) fp16 pair for the "fp16x3" precision
    (and only then: a pair read in another mode would lose its low part, a single tensor
    read as a pair would be counted twice).
    """
    if isinstance(weight, tuple) != (precision == "fp16x3"):
        want = "an (hi, lo) fp16 pair" if precision == "fp16x3" else "one tensor"
        got = "a pair" if isinstance(weight, tuple) else "one tensor"
        raise ValueError(f"fused_linear in {precision!r} takes {want} as its weight, not {got}")
    w_hi, w_lo = weight if isinstance(weight, tuple) else (weight, weight)
    m, k = a.shape
    n = w_hi.shape[0]
    block_m, block_n, block_k, warps, stages = tile_config(m, n, k, precision)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    ln_w, ln_b = ln if ln is not None else (bias, bias)
    fused_linear_kernel[grid](
        a, w_hi, w_lo, bias, out, residual if residual is not None else out,
        valid if valid is not None else bias, ln_w, ln_b,
        m, n, k, eps,
        LN=ln is not None, GELU=gelu, RESIDUAL=residual is not None, ZERO_MODE=zero_mode,
        HAS_VALID=valid is not None, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def split_linear_kernel(
    a_hi_ptr, a_lo_ptr, w_hi_ptr, w_lo_ptr, bias_ptr, out_ptr, out_lo_ptr, res_ptr, valid_ptr,
    M, N, K,
    GELU: tl.constexpr, RESIDUAL: tl.constexpr, ZERO_MODE: tl.constexpr,
    HAS_VALID: tl.constexpr, SPLIT_OUT: tl.constexpr, GROUP_M: tl.constexpr,
    PRODUCTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One tile of out = epilogue((a_hi + a_lo) @ (w_hi + w_lo)^T + bias), operands in fp16,
    in three products (PRODUCTS 3) or as a_hi @ w_hi^T (PRODUCTS 1).

    Both operands arrive already split, so every tile goes straight from memory to the
    tensor cores; programs run in groups of GROUP_M row blocks that share column tiles in L2.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a_offsets = rows[:, None] * K + ks[None, :]
        a_ok = row_ok[:, None] & k_ok[None, :]
        w_offsets = cols[None, :] * K + ks[:, None]
        w_ok = col_ok[None, :] & k_ok[:, None]
        a_hi = tl.load(a_hi_ptr + a_offsets, mask=a_ok, other=0.0)
        w_hi = tl.load(w_hi_ptr + w_offsets, mask=w_ok, other=0.0)
        if PRODUCTS == 3:
            a_lo = tl.load(a_lo_ptr + a_offsets, mask=a_ok, other=0.0)
            w_lo = tl.load(w_lo_ptr + w_offsets, mask=w_ok, other=0.0)
            acc = split_dot(a_hi, a_lo, w_hi, w_lo, acc)
        else:  # the high parts alone: plain fp16 operands
            acc = tl.dot(a_hi, w_hi, acc)

    acc, offsets, out_ok = _epilogue(acc, bias_ptr, res_ptr, valid_ptr, rows, cols, row_ok,
                                     col_ok, N, GELU, RESIDUAL, ZERO_MODE, HAS_VALID)
    store_rows(out_ptr, out_lo_ptr, offsets, acc, out_ok, SPLIT_OUT)


SPLIT_TILES = (128, 128, 64, 8, 3)  # bench/PERFORMANCE.md, entry 10


def split_tile_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for the pre-split fp16 GEMM."""
    if INTERPRETER:
        return _interpreter_tiles(m, n, k)
    if m >= 4096 and n >= 256:
        return SPLIT_TILES
    return 64, 64, 64, 4, 3


def split_linear(a: tuple[torch.Tensor, torch.Tensor], weight: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor, out, *, gelu: bool = False,
                 residual: torch.Tensor | None = None, zero_mode: int = ZERO_NONE,
                 valid: torch.Tensor | None = None, products: int = 3, tiles=None):
    """out = epilogue((a_hi + a_lo) @ (w_hi + w_lo)^T + bias) from fp16 (hi, lo) pairs.

    out is one tensor, or an fp16 (hi, lo) pair that receives the result split again;
    products=1 uses the high parts alone (fp16 operands).
    """
    if products not in (1, 3):
        raise ValueError(f"products must be 1 or 3, got {products}")
    (a_hi, a_lo), (w_hi, w_lo) = a, weight
    out_hi, out_lo = out if isinstance(out, tuple) else (out, out)
    m, k = a_hi.shape
    n = w_hi.shape[0]
    block_m, block_n, block_k, warps, stages = tiles or split_tile_config(m, n, k)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    split_linear_kernel[grid](
        a_hi, a_lo, w_hi, w_lo, bias, out_hi, out_lo,
        residual if residual is not None else out_hi, valid if valid is not None else bias,
        m, n, k,
        GELU=gelu, RESIDUAL=residual is not None, ZERO_MODE=zero_mode,
        HAS_VALID=valid is not None, SPLIT_OUT=isinstance(out, tuple), GROUP_M=8,
        PRODUCTS=products, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return out
