"""Tile choices of the wmma kernels, in one pure function."""
from __future__ import annotations

from typing import NamedTuple

# Index = the GemmTile value in common.cuh: (rows, columns) of one linear block.
GEMM_TILES = ((128, 128), (64, 64), (32, 32))
ATTENTION_BLOCK_M = 64  # query rows per attention block (kBlockM in attention.cu)
MAX_HEAD_DIM = 256


class Tiles(NamedTuple):
    """The GemmTile index of each linear and the attention key block."""
    qkv: int
    out_proj: int
    ffn_in: int
    ffn_out: int
    attention_block_n: int


def pad16(n: int) -> int:
    """n rounded up to a multiple of 16 (the wmma fragment size)."""
    return -(-n // 16) * 16


def choose_tiles(rows: int, d_model: int, ffn_dim: int, head_dim: int,
                 multiprocessors: int) -> Tiles:
    """Per linear, the largest tile whose grid still gives every multiprocessor a block
    (else the smallest); attention key blocks of 64, or 32 above head dim 128 so that one
    block's shared memory stays near 150 KB."""
    def gemm(n: int) -> int:
        for index, (bm, bn) in enumerate(GEMM_TILES):
            if -(-rows // bm) * -(-n // bn) >= multiprocessors:
                return index
        return len(GEMM_TILES) - 1

    return Tiles(gemm(3 * d_model), gemm(d_model), gemm(ffn_dim), gemm(d_model),
                 64 if pad16(head_dim) <= 128 else 32)
