"""Narrow-block launches (block.cu), for layers whose whole rows fit one tile: norm1 fused
into the Q/K/V GEMM, and one kernel from the attention context to the block's output."""
from __future__ import annotations

import torch

from .norm import LN_EPS

MAX_QKV_WIDTH = 256  # widest d_model norm_qkv takes
MAX_FFN_WIDTH = 128  # widest d_model / ffn_dim ffn_block takes


def fits(d_model: int, ffn_dim: int) -> bool:
    """Whether the narrow block runs this layer (whole rows in one tile)."""
    return d_model <= MAX_FFN_WIDTH and ffn_dim <= MAX_FFN_WIDTH


def norm_qkv(ext, x: torch.Tensor, p, w_hi: torch.Tensor, qkv: torch.Tensor,
             copy: torch.Tensor | None = None) -> None:
    """qkv [M, 3D] fp16 = norm1(x [M, D]) @ Wqkv^T + b (one fp16 product); copy, if given,
    receives x in fp32."""
    ext.norm_qkv(x, p.norm1_weight, p.norm1_bias, w_hi, p.qkv_bias, qkv, copy, LN_EPS)


def ffn_block(ext, ctx: tuple[torch.Tensor, torch.Tensor], residual: torch.Tensor,
              out: torch.Tensor, valid_rows: torch.Tensor | None, p, w: dict,
              final: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out [M, D] = the block's output rows from the context pair and the block's input rows
    residual (fp32; out may be residual); with final (weight, bias) the final LayerNorm is
    applied and out may have any float dtype."""
    fw, fb = final if final is not None else (None, None)
    ext.ffn_block(ctx[0], ctx[1], residual, out, valid_rows, *w["out"], p.out_bias,
                  p.norm2_weight, p.norm2_bias, *w["ffn_in"], p.ffn_in_bias, *w["ffn_out"],
                  p.ffn_out_bias, fw, fb, LN_EPS)


def shared_bytes(ext, d_model: int, ffn_dim: int) -> int:
    """Dynamic shared memory of one ffn_block block."""
    return ext.ffn_block_smem_bytes(d_model, ffn_dim)
