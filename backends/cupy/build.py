"""Run-time compilation of the cupy kernels: the CUDA headers NVRTC needs, the one module
source, its options and its template instantiations; on a GPU through cupy.RawModule (cached
per architecture), on any machine through cuda-python's NVRTC bindings."""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from layerbench.common.errors import Unsupported

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("norm.cu", "linear.cu", "linear_wgmma.cu", "attention.cu",
           "attention_wgmma.cu", "whole_block.cu", "after_attention.cu")  # one module, in order
HEADERS = ("common.cuh", "wgmma.cuh")
ARCHES = ("80", "90a")  # the CPU test compiles for both
HOPPER = "90a"  # sm_90 devices run the module compiled for sm_90a, which has wgmma
HEADER = "cuda_fp16.h"  # the one toolkit header the kernels include

# Template instantiations the backend launches, as NVRTC name expressions.
NORM_OUTPUTS = {"pair": 0, "half": 1, "float": 2}
EPILOGUES = {"half": 0, "gelu_pair": 1, "residual": 2, "residual_norm": 3}
NORM_EPILOGUE = "residual_norm"  # linear_wgmma only, on NORM_TILES
GEMM_TILES = ((128, 128, 2, 4), (64, 64, 2, 2))  # (BM, BN, warps along M, warps along N)
GEMM_PRODUCTS = (1, 2, 3)
# Two products (a_hi w_hi + a_lo w_hi) are compiled only for the epilogues the layer launches
# past one product: out_proj's and ffn_out's residual (or residual_norm), ffn_in's gelu_pair.
TWO_PRODUCT_EPILOGUES = ("gelu_pair", "residual", "residual_norm")
WGMMA_TILES = ((128, 128), (64, 64))  # (BM, BN) of linear_wgmma, 2 BM threads, plain schedule
# The plain-schedule tile whose kernels also come with the epilogue through shared memory
# (linear_wgmma's STAGED; CupyBackend(staged_epilogue=...)), every epilogue and product count.
STAGED_TILE = (128, 128)
# The fp32 epilogues whose staged kernels also come eight lanes a row (linear_wgmma's STAGED
# 2; CupyBackend's eight_lane_rows option, on by default), every product count they are
# compiled at.
EIGHT_LANE_EPILOGUES = ("residual", "residual_norm")
# The residual-norm GEMM for short reductions (CupyBackend(short_norm_gemm=True)): 64 x 128
# tiles in SHORT_NORM_STAGES stages, staged, so that a block's shared memory (97 KiB at three
# products) leaves room for a second block on the SM; run where K <= SHORT_NORM_STAGES x 64
# (every K tile resident, none refilled).
SHORT_NORM_TILE, SHORT_NORM_STAGES = (64, 128), 2
NORM_TILES = ((128, 128), (64, 128))  # (BM, BN) of linear_wgmma's residual_norm: rows <= BN
MAX_NORM_WIDTH = 128  # the widest row residual_norm norms (one block holds it)
# linear_wgmma_norm_prologue (LayerNorm of the fp32 rows in the GEMM's prologue): the wgmma
# tiles, Q/K/V's half at one product and ffn_in's gelu_pair at each product count.
PROLOGUE_EPILOGUES = {"half": (1,), "gelu_pair": GEMM_PRODUCTS}
MAX_PROLOGUE_K = 128  # the widest rows it norms (linear_wgmma.cu MAX_PROLOGUE_K)
PROLOGUE_STAGES = 2  # K tiles held at once: MAX_PROLOGUE_K / 64, each in its own stage
# whole_block (one launch a Transformer block, sequences up to WHOLE_BLOCK_MAX_SEQ tokens, three
# fp16 products): the (d_model, FFN width padded to 16) pairs it is compiled for.
WHOLE_BLOCK_WIDTHS = ((32, 32), (64, 64), (128, 128))
WHOLE_BLOCK_MAX_SEQ = 128
# Query rows a block (16 a warp): 64, or a whole sequence (its keys and values computed once).
WHOLE_BLOCK_ROWS = (64, WHOLE_BLOCK_MAX_SEQ)
# after_attention (out_proj through the second residual and the next norm, rows of a block at
# three fp16 products): the (d_model, FFN width padded to 16) pairs and rows a block.
AFTER_ATTENTION_WIDTHS = WHOLE_BLOCK_WIDTHS
AFTER_ATTENTION_ROWS = (16, 32, 64)
ATTENTION_TILES = {16: ((64, 64),), 32: ((64, 64), (128, 64)), 64: ((64, 64), (128, 64)),
                   128: ((64, 64),), 256: ((64, 32),)}  # padded head dim -> (BQ, BKV)


