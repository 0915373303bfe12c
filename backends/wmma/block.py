"""Narrow-block launches (block.cu), for layers whose whole rows fit one tile: norm1 fused
into the Q/K/V GEMM, and one kernel from the attention context to the block's output rows
and their next LayerNorm (one or two fp16 products)."""
from __future__ import annotations

import torch

from .norm import LN_EPS

MAX_QKV_WIDTH = 256  # widest d_model norm_qkv takes
MAX_FFN_WIDTH = 128  # widest d_model / ffn_dim ffn_block takes
FFN_BLOCK_ROWS = 64  # rows of one ffn_block block (kFfnRows in block.cu)


FFN_BLOCK_PRODUCTS = (1, 2)  # linear products ffn_block computes


def fits(d_model: int, ffn_dim: int, products: int) -> bool:
    """Whether ffn_block runs this layer (whole rows in one tile, one or two products)."""
    return (d_model <= MAX_FFN_WIDTH and ffn_dim <= MAX_FFN_WIDTH
            and products in FFN_BLOCK_PRODUCTS)


def norm_qkv(ext, x: torch.Tensor, p, w_hi: torch.Tensor, qkv: torch.Tensor,
             copy: torch.Tensor | None = None) -> None:
    """qkv [M, 3D] fp16 = norm1(x [M, D]) @ Wqkv^T + b (one fp16 product); copy, if given,
    receives x in fp32."""
    ext.norm_qkv(x, p.norm1_weight, p.norm1_bias, w_hi, p.qkv_bias, qkv, copy, LN_EPS)


def ffn_block(ext, ctx: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
              out_rows: torch.Tensor | None, valid_rows: torch.Tensor | None, p, w: dict,
              norm=None) -> None:
    """out_rows [M, D] (fp32; may be residual, or None) = the block's output rows from the
    context (an fp16 (hi, lo) pair: two products; lo None: one) and the block's input rows
    residual (fp32). norm (a linear.RowNorm, lo None) also writes their LayerNorm into
    norm.out (any float dtype; zero_invalid: invalid rows 0)."""
    if norm is not None and norm.lo is not None:
        raise ValueError("ffn_block writes one normed tensor: norm.lo must be None")
    norm_args = ((None, None, None, False) if norm is None
                 else (norm.weight, norm.bias, norm.out, norm.zero_invalid))
    ext.ffn_block(ctx[0], ctx[1], residual, out_rows, valid_rows, w["out"][0], p.out_bias,
                  p.norm2_weight, p.norm2_bias, w["ffn_in"][0], p.ffn_in_bias,
                  w["ffn_out"][0], p.ffn_out_bias, *norm_args, LN_EPS)


def shared_bytes(ext, d_model: int, ffn_dim: int) -> int:
    """Dynamic shared memory of one ffn_block block."""
    return ext.ffn_block_smem_bytes(d_model, ffn_dim)
