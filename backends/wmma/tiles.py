"""Tile choices of the wmma kernels, in one pure function."""
from __future__ import annotations

from typing import NamedTuple

# Index = the GemmTile value in common.cuh: (rows, columns, operand stages) of one linear block.
GEMM_TILES = ((128, 128, 2), (64, 64, 2), (32, 32, 2), (128, 128, 3), (64, 64, 3),
              (32, 32, 3))
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
                 multiprocessors: int, gemm_stages: int = 2) -> Tiles:
    """Per linear, the largest tile whose grid still gives every multiprocessor a block
    (else 32x32), with gemm_stages operand stages; attention key
    blocks of 64, or 32 above head dim 128 so that one block's shared memory stays near
    150 KB."""
    def index_of(bm: int, stages: int) -> int:
        return next(i for i, (rows_, _, stages_) in enumerate(GEMM_TILES)
                    if rows_ == bm and stages_ == stages)

    def gemm(n: int) -> int:
        for bm, bn in ((128, 128), (64, 64)):
            if -(-rows // bm) * -(-n // bn) >= multiprocessors:
                return index_of(bm, gemm_stages)
        return index_of(32, gemm_stages)

    return Tiles(gemm(3 * d_model), gemm(d_model), gemm(ffn_dim), gemm(d_model),
                 64 if pad16(head_dim) <= 128 else 32)
