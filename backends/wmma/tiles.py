"""Tile choices of the wmma kernels, in one pure function."""
from __future__ import annotations

from typing import NamedTuple


class GemmVariant(NamedTuple):
    """One GEMM kernel variant of linear.cuh (a GemmTile value of common.cuh).

    kind "tiled": one rows x cols output tile per CTA, operand tiles bk deep through the
    stages; any K. kind "stream" (K <= 128): a persistent CTA keeps a cols-wide weight slice
    (whole K) in shared memory and streams rows-high activation tiles through the stages.
    stages and ctas_per_sm (what __launch_bounds__ asks; shared memory may allow fewer) are
    given for one, two and three products. pipelined (tiled, one product): each warp
    loads the next k slice's fragments while it multiplies the current one, across stage
    boundaries too (two and three products run the plain loop). resident_weights (stream,
    one or two products): each warp also holds its weight fragments (whole K) in registers.
    persistent (tiled): one CTA per resident slot, taking tiles in turn; the next tile's first
    stages load during the current tile's epilogue.
    """
    name: str
    kind: str
    rows: int
    cols: int
    warps: int
    warp_tile: tuple[int, int]
    bk: int | None
    stages: tuple[int, int, int]
    ctas_per_sm: tuple[int, int, int]
    pipelined: bool = False
    resident_weights: bool = False
    persistent: bool = False


# Index = the GemmTile value in common.cuh (the variants' template arguments in linear.cuh).
GEMM_TILES = (
    GemmVariant("tiled 128x128 bk32 8w", "tiled", 128, 128, 8, (32, 64), 32, (4, 4, 4), (2, 1, 1)),
    GemmVariant("tiled 128x256 bk32 8w", "tiled", 128, 256, 8, (64, 64), 32, (4, 4, 3), (1, 1, 1)),
    GemmVariant("tiled 128x128 bk32 4w", "tiled", 128, 128, 4, (64, 64), 32, (4, 3, 2), (2, 2, 2)),
    GemmVariant("tiled 128x128 bk64 8w", "tiled", 128, 128, 8, (32, 64), 64, (4, 3, 3), (1, 1, 1)),
    GemmVariant("tiled 64x64 bk32 4w", "tiled", 64, 64, 4, (32, 32), 32, (3, 3, 3), (2, 2, 2)),
    GemmVariant("tiled 32x32 bk64 4w", "tiled", 32, 32, 4, (16, 16), 64, (2, 2, 2), (2, 2, 2)),
    GemmVariant("stream 128x128 16w", "stream", 128, 128, 16, (32, 32), None, (3, 2, 2),
                (1, 1, 1)),
    GemmVariant("stream 64x128 8w", "stream", 64, 128, 8, (32, 32), None, (3, 2, 2), (2, 2, 1)),
    GemmVariant("stream 64x64 4w", "stream", 64, 64, 4, (32, 32), None, (2, 2, 2), (2, 2, 2)),
    GemmVariant("stream 32x128 4w", "stream", 32, 128, 4, (32, 32), None, (3, 2, 2), (2, 2, 2)),
    GemmVariant("tiled 128x128 bk64 4w pipelined", "tiled", 128, 128, 4, (64, 64), 64,
                (3, 2, 2), (2, 2, 1), True),
    GemmVariant("stream 128x128 8w resident", "stream", 128, 128, 8, (64, 32), None, (3, 2, 2),
                (1, 1, 1), resident_weights=True),
    GemmVariant("tiled 128x128 bk64 4w pipelined persistent", "tiled", 128, 128, 4, (64, 64), 64,
                (3, 2, 2), (2, 2, 1), True, persistent=True),
)
TILED_128x128, TILED_128x256, TILED_128x128_W4, TILED_128x128_BK64 = 0, 1, 2, 3
TILED_64x64, TILED_32x32, STREAM_128x128, STREAM_64x128, STREAM_64x64 = 4, 5, 6, 7, 8
STREAM_32x128, TILED_128x128_BK64_PIPELINED, STREAM_128x128_RESIDENT = 9, 10, 11
TILED_128x128_BK64_PERSISTENT = 12
STREAM_MAX_K = 128  # the stream variants keep K whole in one shared-memory stage
SCRATCH_BYTES = 16 * 20 * 4  # one warp's epilogue scratch (kScratchBytes in linear.cuh)

