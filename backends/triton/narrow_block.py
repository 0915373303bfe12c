"""A block in two kernels when whole rows fit a tile (d_model and ffn_dim up to 128).

norm_qkv: norm1 and the Q/K/V projection of a block of whole rows. Attention runs in between
as flash_attention (a program per query block and head), which writes the context as an fp16
pair. attention_ffn: a program reads its rows' context into out_proj (or, with heads_apart
off, runs attention head by head and feeds each head's context straight into out_proj), then
adds the residual, applies norm2, ffn_in with GELU, ffn_out and the second residual, and
(after the last block) the final LayerNorm. The FFN hidden rows never reach memory. Both
attention paths are causal or not, and take any head dim (padded to HEAD_PAD).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from layerbench.common.cuda_host import multiprocessor_count

from .attention import attend_head, softmax_scale
from .launch import dependent_launch, start_after_previous
from .precision import INTERPRETER, gelu, mma_split, pad16, split_dot, split_halves

MAX_WIDTH = 128  # widest padded d_model / ffn_dim a program holds


@triton.jit
def _row_norm(x, w_ptr, b_ptr, cols, col_ok, D, eps):
    """LayerNorm of every row of x [rows, D_PAD] (padding columns give 0)."""
    mean = tl.sum(x, axis=1) / D
    diff = tl.where(col_ok[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    return diff * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def _weight_tile(hi_ptr, lo_ptr, out_idx, out_ok, in_idx, in_ok, IN):
    """The fp16 (hi, lo) tiles [len(in_idx), len(out_idx)] of a weight stored [OUT, IN]."""
    offsets = out_idx[None, :] * IN + in_idx[:, None]
    ok = out_ok[None, :] & in_ok[:, None]
    return (tl.load(hi_ptr + offsets, mask=ok, other=0.0),
            tl.load(lo_ptr + offsets, mask=ok, other=0.0))


@triton.jit
def norm_qkv_kernel(x_ptr, qkv_ptr, n1_w, n1_b, wq_hi, wq_lo, bq_ptr, M, D, eps,
                    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PARTS: tl.constexpr,
                    PRODUCTS: tl.constexpr, PDL: tl.constexpr):
    """Q/K/V rows (fp16) of BLOCK_M tokens: each row is read, normed and split once per
    program; program_id(1) picks which PARTS of Q, K and V the program writes; PRODUCTS 3
    (fp16x3) or 1 (fp16 operands)."""
    start_after_previous(PDL)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    ok = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    h = _row_norm(x, n1_w, n1_b, cols, col_ok, D, eps)
    h_hi, h_lo = split_halves(h)
    for i in tl.static_range(PARTS):
        out_idx = (tl.program_id(1) * PARTS + i) * D + cols
        w_hi, w_lo = _weight_tile(wq_hi, wq_lo, out_idx, col_ok, cols, col_ok, D)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        if PRODUCTS == 3:
            acc = split_dot(h_hi, h_lo, w_hi, w_lo, acc)
        else:  # fp16 operands
            acc = tl.dot(h_hi, w_hi, acc)
        acc += tl.load(bq_ptr + out_idx, mask=col_ok, other=0.0)[None, :]
        tl.store(qkv_ptr + rows[:, None] * (3 * D) + out_idx[None, :],
                 acc.to(qkv_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _head_into_out_proj(attn, qkv_ptr, valid_ptr, key_end_ptr, wo_hi, wo_lo, b, h, S, D,
                        q_start, qk_scale, cols, col_ok, HEAD_DIM: tl.constexpr,
                        HEAD_PAD: tl.constexpr, HAS_VALID: tl.constexpr,
                        ATT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """attn + (head h's attention output) @ (its rows of out_proj^T)."""
    head_cols = tl.arange(0, HEAD_PAD)
    ctx = attend_head(qkv_ptr, valid_ptr, key_end_ptr, b, h, S, D, q_start, qk_scale,
                      HEAD_DIM, HEAD_PAD, HAS_VALID, ATT_PRECISION, BLOCK_M, BLOCK_N, CAUSAL)
    w_hi, w_lo = _weight_tile(wo_hi, wo_lo, cols, col_ok, h * HEAD_DIM + head_cols,
                              head_cols < HEAD_DIM, D)
    return mma_split(ctx, w_hi, w_lo, attn)


@triton.jit
def attention_ffn_kernel(
    qkv_ptr, ctx_hi_ptr, ctx_lo_ptr, x_ptr, out_ptr, valid_ptr, key_end_ptr,
    wo_hi, wo_lo, bo_ptr, n2_w, n2_b, wi_hi, wi_lo, bi_ptr, wf_hi, wf_lo, bf_ptr, fn_w, fn_b,
    S, D, F, qk_scale, eps,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, D_PAD: tl.constexpr,
    F_PAD: tl.constexpr, HAS_VALID: tl.constexpr, FINAL: tl.constexpr,
    ATT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    F_CHUNK: tl.constexpr, CTX_IN_MEMORY: tl.constexpr, PDL: tl.constexpr, CAUSAL: tl.constexpr,
):
    """BLOCK_M query rows of sequence program_id(1): attention, causal or not (CAUSAL) (or,
    CTX_IN_MEMORY, its output read as an fp16 pair), out_proj, FFN, residuals, and the final
    LayerNorm (FINAL)."""
    start_after_previous(PDL)
    q_start = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    m_ok = offs_m < S
    rows = b.to(tl.int64) * S + offs_m
    cols = tl.arange(0, D_PAD)
    col_ok = cols < D

    row_ok = m_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * D + cols[None, :]

    attn = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    if CTX_IN_MEMORY:  # the context rows, already split, from flash_attention
        w_hi, w_lo = _weight_tile(wo_hi, wo_lo, cols, col_ok, cols, col_ok, D)
        attn = split_dot(tl.load(ctx_hi_ptr + offsets, mask=row_ok, other=0.0),
                         tl.load(ctx_lo_ptr + offsets, mask=row_ok, other=0.0), w_hi, w_lo, attn)
    else:
        for h in range(H):
            attn = _head_into_out_proj(attn, qkv_ptr, valid_ptr, key_end_ptr, wo_hi, wo_lo, b,
                                       h, S, D, q_start, qk_scale, cols, col_ok, HEAD_DIM,
                                       HEAD_PAD, HAS_VALID, ATT_PRECISION, BLOCK_M, BLOCK_N,
                                       CAUSAL)
    attn += tl.load(bo_ptr + cols, mask=col_ok, other=0.0)[None, :]

    if HAS_VALID:
        valid = tl.load(valid_ptr + rows, mask=m_ok, other=0) != 0
        attn = tl.where(valid[:, None], attn, 0.0)
    x = tl.load(x_ptr + offsets, mask=row_ok, other=0.0).to(tl.float32) + attn

    n_hi, n_lo = split_halves(_row_norm(x, n2_w, n2_b, cols, col_ok, D, eps))
    x += tl.load(bf_ptr + cols, mask=col_ok, other=0.0)[None, :]
    for f0 in tl.static_range(0, F_PAD, F_CHUNK):  # F_CHUNK hidden columns at a time
        hcols = f0 + tl.arange(0, F_CHUNK)
        hcol_ok = hcols < F
        w_hi, w_lo = _weight_tile(wi_hi, wi_lo, hcols, hcol_ok, cols, col_ok, D)
        hidden = split_dot(n_hi, n_lo, w_hi, w_lo,
                           tl.zeros([BLOCK_M, F_CHUNK], dtype=tl.float32))
        hidden = gelu(hidden + tl.load(bi_ptr + hcols, mask=hcol_ok, other=0.0)[None, :])
        w_hi, w_lo = _weight_tile(wf_hi, wf_lo, cols, col_ok, hcols, hcol_ok, F)
        x = mma_split(hidden, w_hi, w_lo, x)

    if FINAL:
        x = _row_norm(x, fn_w, fn_b, cols, col_ok, D, eps)
    if HAS_VALID:
        x = tl.where(valid[:, None], x, 0.0)
    tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=row_ok)