@dataclass(frozen=True)
class AttentionVariant:
    """One instantiation of flash_attention_wgmma (attention_wgmma.cu): the name sweeps and
    CupyBackend(attention_variant=...) use, BQ queries (2 BQ threads) and BKV keys a tile,
    the blocks an SM should hold (__launch_bounds__) and the plain or pipelined schedule.
    tma: flash_attention_wgmma_tma<HP, BQ, BKV, kv_stages, schedule> instead (BQ 128 or 192,
    BKV 64 or 128, ATTENTION_TMA_THREADS threads at BQ 128, 512 at 192: a TMA producer
    warpgroup and BQ / 64 consumers, a ring of kv_stages K/V stages; the tensor maps of Q and
    of K/V appended to the arguments by ops.attention; head_dim must be the padded head dim,
    see refusal). schedule: the TMA ring's consumer schedule (its SCHEDULE):
    TMA_PLAIN, TMA_PINGPONG (the consumers take turns issuing wgmmas), TMA_OVERLAP (turns,
    and S of the next tile issued before this tile's softmax) or TMA_OVERLAP_PACKED (turns,
    S of the next tile issued with this tile's P V, one score set). poly_every (8 or 4, 0:
    none): one column pair in poly_every of P computed by a polynomial on the FMA units
    instead of MUFU.EX2 (TMA_POLY_EXP2 times 8 / poly_every added to SCHEDULE): P not
    bit-identical to the other variants'."""

    name: str
    bq: int
    bkv: int
    min_blocks: int = 1
    pipelined: bool = False
    tma: bool = False
    kv_stages: int = 0
    schedule: int = 0
    poly_every: int = 0

    @property
    def poly_exp2(self) -> bool:
        """Whether the softmax takes part of its exponentials by polynomial."""
        return self.poly_every > 0

    @property
    def threads(self) -> int:
        """Threads of one block."""
        return 128 * (self.bq // 64 + 1) if self.tma else 2 * self.bq

    def refusal(self, head_dim: int, head_pad: int) -> str | None:
        """Why this variant cannot run head_dim (padded to head_pad), or None: a TMA variant's
        boxes are head_pad columns wide, so a narrower head would read its neighbour's."""
        if self.tma and head_dim != head_pad:
            return (f"cupy attention variant {self.name!r} needs head dim {head_pad} exactly "
                    f"(its TMA boxes are {head_pad} columns wide), not {head_dim}")
        return None


WGMMA_PLAIN = AttentionVariant("wgmma 128x128", 128, 128)
WGMMA_TWO_PER_SM = AttentionVariant("wgmma 128x64 2/SM", 128, 64, min_blocks=2)
WGMMA_PIPELINED = AttentionVariant("wgmma 128x64 pipelined", 128, 64, pipelined=True)
ATTENTION_TMA_THREADS = 384  # flash_attention_wgmma_tma: a producer and two consumer warpgroups
# FlashAttention-3's warp-specialised TMA ring (H200, 100000 tokens, 16 heads of 64, causal:
# 269.4 TFLOP/s, the default 238.5), head dims 32 and 64 exactly (refused below them: its
# boxes are the padded head dim wide).
WGMMA_TMA = AttentionVariant("wgmma 128x64 TMA", 128, 64, tma=True, kv_stages=3)
TMA_PLAIN, TMA_PINGPONG, TMA_OVERLAP = 0, 1, 2  # flash_attention_wgmma_tma's SCHEDULE
TMA_OVERLAP_PACKED = 3  # ... and FlashAttention-3's order (see WGMMA_TMA_OVERLAP_128)
TMA_POLY_EXP2 = 4  # times 8 / poly_every added to SCHEDULE: exp2_poly for part of P
POLY_EVERY_CHOICES = (8, 4)  # poly_every: exp2_poly takes one column pair in 8, or in 4
# FlashAttention-3's next steps on the ring: ping-pong (the two consumers take turns issuing
# wgmmas, one's softmax under the other's), the same stages; overlap (ping-pong, and S of
# tile it + 1 issued before the softmax of tile it): a consumer holds three stages, so five
# let the producer load two tiles ahead. H200, the shape-14 sequence above: 309.1 and 346.0
# TFLOP/s; at BKV 128 ping-pong 352.2, three consumers 340.8.
WGMMA_TMA_PINGPONG = AttentionVariant("wgmma 128x64 TMA ping-pong", 128, 64, tma=True,
                                      kv_stages=3, schedule=TMA_PINGPONG)
WGMMA_TMA_OVERLAP = AttentionVariant("wgmma 128x64 TMA overlap", 128, 64, tma=True,
                                     kv_stages=5, schedule=TMA_OVERLAP)
# Ping-pong with key tiles of 128 (FlashAttention-3's at head dim 64): half the tiles, so half
# the per-tile barriers, row maxima and rescales of the outputs; S is 64 registers a thread.
WGMMA_TMA_PINGPONG_128 = AttentionVariant("wgmma 128x128 TMA ping-pong", 128, 128, tma=True,
                                          kv_stages=3, schedule=TMA_PINGPONG)
# Three consumers (FlashAttention-3's at head dim 64): BQ 192, 512 threads, setmaxnreg 24 and
# 160 (ping-pong at BKV 64 needs about 123), the turns in a cycle of three.
WGMMA_TMA_PINGPONG_3WG = AttentionVariant("wgmma 192x64 TMA ping-pong", 192, 64, tma=True,
                                          kv_stages=3, schedule=TMA_PINGPONG)
# The next steps toward FlashAttention-3's speed at head dim 64. H200, the shape-14 sequence
# above, causal grid in launch order: 128x128 overlap 380, 192x128 overlap 457 TFLOP/s (the
# layer's LONG_ATTENTION); with poly-exp2 397 at 128x128, but 430 (one pair in eight) and
# 409-415 (in four) at 192x128. Longest query tiles first: 420 and 482.
# Overlap at BKV 128 in FlashAttention-3's order (TMA_OVERLAP_PACKED): a turn issues S of
# tile it + 1 and P V of tile it, whose P is held packed in fp16; the softmax of it + 1 runs
# under that P V, so one score set of 64 registers is live (TMA_OVERLAP's two at BKV 128
# spill: 264 bytes of stack). A consumer holds two stages, so five let the producer run three
# ahead.
WGMMA_TMA_OVERLAP_128 = AttentionVariant("wgmma 128x128 TMA overlap", 128, 128, tma=True,
                                         kv_stages=5, schedule=TMA_OVERLAP_PACKED)
# FlashAttention-3's configuration at head dim 64: the packed overlap with three consumers,
# BQ 192 (512 threads, setmaxnreg 24 and 160: S 64, O 32 and P 32 registers a thread, 152 in
# all, no spill: attention_wgmma.cu's MASK_IDLE; the softmax's own branch for a warp seeing
# none of a tile spilled 248 bytes of stack) and BKV 128; six stages, as many as fit 227 KiB
# at head dim 64 (Q 24 KiB, a stage 32 KiB: 222208 bytes).
WGMMA_TMA_OVERLAP_3WG = AttentionVariant("wgmma 192x128 TMA overlap", 192, 128, tma=True,
                                         kv_stages=6, schedule=TMA_OVERLAP_PACKED)
# ... with the polynomial exponential for one column pair in eight, or in four.
WGMMA_TMA_OVERLAP_3WG_POLY = AttentionVariant("wgmma 192x128 TMA overlap poly-exp2", 192, 128,
                                              tma=True, kv_stages=6,
                                              schedule=TMA_OVERLAP_PACKED, poly_every=8)
WGMMA_TMA_OVERLAP_3WG_POLY4 = AttentionVariant("wgmma 192x128 TMA overlap poly-exp2 1/4", 192,
                                               128, tma=True, kv_stages=6,
                                               schedule=TMA_OVERLAP_PACKED, poly_every=4)
# FlashAttention-4's exponential: one P column pair in eight by a degree-3 polynomial on the
# FMA units (attention_wgmma.cu exp2_poly, relative error below 1e-4), off the MUFU pipe.
WGMMA_TMA_PINGPONG_128_POLY = AttentionVariant("wgmma 128x128 TMA ping-pong poly-exp2", 128,
                                               128, tma=True, kv_stages=3,
                                               schedule=TMA_PINGPONG, poly_every=8)
WGMMA_TMA_OVERLAP_128_POLY = AttentionVariant("wgmma 128x128 TMA overlap poly-exp2", 128, 128,
                                              tma=True, kv_stages=5,
                                              schedule=TMA_OVERLAP_PACKED, poly_every=8)
# Head dim 256 (O is 128 registers a thread): the plain schedule at BKV 64, one block an SM,
# 224 registers and no spill at BQ 128 (197632 shared bytes) and at BQ 64 (one warpgroup,
# 164864); the pipelined one spills there (its second score set). H200, shape 8's attention
# replayed from a graph: 0.052 and 0.066 ms against mma.sync's 0.060 (causal), 0.050 and
# 0.070 against 0.070 (full).
# One warpgroup of 64 queries a block at head dims up to 32, four blocks an SM
# (__launch_bounds__(128, 4): 128 registers a thread): each block barrier waits for four warps
# where "wgmma 128x64 2/SM" waits for eight (on shape 13 the branch behind the barrier before
# its P V drew 9% of that kernel's stall samples), the same warps an SM. H200, shape 13's
# attention: 0.154 ms against 0.148 (bench/PERFORMANCE.md K37): an option.
WGMMA_ONE_GROUP_4_PER_SM = AttentionVariant("wgmma 64x64 4/SM", 64, 64, min_blocks=4)
# The TMA ring at two blocks an SM (384 threads launched with 80 registers, setmaxnreg 24 for
# the producer and 104 for the consumers): four consumer warpgroups an SM, as many as "wgmma
# 128x64 2/SM" has, with no block barrier and no copy addresses in the consumers; head dim 32
# (at 64 the consumers spill).
WGMMA_TMA_2_PER_SM = AttentionVariant("wgmma 128x64 TMA 2/SM", 128, 64, min_blocks=2,
                                      tma=True, kv_stages=3)
WGMMA_TMA_PINGPONG_2_PER_SM = AttentionVariant("wgmma 128x64 TMA ping-pong 2/SM", 128, 64,
                                               min_blocks=2, tma=True, kv_stages=3,
                                               schedule=TMA_PINGPONG)
WGMMA_HD256 = AttentionVariant("wgmma 128x64", 128, 64)
WGMMA_HD256_ONE_GROUP = AttentionVariant("wgmma 64x64", 64, 64)
# flash_attention_wgmma (sm_90a): padded head dim -> its variants, the default first (two
# blocks an SM at head dims 32 and 64: the fastest timed on the H200 at shape 13; on shape
# 14's long sequences the TMA ring's 192x128 overlap is, and the layer runs it there:
# layer.LONG_ATTENTION).
# Head dims up to 32 run at 32. At 128, two blocks an SM (128 registers a thread) spill, and
# the pipelined schedule at BKV 128 spills at every head dim (two score sets of 64
# registers), so it runs BKV 64. The TMA ring runs at 32 and 64 (boxes of 32 columns with
# the 64-byte swizzle, 64 with the 128-byte one), head dims below those refused. 256 (head
# dims 129-256) runs "wgmma 128x64" by default (bench/PERFORMANCE.md K23, K25).
ATTENTION_WGMMA = {32: (WGMMA_TWO_PER_SM, WGMMA_PLAIN, WGMMA_PIPELINED, WGMMA_TMA,
                        WGMMA_TMA_PINGPONG, WGMMA_TMA_OVERLAP, WGMMA_TMA_PINGPONG_128,
                        WGMMA_TMA_PINGPONG_3WG, WGMMA_TMA_OVERLAP_128,
                        WGMMA_TMA_PINGPONG_128_POLY, WGMMA_TMA_OVERLAP_128_POLY,
                        WGMMA_TMA_OVERLAP_3WG, WGMMA_TMA_OVERLAP_3WG_POLY,
                        WGMMA_TMA_OVERLAP_3WG_POLY4, WGMMA_ONE_GROUP_4_PER_SM,
                        WGMMA_TMA_2_PER_SM, WGMMA_TMA_PINGPONG_2_PER_SM),
                   64: (WGMMA_TWO_PER_SM, WGMMA_PLAIN, WGMMA_PIPELINED, WGMMA_TMA,
                        WGMMA_TMA_PINGPONG, WGMMA_TMA_OVERLAP, WGMMA_TMA_PINGPONG_128,
                        WGMMA_TMA_PINGPONG_3WG, WGMMA_TMA_OVERLAP_128,
                        WGMMA_TMA_PINGPONG_128_POLY, WGMMA_TMA_OVERLAP_128_POLY,
                        WGMMA_TMA_OVERLAP_3WG, WGMMA_TMA_OVERLAP_3WG_POLY,
                        WGMMA_TMA_OVERLAP_3WG_POLY4),
                   128: (WGMMA_PLAIN, WGMMA_PIPELINED),
                   256: (WGMMA_HD256, WGMMA_HD256_ONE_GROUP)}


@dataclass(frozen=True)
class GemmVariant:
    """One tile and schedule of linear_wgmma (linear_wgmma.cu): the name sweeps and
    CupyBackend(gemm_variant=...) use, the BM x BN tile (2 BM threads), the cp.async stages
    and the wgmma groups left running from one K tile into the next (0: each tile waited for).
    warp_specialised: linear_wgmma_ws instead (BM 128, WS_THREADS threads: a producer
    warpgroup and two consumers, an mbarrier ring of `stages` stages, one wgmma group left
    running: pending 1). tma: linear_wgmma_tma instead (as linear_wgmma_ws, but one producer
    thread copies each stage with TMA from the tensor maps of A and W, appended to the
    arguments by ops.linear; blocks_per_sm 2: two blocks an SM, TMA_TWO_PER_SM_THREADS threads,
    the producer a warp after the consumers; persistent: a grid of blocks_per_sm blocks an
    SM, each taking output tiles in turn, its ring running on across them; staged_epilogue:
    the tile's epilogue through shared memory, a warp a row, store_tile_staged)."""

    name: str
    bm: int
    bn: int
    stages: int = 3
    pending: int = 0
    warp_specialised: bool = False
    tma: bool = False
    blocks_per_sm: int = 1
    persistent: bool = False
    staged_epilogue: bool = False

    @property
    def tile(self) -> tuple[int, int]:
        """(BM, BN)."""
        return self.bm, self.bn

    @property
    def tile_schedule(self) -> tuple[int, int]:
        """(stages, pending)."""
        return self.stages, self.pending

    @property
    def distance(self) -> int:
        """K tiles copied ahead of the one computed (linear_wgmma's DISTANCE)."""
        return self.stages - 1 - self.pending

    @property
    def threads(self) -> int:
        """Threads of one block."""
        if self.tma and self.blocks_per_sm == 2:
            return TMA_TWO_PER_SM_THREADS
        return WS_THREADS if self.warp_specialised or self.tma else 2 * self.bm


GEMM_PLAIN = GemmVariant("wgmma 128x128", 128, 128)
GEMM_WAIT1 = GemmVariant("wgmma 128x128 wait1 4-stage", 128, 128, stages=4, pending=1)
GEMM_WIDE = GemmVariant("wgmma 128x256 wait1", 128, 256, stages=4, pending=1)
WS_THREADS = 384  # linear_wgmma_ws: a producer warpgroup and two consumer warpgroups
GEMM_WS_WIDE = GemmVariant("wgmma 128x256 warp-specialised", 128, 256, stages=4, pending=1,
                           warp_specialised=True)
GEMM_WS = GemmVariant("wgmma 128x128 warp-specialised 6-stage", 128, 128, stages=6, pending=1,
                      warp_specialised=True)
# linear_wgmma_tma (the warp-specialised ring fed by TMA): 128x256 at 4 stages (48 KiB a
# stage), 128x128 at 6 (32 KiB a stage), one block an SM.
GEMM_TMA_WIDE = GemmVariant("wgmma 128x256 TMA", 128, 256, stages=4, pending=1, tma=True)
GEMM_TMA = GemmVariant("wgmma 128x128 TMA 6-stage", 128, 128, stages=6, pending=1, tma=True)
# ... and at two blocks an SM (3 stages of 32 KiB each), so that one block's epilogue runs
# under the other's wgmmas, as the plain kernel's do.
TMA_TWO_PER_SM_THREADS = 288  # two consumer warpgroups and a producer warp
GEMM_TMA_TWO_PER_SM = GemmVariant("wgmma 128x128 TMA 2/SM", 128, 128, stages=3, pending=1,
                                  tma=True, blocks_per_sm=2)
# ... and persistent: two blocks an SM in all, each walking its share of the output tiles, so
# that the producer copies a tile's first stages under the previous tile's epilogue.
GEMM_TMA_PERSISTENT = GemmVariant("wgmma 128x128 TMA 2/SM persistent", 128, 128, stages=3,
                                  pending=1, tma=True, blocks_per_sm=2, persistent=True)
# ... and (not persistent) its epilogue through shared memory, so that a warp reads and writes
# whole rows: 512 contiguous bytes of the fp32 residual a warp instead of eight 32-byte pieces.
GEMM_TMA_STAGED = GemmVariant("wgmma 128x128 TMA 2/SM staged epilogue", 128, 128, stages=3,
                              pending=1, tma=True, blocks_per_sm=2, staged_epilogue=True)
# The layer's GEMMs run it where no variant is named and it fits (layer.gemm_variant_for), from
# a reduction of LAYER_TMA_MIN_K columns on: faster than every other variant on shape 8's GEMMs
# on the H200, each epilogue (UNSTAGED_GEMM_VARIANT with CupyBackend(staged_epilogue=False)).
# Shorter reductions (two K tiles at d_model 128) keep the plain schedule.
LAYER_GEMM_VARIANT = GEMM_TMA_STAGED
UNSTAGED_GEMM_VARIANT = GEMM_TMA_TWO_PER_SM
LAYER_TMA_MIN_K = 512
# linear_wgmma's variants, the default first: its schedule runs every tile (WGMMA_TILES,
# NORM_TILES), epilogue and product count, and ops.gemm_tile picks its tile where no variant
# is named. The others are compiled for GEMM_VARIANT_EPILOGUES at one product (three products
# would double their shared memory, past a block's 227 KiB); timed on the H200, each other
# one was slower than LAYER_GEMM_VARIANT on shape 8's GEMMs (the one-block-an-SM TMA ones
# faster than the plain schedule alone, slower in whole layers) and stays an option.
GEMM_VARIANTS = (GEMM_PLAIN, GEMM_WAIT1, GEMM_WIDE, GEMM_WS_WIDE, GEMM_WS, GEMM_TMA_WIDE,
                 GEMM_TMA, GEMM_TMA_TWO_PER_SM, GEMM_TMA_PERSISTENT, GEMM_TMA_STAGED)
GEMM_VARIANT_EPILOGUES = ("half", "gelu_pair", "residual")
GEMM_VARIANT_PRODUCTS = 1


# float4s a lane of the LayerNorm kernel holds (norm.cu's HELD): rows up to 128 x held wide
# are read once; wider rows stream at the largest.
NORM_HELD = (1, 2, 4, 8)


def norm_held(d: int) -> int:
    """The fewest float4s a lane that hold a row of d columns (the largest past 1024)."""
    return next((h for h in NORM_HELD if d <= 128 * h), NORM_HELD[-1])


def norm_name(output: str, d: int) -> str:
    """Name expression of the LayerNorm kernel writing output ("pair", "half" or "float")
    for rows of d columns."""
    return f"lb::layer_norm<{NORM_OUTPUTS[output]}, {norm_held(d)}>"


def gemm_compiled(epilogue: str, products: int) -> bool:
    """Whether the module has the plain GEMMs (mma.sync and wgmma) for epilogue at products:
    every epilogue at one and three, TWO_PRODUCT_EPILOGUES at two (residual_norm: the wgmma
    NORM_TILES only)."""
    return products in GEMM_PRODUCTS and (products != 2 or epilogue in TWO_PRODUCT_EPILOGUES)


def gemm_name(tile, products: int, epilogue: str) -> str:
    """Name expression of the GEMM kernel for tile (BM, BN, WM, WN), products and epilogue."""
    bm, bn, wm, wn = tile
    return f"lb::linear<{bm}, {bn}, {wm}, {wn}, {products}, {EPILOGUES[epilogue]}>"


def wgmma_name(tile, products: int, epilogue: str, stages: int = GEMM_PLAIN.stages,
               pending: int = GEMM_PLAIN.pending, staged: int = 0) -> str:
    """Name expression of the Hopper GEMM kernel for tile (BM, BN), products, epilogue and
    schedule (cp.async stages, wgmma groups left running; default the plain schedule);
    staged (1 or True): its epilogue through shared memory (STAGED_TILE, the plain schedule
    only), a warp a row; 2: eight lanes a row (EIGHT_LANE_EPILOGUES only)."""
    bm, bn = tile
    short_norm = ((tuple(tile), epilogue, stages, pending)
                  == (SHORT_NORM_TILE, NORM_EPILOGUE, SHORT_NORM_STAGES, 0))
    if staged and not short_norm and (tuple(tile) != STAGED_TILE
                                      or (stages, pending) != GEMM_PLAIN.tile_schedule):
        raise ValueError(f"the staged epilogue runs on the plain {STAGED_TILE} GEMM and the "
                         "short residual-norm one only")
    if staged == 2 and (short_norm or epilogue not in EIGHT_LANE_EPILOGUES):
        raise ValueError(f"eight lanes a row: the {STAGED_TILE} GEMM's "
                         f"{' and '.join(EIGHT_LANE_EPILOGUES)} epilogues only")
    return (f"lb::linear_wgmma<{bm}, {bn}, {products}, {EPILOGUES[epilogue]}, {stages}, "
            f"{pending}{f', {int(staged)}' if staged else ''}>")


def short_norm_name(products: int) -> str:
    """Name expression of the short residual-norm GEMM (SHORT_NORM_TILE, SHORT_NORM_STAGES,
    staged) at products."""
    return wgmma_name(SHORT_NORM_TILE, products, NORM_EPILOGUE, SHORT_NORM_STAGES, 0,
                      staged=True)


def norm_prologue_name(tile, products: int, epilogue: str) -> str:
    """Name expression of the Hopper GEMM with LayerNorm in its prologue for tile (BM, BN),
    products and epilogue."""
    bm, bn = tile
    return f"lb::linear_wgmma_norm_prologue<{bm}, {bn}, {products}, {EPILOGUES[epilogue]}>"


def norm_prologue_compiled(epilogue: str, products: int) -> bool:
    """Whether the module has the norm-prologue GEMMs for epilogue at products
    (PROLOGUE_EPILOGUES)."""
    return products in PROLOGUE_EPILOGUES.get(epilogue, ())


def gemm_variant_name(variant: GemmVariant, products: int, epilogue: str) -> str:
    """Name expression of the Hopper GEMM kernel of variant for products and epilogue (a
    warp-specialised variant: linear_wgmma_ws<BN, epilogue, stages>, a TMA one
    linear_wgmma_tma<BN, epilogue, stages> or, two blocks an SM,
    linear_wgmma_tma<BN, epilogue, stages, 2> (persistent: <BN, epilogue, stages, 2, 1>,
    staged epilogue: <BN, epilogue, stages, 2, 0, 1>),
    one product only)."""
    if variant.warp_specialised or variant.tma:
        if products != 1 or variant.bm != 128 or variant.pending != 1:
            raise ValueError(f"{variant.name} runs one product on BM 128, one group pending")
        kernel = "linear_wgmma_tma" if variant.tma else "linear_wgmma_ws"
        blocks = f", {variant.blocks_per_sm}" if variant.blocks_per_sm != 1 else ""
        blocks += ", 1" if variant.persistent else ", 0, 1" if variant.staged_epilogue else ""
        return f"lb::{kernel}<{variant.bn}, {EPILOGUES[epilogue]}, {variant.stages}{blocks}>"
    return wgmma_name(variant.tile, products, epilogue, variant.stages, variant.pending)


def gemm_variant_names() -> list[str]:
    """Every wgmma GEMM variant's name, the default first."""
    return [v.name for v in GEMM_VARIANTS]


def gemm_variant(name: str) -> GemmVariant:
    """The wgmma GEMM variant called name; ValueError naming those there are otherwise."""
    for v in GEMM_VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"cupy has no GEMM variant {name!r}; it has "
                     f"{', '.join(repr(n) for n in gemm_variant_names())}")


