"""Attention launches (attention.cu): flash attention over the packed Q/K/V rows."""
from __future__ import annotations

import torch

from .tiles import ATTENTION_BLOCK_M, MAX_HEAD_DIM, pad16


def supported_head_dim(head_dim: int) -> bool:
    """Whether the attention kernel takes this head dim (multiples of 8 up to 256)."""
    return head_dim % 8 == 0 and 8 <= head_dim <= MAX_HEAD_DIM


def max_seq_len() -> int:
    """The longest sequence the attention grid covers (query blocks in grid dimension y)."""
    return 65535 * ATTENTION_BLOCK_M


def shared_bytes(ext, head_dim: int, block_n: int) -> int:
    """Dynamic shared memory of one attention block."""
    return ext.attention_smem_bytes(pad16(head_dim), block_n)


def attention(ext, qkv: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor],
              valid: torch.Tensor | None, *, batch: int, seq_len: int, num_heads: int,
              causal: bool, block_n: int) -> None:
    """ctx (an fp16 (hi, lo) pair [B*S, D]) = softmax(q k^T / sqrt(hd)) v for every head, from
    qkv [B*S, 3D] fp16; valid [B, S] uint8 masks keys (None: all valid)."""
    ext.attention(qkv, ctx[0], ctx[1], valid, batch, seq_len, num_heads, causal, block_n)