def fits(d_model: int, ffn_dim: int) -> bool:
    """Whether whole rows of this layer fit one program's tile."""
    return max(d_model, ffn_dim) <= MAX_WIDTH


class NarrowTiles(NamedTuple):
    """Tile choices of the narrow plan's two kernels."""
    block_m: int  # query rows per attention_ffn program
    block_n: int  # keys per attention step (block_m must be a multiple)
    warps: int
    stages: int
    ffn_chunk: int  # hidden columns attention_ffn holds at once
    qkv_parts: int  # of Q, K, V per norm_qkv program: 3 (rows read once), 1, 0 = by grid size
    heads_apart: bool = True  # attention in its own kernel, a program per (block, head);
    # False: attention_ffn runs the heads one after another
    apart_rows: int = 0  # rows per program of all three kernels when attention runs apart;
    # 0: by grid size (rows_apart)


# bench/PERFORMANCE.md, #14, #19-20, #25, #28, #35
NARROW_TILES = NarrowTiles(64, 64, 4, 3, 64, 0, True, 0)


def block_config() -> NarrowTiles:
    """The narrow plan's tile choices here (small tiles in the interpreter)."""
    if INTERPRETER:  # several FFN chunks and a split Q/K/V grid, so both paths run on CPU
        return NarrowTiles(64, 64, 4, 1, 32, 1, True)
    return NARROW_TILES