def gemm_variant_compiled(variant: GemmVariant, epilogue: str, products: int) -> bool:
    """Whether the module has variant's kernel for epilogue at products: the default where
    gemm_compiled, the others for GEMM_VARIANT_EPILOGUES at one product."""
    if variant == GEMM_PLAIN:
        return gemm_compiled(epilogue, products)
    return epilogue in GEMM_VARIANT_EPILOGUES and products == GEMM_VARIANT_PRODUCTS


def attention_name(head_pad: int, bq: int, bkv: int) -> str:
    """Name expression of mma.sync flash attention at a padded head dim with BQ queries, BKV
    keys."""
    return f"lb::flash_attention<{head_pad}, {bq}, {bkv}>"


def whole_block_name(d_model: int, ffn_width: int, rows: int) -> str:
    """Name expression of the whole-block kernel at d_model, an FFN width (padded to 16) and
    query rows a block (one of WHOLE_BLOCK_ROWS)."""
    return f"lb::whole_block<{d_model}, {ffn_width}, {rows}>"


def after_attention_name(d_model: int, ffn_width: int, rows: int) -> str:
    """Name expression of the after-attention kernel at d_model, an FFN width (padded to 16)
    and rows a block (one of AFTER_ATTENTION_ROWS)."""
    return f"lb::after_attention<{d_model}, {ffn_width}, {rows}>"


