"""Flash attention forward (causal or not) over the packed [tokens, 3*d_model] QKV buffer.

Online softmax in fp32 (base 2). Causal: key blocks above the diagonal are never visited and
only the diagonal blocks pay for the causal test. Non-causal: every key block is visited and
only the last one pays for the bound test. The key padding mask is applied per key block; a
query row with no visible key gets output 0. Head dims that are not a power of two run in a
tile padded to the next one (HEAD_PAD), with masked loads and stores.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import dependent_launch, start_after_previous
from .precision import INTERPRETER, mma, pad16, store_rows


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D, q_cols, offs_m, d_ok,
                   lo, hi, qk_scale, DIAGONAL: tl.constexpr, MASKED: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BOUNDED: tl.constexpr = False):
    """Online-softmax update over key blocks [lo, hi) with keys < key_end.

    DIAGONAL blocks apply the causal test; MASKED blocks load the key mask; BOUNDED blocks
    apply the key bound alone; other blocks need no test at all.
    """
    row_stride = 3 * D
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < key_end
        rows_n = offs_n.to(tl.int64) * row_stride
        k_t = tl.load(base + rows_n[None, :] + (D + q_cols)[:, None],
                      mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = mma(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION)
        if DIAGONAL or MASKED or BOUNDED:
            allowed = n_ok[None, :]
            if DIAGONAL:
                allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
            if MASKED:
                key_ok = tl.load(valid_ptr + b.to(tl.int64) * S + offs_n, mask=n_ok,
                                 other=0) != 0
                allowed = allowed & key_ok[None, :]
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # scores kept unscaled
        if MASKED:  # a row may have no visible key yet
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * qk_scale - m_safe[:, None])  # one FMA per score before exp2
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base + rows_n[:, None] + (2 * D + q_cols)[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = mma(p, v, acc * alpha[:, None], PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefix_ranges(key_end_ptr, b, S, diag, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(key_end, full_end) of sequence b for the query block from diag: keys past key_end are
    masked (S unless the valid keys form a prefix), and the whole key blocks before full_end
    (<= diag if CAUSAL) need no mask test. A query block wholly past a prefix's end holds
    padding rows, whose context out_proj discards: key_end 0 skips every key block (output 0)."""
    prefix_end = tl.load(key_end_ptr + b)
    key_end = tl.where(prefix_end >= 0, prefix_end, S)
    key_end = tl.where((prefix_end >= 0) & (diag >= prefix_end), 0, key_end)
    if CAUSAL:
        full_end = tl.where(prefix_end >= 0, tl.minimum(diag, (key_end // BLOCK_N) * BLOCK_N), 0)
    else:
        full_end = tl.where(prefix_end >= 0, (key_end // BLOCK_N) * BLOCK_N, 0)
    return key_end, full_end


@triton.jit
def attend_head(qkv_ptr, valid_ptr, key_end_ptr, b, h, S, D, q_start, qk_scale,
                HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HAS_VALID: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Normalised attention output [BLOCK_M, HEAD_PAD] of the BLOCK_M queries from q_start (a
    multiple of BLOCK_M) of head h, sequence b (columns from HEAD_DIM on are 0).

    CAUSAL: key blocks above the diagonal are skipped; blocks below it run without the causal
    test. Otherwise every key block is visited; only the last one tests the key bound.
    With a mask whose valid keys form a prefix (key_end[b] >= 0), blocks past its end are
    skipped and the whole blocks before it run without the mask: only the block holding its
    end (and, CAUSAL, the diagonal blocks) load it. Other masks are loaded for every block.
    """
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    row_stride = 3 * D
    base = qkv_ptr + b.to(tl.int64) * S * row_stride
    q_cols = h * HEAD_DIM + offs_d
    q = tl.load(base + offs_m[:, None].to(tl.int64) * row_stride + q_cols[None, :],
                mask=(offs_m < S)[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    diag = q_start  # a multiple of BLOCK_N
    diag_end = tl.minimum(diag + BLOCK_M, S)
    if not CAUSAL:  # every row sees the same keys; query blocks past a prefix skip them too
        if HAS_VALID:  # whole blocks of a prefix, then the rest with the mask loaded
            key_end, full_end = _prefix_ranges(key_end_ptr, b, S, diag, BLOCK_N, False)
            acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D,
                                           q_cols, offs_m, d_ok, 0, full_end, qk_scale, False,
                                           False, PRECISION, BLOCK_M, BLOCK_N)
            acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D,
                                           q_cols, offs_m, d_ok, full_end, key_end, qk_scale,
                                           False, True, PRECISION, BLOCK_M, BLOCK_N)
        else:  # whole blocks, then the last block's key bound
            full_end = (S // BLOCK_N) * BLOCK_N
            acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, S, D,
                                           q_cols, offs_m, d_ok, 0, full_end, qk_scale, False,
                                           False, PRECISION, BLOCK_M, BLOCK_N)
            acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, S, D,
                                           q_cols, offs_m, d_ok, full_end, S, qk_scale, False,
                                           False, PRECISION, BLOCK_M, BLOCK_N, BOUNDED=True)
    elif HAS_VALID:
        key_end, full_end = _prefix_ranges(key_end_ptr, b, S, diag, BLOCK_N, True)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D,
                                       q_cols, offs_m, d_ok, 0, full_end, qk_scale, False,
                                       False, PRECISION, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D,
                                       q_cols, offs_m, d_ok, full_end,
                                       tl.minimum(diag, key_end), qk_scale, False, True,
                                       PRECISION, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, key_end, D,
                                       q_cols, offs_m, d_ok, diag,
                                       tl.minimum(diag_end, key_end), qk_scale, True, True,
                                       PRECISION, BLOCK_M, BLOCK_N)
    else:
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, S, D, q_cols,
                                       offs_m, d_ok, 0, diag, qk_scale, False, False,
                                       PRECISION, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _attend_blocks(acc, m_i, l_i, q, base, valid_ptr, b, S, S, D, q_cols,
                                       offs_m, d_ok, diag, diag_end, qk_scale, True, False,
                                       PRECISION, BLOCK_M, BLOCK_N)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def key_extent_kernel(valid_ptr, key_end_ptr, S, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """key_end[b] = the number of valid keys of sequence b if they form a prefix, else -1."""
    start_after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    last = tl.full([BLOCK], -1, dtype=tl.int32)
    for s0 in range(0, S, BLOCK):
        offs = s0 + tl.arange(0, BLOCK)
        ok = tl.load(valid_ptr + b * S + offs, mask=offs < S, other=0) != 0
        count += ok.to(tl.int32)
        last = tl.maximum(last, tl.where(ok, offs, -1))
    total = tl.sum(count, axis=0)
    tl.store(key_end_ptr + b, tl.where(tl.max(last, axis=0) + 1 == total, total, -1))


@triton.jit
def flash_attention_kernel(
    qkv_ptr, ctx_ptr, ctx_lo_ptr, valid_ptr, key_end_ptr, S, H, D, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HAS_VALID: tl.constexpr,
    SPLIT_OUT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One block of BLOCK_M queries of one (sequence, head), causal or not (CAUSAL); the
    context is stored as is or as an fp16 (hi, lo) pair."""
    start_after_previous(PDL)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out = attend_head(qkv_ptr, valid_ptr, key_end_ptr, b, h, S, D, pid_m * BLOCK_M, qk_scale,
                      HEAD_DIM, HEAD_PAD, HAS_VALID, PRECISION, BLOCK_M, BLOCK_N, CAUSAL)
    offs_d = tl.arange(0, HEAD_PAD)
    ctx_offsets = ((b.to(tl.int64) * S + offs_m) * D)[:, None] + (h * HEAD_DIM + offs_d)[None, :]
    ok = (offs_m < S)[:, None] & (offs_d < HEAD_DIM)[None, :]
    store_rows(ctx_ptr, ctx_lo_ptr, ctx_offsets, out, ok, SPLIT_OUT)


class AttentionTiles(NamedTuple):
    """Tile choices of flash_attention."""
    block_m: int
    block_n: int
    warps: int
    stages: int


def attention_config(head_pad: int, precision: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) by padded head dim and operand width."""
    if INTERPRETER:
        return 64, 64, 4, 1
    if precision == "fp16":
        if head_pad <= 64:  # bench/PERFORMANCE.md, #19
            return 128, 64, 4, 3
        if head_pad == 128:
            return 128, 64, 8, 2
        return 64, 32, 8, 2
    if head_pad <= 64:
        return 64, 64, 4, 2
    if head_pad == 128:
        return 64, 32, 4, 2
    return 64, 32, 8, 1


def softmax_scale(head_dim: int) -> float:
    """head_dim ** -0.5 in base 2 (the kernels use exp2)."""
    return head_dim ** -0.5 * math.log2(math.e)


def key_extent(valid: torch.Tensor, key_end: torch.Tensor) -> torch.Tensor:
    """key_end[B] (int32) from valid[B, S]: valid keys per sequence if a prefix, else -1."""
    batch, seq_len = valid.shape
    key_extent_kernel[(batch,)](valid, key_end, seq_len, BLOCK=1024 if seq_len >= 1024 else 128,
                                **dependent_launch())
    return key_end


def flash_attention(qkv: torch.Tensor, ctx, valid: torch.Tensor | None, key_end=None, *,
                    batch: int, seq_len: int, num_heads: int, precision: str, config=None,
                    causal: bool = True):
    """ctx[B*S, D] = softmax(q k^T / sqrt(hd)) v for every head, causal or not, from
    qkv[B*S, 3D].

    ctx is one tensor, or an fp16 (hi, lo) pair that receives the context split; with a
    mask valid [B, S], key_end is key_extent(valid).
    """
    ctx_hi, ctx_lo = ctx if isinstance(ctx, tuple) else (ctx, ctx)
    d = ctx_hi.shape[1]
    head_dim = d // num_heads
    pad = pad16(head_dim)
    block_m, block_n, num_warps, num_stages = AttentionTiles(
        *(config or attention_config(pad, precision)))
    if block_m % block_n:
        raise ValueError(f"block_m {block_m} must be a multiple of block_n {block_n}")
    grid = (triton.cdiv(seq_len, block_m), batch * num_heads)
    flash_attention_kernel[grid](
        qkv, ctx_hi, ctx_lo, valid if valid is not None else qkv,
        key_end if valid is not None else qkv, seq_len, num_heads, d,
        softmax_scale(head_dim),
        HEAD_DIM=head_dim, HEAD_PAD=pad, HAS_VALID=valid is not None,
        SPLIT_OUT=isinstance(ctx, tuple), PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=bool(causal), num_warps=num_warps, num_stages=num_stages, **dependent_launch(),
    )
    return ctx