def rows_apart(rows: int, device: torch.device) -> int:
    """Rows per program of the three kernels when attention runs apart: the tiles' apart_rows,
    or the fewest of 16 and 32 that keep the grid within one program per multiprocessor
    (else 64)."""
    chosen = block_config().apart_rows
    if chosen:
        return chosen
    sms = multiprocessor_count(device)
    return next((r for r in (16, 32) if triton.cdiv(rows, r) <= sms), 64)


def apart_attention_tiles(rows: int) -> tuple[int, int, int, int]:
    """flash_attention's (BLOCK_M, BLOCK_N, warps, stages) when it runs apart, rows per program."""
    tiles = block_config()
    return rows, min(rows, tiles.block_n), tiles.warps, tiles.stages


def heads_apart() -> bool:
    """Whether the narrow plan runs attention in its own kernel, a program per query block
    and head, with out_proj and the FFN in attention_ffn."""
    return block_config().heads_apart


def norm_qkv(x: torch.Tensor, qkv: torch.Tensor, p, w, eps: float = 1e-5,
             config: NarrowTiles | None = None, products: int = 3,
             block_m: int = 64) -> torch.Tensor:
    """qkv[M, 3D] = LN1(x) @ Wqkv^T + b, one program per block_m whole rows and parts, in
    three fp16 products (fp16x3) or one (fp16 operands)."""
    m, d = x.shape
    row_blocks = triton.cdiv(m, block_m)
    parts = (config or block_config()).qkv_parts
    if parts == 0:  # a grid that leaves most of the GPU idle gets a program per Q, K, V part
        parts = 1 if 3 * row_blocks <= multiprocessor_count(x.device) else 3
    if parts not in (1, 3):
        raise ValueError(f"qkv_parts must be 0, 1 or 3, got {parts}")
    norm_qkv_kernel[(row_blocks, 3 // parts)](
        x, qkv, p.norm1_weight, p.norm1_bias, *w["qkv_weight"], p.qkv_bias, m, d, eps,
        D_PAD=pad16(d), BLOCK_M=block_m, PARTS=parts, PRODUCTS=products, num_warps=4,
        **dependent_launch())
    return qkv


def attention_ffn(qkv: torch.Tensor, x: torch.Tensor, out: torch.Tensor, valid, key_end, p, w,
                  *, final=None, batch: int, seq_len: int, num_heads: int,
                  precision: str, eps: float = 1e-5, config=None, ctx=None,
                  block_m: int | None = None, causal: bool = True) -> torch.Tensor:
    """out = the block's output rows from its qkv and input rows x (x and out may alias).

    valid is the flat [B*S] mask or None, key_end its key_extent; p holds the layer's fp32
    parameters, w its (hi, lo) weights; final is (weight, bias) of the final LayerNorm to
    apply after this block; ctx, an fp16 (hi, lo) pair, is attention's output when it ran
    apart (then qkv is not read, and block_m, if given, sets the rows per program); causal
    picks the attention run in the program when ctx is None.
    """
    d = x.shape[1]
    f = p.ffn_in_bias.shape[0]
    head_dim = d // num_heads
    tiles = config or block_config()
    block_m = block_m if ctx is not None and block_m else tiles.block_m
    if ctx is None and tiles.block_m % tiles.block_n:
        raise ValueError(f"block_m {tiles.block_m} must be a multiple of block_n {tiles.block_n}")
    fn_w, fn_b = final if final is not None else (p.out_bias, p.out_bias)
    grid = (triton.cdiv(seq_len, block_m), batch)
    attention_ffn_kernel[grid](
        qkv, *(ctx or (qkv, qkv)), x, out, valid if valid is not None else qkv,
        key_end if valid is not None else qkv,
        *w["out_weight"], p.out_bias, p.norm2_weight, p.norm2_bias,
        *w["ffn_in_weight"], p.ffn_in_bias, *w["ffn_out_weight"], p.ffn_out_bias, fn_w, fn_b,
        seq_len, d, f, softmax_scale(head_dim), eps,
        H=num_heads, HEAD_DIM=head_dim, HEAD_PAD=pad16(head_dim), D_PAD=pad16(d), F_PAD=pad16(f),
        HAS_VALID=valid is not None, FINAL=final is not None,
        ATT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        F_CHUNK=min(tiles.ffn_chunk, pad16(f)),
        CTX_IN_MEMORY=ctx is not None, CAUSAL=bool(causal), **dependent_launch(),
        num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out