def attention_wgmma_name(head_pad: int, variant: AttentionVariant) -> str:
    """Name expression of the sm_90a flash attention kernel of variant at a padded head dim
    (a TMA variant: flash_attention_wgmma_tma<HP, BQ, BKV, kv_stages, schedule (+
    TMA_POLY_EXP2 times 8 / poly_every)>; the polynomial exists on the TMA ring only)."""
    v = variant
    if v.poly_every and not v.tma:
        raise ValueError(f"{v.name}: the polynomial exponential runs on the TMA ring only")
    if v.tma:
        if (v.pipelined or v.min_blocks not in (1, 2) or (v.min_blocks == 2 and v.bq != 128)
                or v.bq not in (128, 192)
                or v.bkv not in (64, 128) or v.kv_stages < 1
                or v.poly_every not in (0, *POLY_EVERY_CHOICES)):
            raise ValueError(f"{v.name} runs BQ 128 or 192, BKV 64 or 128, one block an SM "
                             f"(BQ 128: one or two), a ring, the polynomial on one pair in 8 "
                             f"or 4, or none")
        poly = TMA_POLY_EXP2 * (POLY_EVERY_CHOICES[0] // v.poly_every) if v.poly_every else 0
        blocks = f", {v.min_blocks}" if v.min_blocks > 1 else ""
        return (f"lb::flash_attention_wgmma_tma<{head_pad}, {v.bq}, {v.bkv}, {v.kv_stages}, "
                f"{v.schedule + poly}{blocks}>")
    return (f"lb::flash_attention_wgmma<{head_pad}, {v.bq}, {v.bkv}, {v.min_blocks}, "
            f"{int(v.pipelined)}>")


def attention_variant_names() -> list[str]:
    """Every wgmma attention variant's name, in table order."""
    return list(dict.fromkeys(v.name for vs in ATTENTION_WGMMA.values() for v in vs))


def attention_variant(head_pad: int, name: str | None = None,
                      head_dim: int | None = None) -> AttentionVariant:
    """The wgmma attention variant called name at a padded head dim (32, 64, 128 or 256), or
    its default where name is None; ValueError naming those it has otherwise, or (head_dim
    given) the variant's refusal of head_dim."""
    variants = ATTENTION_WGMMA[head_pad]
    if name is None:
        return variants[0]
    for v in variants:
        if v.name == name:
            why = None if head_dim is None else v.refusal(head_dim, head_pad)
            if why:
                raise ValueError(why)
            return v
    raise ValueError(f"cupy attention at padded head dim {head_pad} has no variant {name!r}; "
                     f"it has {', '.join(repr(v.name) for v in variants)}")


def nvrtc_arch(device_arch: str) -> str:
    """The architecture the module is compiled for on a device: sm_90a on sm_90 (wgmma),
    the device's own elsewhere."""
    return HOPPER if device_arch == "90" else device_arch


def name_expressions(arch: str) -> list[str]:
    """Every kernel instantiation of the module compiled for arch (the wgmma GEMMs on sm_90a
    only; residual_norm on the wgmma NORM_TILES only; two products for TWO_PRODUCT_EPILOGUES
    only; the GEMM variants past the default on GEMM_VARIANT_EPILOGUES at one product; the
    staged-epilogue twins of the STAGED_TILE GEMMs (EIGHT_LANE_EPILOGUES' also eight lanes
    a row) and the short residual-norm GEMMs; the norm-prologue GEMMs on
    PROLOGUE_EPILOGUES; the whole-block kernels at WHOLE_BLOCK_WIDTHS; the after-attention
    kernels at AFTER_ATTENTION_WIDTHS)."""
    tiled = [(p, e) for p in GEMM_PRODUCTS for e in EPILOGUES
             if e != NORM_EPILOGUE and gemm_compiled(e, p)]
    normed = [p for p in GEMM_PRODUCTS if gemm_compiled(NORM_EPILOGUE, p)]
    names = [norm_name(o, 128 * h) for o in NORM_OUTPUTS for h in NORM_HELD]
    names += [gemm_name(t, p, e) for t in GEMM_TILES for p, e in tiled]
    if arch == HOPPER:
        names += [wgmma_name(t, p, e) for t in WGMMA_TILES for p, e in tiled]
        names += [wgmma_name(t, p, NORM_EPILOGUE) for t in NORM_TILES for p in normed]
        names += [wgmma_name(STAGED_TILE, p, e, staged=True) for p, e in tiled]
        names += [wgmma_name(STAGED_TILE, p, NORM_EPILOGUE, staged=True) for p in normed]
        names += [wgmma_name(STAGED_TILE, p, e, staged=2) for p in GEMM_PRODUCTS
                  for e in EIGHT_LANE_EPILOGUES if gemm_compiled(e, p)]
        names += [short_norm_name(p) for p in normed]
        names += [gemm_variant_name(v, GEMM_VARIANT_PRODUCTS, e) for v in GEMM_VARIANTS[1:]
                  for e in GEMM_VARIANT_EPILOGUES]
        names += [norm_prologue_name(t, p, e) for t in WGMMA_TILES
                  for e, counts in PROLOGUE_EPILOGUES.items() for p in counts]
        names += [attention_wgmma_name(hp, v) for hp, vs in ATTENTION_WGMMA.items() for v in vs]
    names += [attention_name(hp, bq, bkv) for hp, tiles in ATTENTION_TILES.items()
              for bq, bkv in tiles]
    names += [whole_block_name(d, f, rows) for d, f in WHOLE_BLOCK_WIDTHS
              for rows in WHOLE_BLOCK_ROWS]
    names += [after_attention_name(d, f, rows) for d, f in AFTER_ATTENTION_WIDTHS
              for rows in AFTER_ATTENTION_ROWS]
    return names


def module_source() -> str:
    """The module's source: each kernel file included once (found in SOURCE_DIR), after a
    hash of every source file, so that CuPy's cache, keyed by this text, misses when a file
    changes."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in source_files())).hexdigest()
    return f"// layerbench cupy sources {digest}\n" + "".join(
        f'#include "{name}"\n' for name in SOURCES)


def include_candidates() -> list[Path]:
    """Folders that may hold the toolkit headers, in order: $CUDA_HOME, $CUDA_PATH, the
    NVIDIA pip packages, /usr/local/cuda."""
    found = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH")
             if os.environ.get(v)]
    try:
        import nvidia
        for root in nvidia.__path__:
            found += [Path(root) / sub / "include" for sub in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    found.append(Path("/usr/local/cuda/include"))
    return found


@functools.cache
def cuda_include() -> str:
    """The first candidate folder holding cuda_fp16.h; Unsupported naming those tried."""
    candidates = include_candidates()
    for folder in candidates:
        if (folder / HEADER).exists():
            return str(folder)
    raise Unsupported(f"cupy: no CUDA headers ({HEADER}) in " +
                      ", ".join(str(c) for c in candidates) +
                      "; set CUDA_HOME or pip install nvidia-cuda-runtime")


# CuPy's RawModule appends this to every NVRTC compile; compile_with_nvrtc adds it too, so
# that the cubins it makes without a GPU hold the code the GPU runs (exp2f, for one, is a
# single MUFU.EX2 with it, and three more instructions without).
CUPY_ADDED_OPTION = "-ftz=true"


def options(arch: str | None = None) -> tuple[str, ...]:
    """NVRTC options, for one architecture ("90a" for sm_90a) or, without one, for CuPy to
    add the device's (CuPy appends its own -arch=sm_XX; NVRTC takes sm_90a over sm_90, and
    CuPy adds -ftz=true, which flushes fp32 subnormals only). No fast math: exact GELU needs
    erff, and the contract leaves no room for approximate division."""
    target = (f"--gpu-architecture=sm_{arch}",) if arch else ()
    return ("-std=c++17", *target, f"-I{SOURCE_DIR}", f"-I{cuda_include()}")


def source_files() -> list[Path]:
    """Every file the module is built from."""
    return [SOURCE_DIR / n for n in SOURCES + HEADERS]


def compile_with_nvrtc(arch: str) -> tuple[bytes, dict[str, str]]:
    """Compile the module with cuda-python's NVRTC to a cubin for arch, without a GPU, with
    the options CuPy would use (options and CUPY_ADDED_OPTION): (cubin, name expression ->
    lowered symbol). Raises RuntimeError with the compiler log on error
    or warning."""
    from cuda.bindings import nvrtc

    def check(result, log=""):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {result[0]}\n{log}")
        return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)

    program = check(nvrtc.nvrtcCreateProgram(module_source().encode(), b"layerbench_cupy.cu",
                                             0, [], []))
    names = name_expressions(arch)
    for name in names:
        check(nvrtc.nvrtcAddNameExpression(program, name.encode()))
    flags = [o.encode() for o in (*options(arch), CUPY_ADDED_OPTION)]
    result = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
    size = check(nvrtc.nvrtcGetProgramLogSize(program))
    log = bytearray(size)
    check(nvrtc.nvrtcGetProgramLog(program, log))
    text = log.decode(errors="replace").rstrip("\x00").strip()
    check(result, text)
    if "warning" in text:
        raise RuntimeError(f"NVRTC warnings for sm_{arch}:\n{text}")
    size = check(nvrtc.nvrtcGetCUBINSize(program))
    cubin = bytearray(size)
    check(nvrtc.nvrtcGetCUBIN(program, cubin))
    lowered = {n: check(nvrtc.nvrtcGetLoweredName(program, n.encode())).decode() for n in names}
    check(nvrtc.nvrtcDestroyProgram(program))
    return bytes(cubin), lowered


def compile_every_arch_with_nvrtc() -> dict[str, tuple[bytes, dict[str, str]]]:
    """arch -> compile_with_nvrtc(arch) for every arch of ARCHES, compiled side by side (NVRTC
    runs without the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(ARCHES)) as pool:
        return dict(zip(ARCHES, pool.map(compile_with_nvrtc, ARCHES)))


@functools.cache
def module_for(arch: str):
    """The cupy.RawModule of the kernels for the current device, whose architecture is
    arch, compiled once per process and architecture (CuPy keeps compiled modules in its
    own disk cache across processes)."""
    import cupy

    target = nvrtc_arch(arch)
    return cupy.RawModule(code=module_source(),
                          options=options(target if target != arch else None),
                          name_expressions=name_expressions(target), backend="nvrtc")