ATTENTION_BLOCK_M = 64  # query rows per attention block (kBlockM in attention.cu)
MAX_HEAD_DIM = 256


class Tiles(NamedTuple):
    """The GemmTile index of each linear and the attention key block; norm_out_proj and
    norm_ffn_out: whether that linear's tile holds whole rows and runs the norm epilogue
    (out_proj: norm2; ffn_out: the next block's norm1 or the final norm)."""
    qkv: int
    out_proj: int
    ffn_in: int
    ffn_out: int
    attention_block_n: int
    norm_out_proj: bool = False
    norm_ffn_out: bool = False


def replaces_stream_tile(tile: int) -> bool:
    """Whether tile may stand in for the 16-warp 128x128 stream variant (choose_tiles'
    stream_tile): a stream variant holding 128 columns."""
    variant = GEMM_TILES[tile]
    return variant.kind == "stream" and variant.cols >= 128


def pad16(n: int) -> int:
    """n rounded up to a multiple of 16 (the wmma fragment size)."""
    return -(-n // 16) * 16


def long_stream_tile(products: int, stream_tile: int | None = None) -> int:
    """The stream variant of calls that give each SM two 128x128 tiles: stream_tile where
    given, else 64x128 of 8 warps where two of its CTAs fit an SM at this product count (one
    or two products; H100, shape 13: 1.494 ms against 1.532 with 128x128 of 16 warps), else
    128x128 of 16 warps."""
    if stream_tile is not None:
        return stream_tile
    return STREAM_64x128 if GEMM_TILES[STREAM_64x128].ctas_per_sm[products - 1] >= 2 \
        else STREAM_128x128


def gemm_tile(rows: int, n: int, k: int, multiprocessors: int, products: int = 1,
              stream_tile: int | None = None, persistent: bool = False) -> int:
    """The GEMM variant for out[rows, n] = a[rows, k] @ w[n, k]^T with products fp16 products.

    K <= 128: the persistent stream kernel long_stream_tile(products, stream_tile) when each
    SM gets at least two 128x128 tiles, else the 64x64 stream
    kernel when its tiles fill the SMs. Larger K: the largest
    tiled variant whose grid gives every SM a CTA: 128x128 of 4 warps (64x64 each), which
    beat 128x256 and the 8-warp 128x128 variants on the H200 (M 8192, K 1024: 261–275 TFLOP/s
    against 216–259); with one or two products its BK 64 pipelined form (one product, N 3072:
    276 TFLOP/s against 265 plain; two products, N 1024: 254 against 222; persistent: its
    persistent form), with three the plain BK 32 one; else 64x64. Otherwise (few rows) 32x32
    tiles.
    """
    def tiles(bm: int, bn: int) -> int:
        return -(-rows // bm) * -(-n // bn)

    if k <= STREAM_MAX_K:
        if tiles(128, 128) >= 2 * multiprocessors:
            return long_stream_tile(products, stream_tile)
        if tiles(64, 64) >= multiprocessors:
            return STREAM_64x64
    else:
        if tiles(128, 128) >= multiprocessors:
            if products > 2:
                return TILED_128x128_W4
            return TILED_128x128_BK64_PERSISTENT if persistent else TILED_128x128_BK64_PIPELINED
        if tiles(64, 64) >= multiprocessors:
            return TILED_64x64
    return TILED_32x32


def stream_smem_bytes(tile: int, products: int, k: int) -> int:
    """Dynamic shared memory of a stream variant at K (Stream::smem_bytes in linear.cuh): the
    warps' scratch, the weight slice (hi, and lo with three products) and the activation
    ring (hi, and lo from two products on), rows of K rounded up to 16 plus 8 halves."""
    v = GEMM_TILES[tile]
    ld = pad16(k) + 8
    w_parts = 2 if products == 3 else 1
    a_parts = 2 if products >= 2 else 1
    stages = v.stages[products - 1]
    return v.warps * SCRATCH_BYTES + 2 * ld * (w_parts * v.cols + stages * a_parts * v.rows)


def norm_gemm_tile(rows: int, n: int, k: int, multiprocessors: int, products: int,
                   smem_limit: int | None = None, stream_tile: int | None = None
                   ) -> int | None:
    """A stream variant whose tile holds whole output rows (cols >= n) for a residual linear
    with the norm epilogue, or None where none applies (K > 128, n > 128, one product, or no
    such variant fits smem_limit bytes of shared memory per block). n <= 64: the 64x64
    variant (wider ones would leave most warps' columns empty). Else, like gemm_tile: the
    128x128 variant (stream_tile) when each SM gets two 128x128 tiles, 64x128 when its tiles
    fill the SMs;
    a variant over smem_limit gives way to the next. Fewer rows: None, since the few 32x128
    tiles that would hold them lose to separate norm kernels (H200 shape 2: 0.136 ms fused
    against 0.117; shape 1 even; shape 13 1.554 against 1.619, shape 6 19.4 against 19.8)."""
    if k > STREAM_MAX_K or n > 128 or products < 2:
        return None

    def tiles(bm: int) -> int:
        return -(-rows // bm)

    order = [STREAM_64x64] if n <= 64 else []
    if tiles(128) >= 2 * multiprocessors:
        order.append(long_stream_tile(products, stream_tile))
    if tiles(64) >= multiprocessors:
        order.append(STREAM_64x128)
    for tile in order:
        if smem_limit is None or stream_smem_bytes(tile, products, k) <= smem_limit:
            return tile
    return None


def choose_tiles(rows: int, d_model: int, ffn_dim: int, head_dim: int,
                 multiprocessors: int, *, fuse_norms: bool = False,
                 products: int = 3, smem_limit: int | None = None,
                 stream_tile: int | None = None, persistent: bool = False,
                 qkv_products: int = 1) -> Tiles:
    """Per linear, gemm_tile for its (rows, N, K): Q/K/V (3 d_model, d_model), out_proj
    (d_model, d_model), ffn_in (ffn_dim, d_model), ffn_out (d_model, ffn_dim). Attention key
    blocks of 64, or 32 above head dim 128 so that one block's shared memory stays near
    150 KB. fuse_norms: out_proj and ffn_out (products fp16 products) take norm_gemm_tile
    where it applies, and their norm flags are set. stream_tile: the stream variant taken
    where each SM gets two 128x128 tiles (a stream variant holding 128 columns; anything else
    raises ValueError); None: long_stream_tile's rule. persistent: gemm_tile's.
    qkv_products: Q/K/V's fp16 products (one, or three in deep stacks)."""
    if stream_tile is not None and not replaces_stream_tile(stream_tile):
        raise ValueError(f"stream_tile {stream_tile} ({GEMM_TILES[stream_tile].name}) is not a "
                         "stream variant holding 128 columns")
    def gemm(n: int, k: int, count: int = products) -> int:
        return gemm_tile(rows, n, k, multiprocessors, count, stream_tile, persistent)

    def fused(k: int) -> int | None:
        if not fuse_norms:
            return None
        return norm_gemm_tile(rows, d_model, k, multiprocessors, products, smem_limit,
                              stream_tile)

    out_proj, ffn_out = fused(d_model), fused(ffn_dim)
    return Tiles(gemm(3 * d_model, d_model, qkv_products),
                 gemm(d_model, d_model) if out_proj is None else out_proj,
                 gemm(ffn_dim, d_model),
                 gemm(d_model, ffn_dim) if ffn_out is None else ffn_out,
                 64 if pad16(head_dim) <= 128 else 32, out_proj is not None,
                 ffn_out is not None)
