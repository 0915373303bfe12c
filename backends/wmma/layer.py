"""The wmma layer: packs and splits the weights, plans the workspace, streams the batch in
chunks and launches the kernels block by block (replayed from a CUDA graph where it can)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from layerbench.common.cuda_host import (MAX_GRID_X, ChunkPlan, mask_bytes,
                                         max_shared_memory_per_block, multiprocessor_count,
                                         run_in_chunks, split_fp16)
from layerbench.common.graphs import GraphedForward
from layerbench.common.interface import BuiltLayer
from layerbench.common.params import pack_params, param_bytes
from layerbench.common.precision import DEEP_STACK_PRODUCTS, deep_stack, default_products

from .attention import attention, layout_ok
from .block import FFN_BLOCK_PRODUCTS, FFN_BLOCK_ROWS, ffn_block, norm_qkv
from .linear import GELU_PAIR, HALF, RESIDUAL_SUM, RESIDUAL_UPDATE, RowNorm, linear
from .norm import norm_out, norm_split
from .tiles import choose_tiles, gemm_tile



@dataclass(frozen=True)
class Plan:
    """Which fused kernels run a block; the rest runs as separate LayerNorm and GEMM kernels.

    fuse_qkv: norm1 in the Q/K/V GEMM's prologue (norm_qkv, d_model up to 256).
    fuse_ffn: out_proj to the block's output rows and their next norm (the next block's
    norm1, or the final norm) in one kernel (ffn_block: d_model and ffn_dim up to 128, one or
    two products); with ffn_auto only on calls whose rows it runs faster (ffn_block_pays).
    linear_products: fp16 products of out_proj and the FFN: 3 (fp16x3: both operands split
    into hi and lo), 2 (activations split, weights rounded to fp16 once) or 1 (both rounded
    to fp16); large_call_products, where set, replaces it in forwards of more than
    LARGE_CALL_TOKENS tokens.
    fuse_norms: LayerNorm in the epilogue of the separate residual GEMMs where their tile
    holds whole rows (d_model <= 128, K <= 128; tiles.norm_gemm_tile): out_proj writes norm2's
    (hi, lo) pair, ffn_out the next block's norm1 (hi; unless fuse_qkv) or the final norm
    into the output. The first block's norm1 still runs as norm_split.
    stream_tile: the stream GEMM variant (a tiles.GEMM_TILES index) of the linears whose rows
    give each SM two 128x128 tiles, or None: tiles.long_stream_tile's rule.
    norm_in_registers: norm_split's kernel that reads each row once into registers.
    persistent_gemm: the linears with K > 128 on the persistent form of the pipelined tile
    (tiles.gemm_tile's persistent).
    pdl: every kernel of the forward launches as a programmatic dependent of the one before
    it (sm_90 on): it may begin launching while that kernel runs, and waits for it before
    touching memory; the replayed CUDA graph keeps these edges.
    qkv_products: fp16 products of Q/K/V: 1, or 3 (qkv_products_for: deep stacks), where
    norm1 writes its rows as (hi, lo) pairs and neither norm_qkv nor ffn_block (which write
    them as hi alone) runs.
    """
    fuse_qkv: bool
    fuse_ffn: bool
    linear_products: int = 3
    fuse_norms: bool = True
    ffn_auto: bool = False
    large_call_products: int | None = None
    stream_tile: int | None = None
    norm_in_registers: bool = True
    pdl: bool = False
    persistent_gemm: bool = False
    qkv_products: int = 1

    def __post_init__(self):
        if self.qkv_products == 3 and self.fuse_qkv:
            raise ValueError("Plan: norm_qkv (fuse_qkv) runs Q/K/V at one product, not three")

    def products_for(self, tokens: int) -> int:
        """fp16 products of out_proj and the FFN in a forward of this many tokens:
        large_call_products above LARGE_CALL_TOKENS (where set), else linear_products."""
        if self.large_call_products is not None and tokens > LARGE_CALL_TOKENS:
            return self.large_call_products
        return self.linear_products

    def weight_products(self) -> int:
        """The most products any call runs (3: the weights are kept as (hi, lo) pairs)."""
        return max(self.linear_products, self.large_call_products or 0)

    def runs_ffn_block(self, rows: int, multiprocessors: int, products: int) -> bool:
        """Whether a call of this many rows and products runs ffn_block."""
        return (self.fuse_ffn and products in FFN_BLOCK_PRODUCTS and self.qkv_products == 1
                and (not self.ffn_auto or ffn_block_pays(rows, multiprocessors)))

    def always_ffn_block(self) -> bool:
        """Whether every call runs ffn_block (then no call needs the hidden-row buffers)."""
        return (self.fuse_ffn and not self.ffn_auto and self.qkv_products == 1
                and self.weight_products() in FFN_BLOCK_PRODUCTS)


@contextmanager
def programmatic_launches(ext, on: bool):
    """Within the block, this thread launches the forward kernels as programmatic dependents
    where on (ext.set_programmatic_launches); the previous setting comes back after it."""
    previous = ext.set_programmatic_launches(on)
    try:
        yield
    finally:
        ext.set_programmatic_launches(previous)


def ffn_block_pays(rows: int, multiprocessors: int) -> bool:
    """Whether ffn_block beats the separate kernels: from half a wave to four waves of its
    64-row blocks (FFN_BLOCK_ROWS, one an SM). H200, d_model 128, against the separate kernels: 8192 rows
    (128 blocks) 0.195 ms against 0.254 (shape 1), 16384 rows 0.326 against 0.364 (shape 5);
    slower at 2048 rows (32 blocks: shape 4 0.147 against 0.138) and at 65536 rows (1024
    blocks: shape 13 1.514 against 1.475)."""
    blocks = -(-rows // FFN_BLOCK_ROWS)
    return multiprocessors <= 2 * blocks and blocks <= 4 * multiprocessors


def linear_products_for(d_model: int) -> int:
    """fp16 products of out_proj and the FFN by default: 1 from d_model 512 on, where the
    GEMMs are bound by the tensor cores (H200 shape 8, two products against three: 3.18 ms
    against 3.71, error/allowed 0.60 against 0.53), 2 below (H200, against three: shape 1
    0.248 ms against 0.271, shape 13 1.471 against 1.582 at error/allowed 0.62 against 0.63)."""
    return 1 if d_model >= 512 else 2


# Forwards of more tokens run large_call_products_for: the more output elements, the
# further the error's tail reaches (H200, shape 6, 1.28 million tokens of width 128: two
# products reach error/allowed 0.875, three 0.65-0.79, one fails at 1.04; shape 13, 65536
# tokens: two products 0.62).
LARGE_CALL_TOKENS = 2 ** 18


def large_call_products_for(d_model: int) -> int:
    """fp16 products of out_proj and the FFN by default in forwards of more than
    LARGE_CALL_TOKENS tokens: 3 below d_model 512 (shape 6: 19.25 ms against 18.07 with
    two, for the margin above), else linear_products_for's 1."""
    return 1 if d_model >= 512 else 3


def plan_products(config, linear_products: int | None) -> tuple[int, int | None]:
    """(linear_products, large_call_products) of the plan for config: linear_products in every
    call where given; else linear_products_for and large_call_products_for by width, or
    three in every call of a stack deeper than common.precision.DEEP_STACK_BLOCKS."""
    if linear_products:
        return linear_products, None
    return (default_products(config, linear_products_for(config.d_model)),
            default_products(config, large_call_products_for(config.d_model)))


def qkv_products_for(config) -> int:
    """fp16 products of Q/K/V: three in stacks deeper than common.precision.DEEP_STACK_BLOCKS
    (bench/depth_study.py, three products for out_proj and the FFN: 24 blocks of width 512
    at error/allowed 0.88 with one-product Q/K/V, 0.55 with exact Q/K/V operands; 32 blocks
    of width 1024 at 1.17 against 0.62), else one."""
    return DEEP_STACK_PRODUCTS if deep_stack(config) else 1


def workspace(config, plan: Plan | None = None) -> dict[str, tuple[int, torch.dtype]]:
    """Per-token workspace buffers of the plan (None: the largest): name -> (columns, dtype).
    "rows" holds the normed rows and then the context, as an fp16 (hi, lo) pair."""
    d, f = config.d_model, config.ffn_dim
    buffers = {"residual": (d, torch.float32), "qkv": (3 * d, torch.float16),
               "rows_hi": (d, torch.float16), "rows_lo": (d, torch.float16)}
    if plan is None or not plan.always_ffn_block():
        buffers.update(hidden_hi=(f, torch.float16), hidden_lo=(f, torch.float16))
    return buffers


def working_bytes_per_sequence(config, plan: Plan | None = None,
                               seq_len: int | None = None) -> int:
    """Workspace bytes of one sequence (of seq_len tokens, default the config's)."""
    per_token = sum(c * t.itemsize for c, t in workspace(config, plan).values())
    return (config.seq_len if seq_len is None else seq_len) * per_token


def weight_bytes(config) -> int:
    """Bytes of the packed fp32 parameters plus the fp16 weight parts (Q/K/V: hi only, but
    with three products)."""
    d, f = config.d_model, config.ffn_dim
    qkv_parts = 2 if qkv_products_for(config) == 3 else 1
    split = config.num_layers * (3 * d * d * 2 * qkv_parts + (d * d + 2 * d * f) * 4)
    return param_bytes(config) + split


class WmmaLayer(BuiltLayer):
    """Per block: norm1 and Q/K/V (one fp16 product; fused: norm_qkv), attention, then
    out_proj (+ residual), norm2, ffn_in (+ GELU), ffn_out (+ residual) (fused: ffn_block,
    which also applies the next block's norm1 or the final norm); the final norm into the
    output. With fuse_norms, norm2, the next block's norm1 and the final norm run in the
    residual GEMMs' epilogues where their tiles hold whole rows."""

    def __init__(self, backend, config, state_dict, device, dtype, ext, plan: Plan):
        super().__init__(backend, config, device, dtype)
        self.ext = ext
        self.plan = plan
        self.params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        self.weights = [self._weights(p, plan.weight_products(), plan.qkv_products)
                        for p in self.params.layers]
        # Free memory is asked after the weights are packed: nothing fixed to add.
        self.chunks = ChunkPlan(device, lambda s: working_bytes_per_sequence(config, plan, s),
                                0, MAX_GRID_X // config.num_heads)
        self.multiprocessors = multiprocessor_count(device)
        self.smem_limit = max_shared_memory_per_block(device)
        self.graphed = GraphedForward(self._forward)
        # What a first forward would ask the device (the attention layout probe synchronises,
        # the chunk plan reads free memory), asked now: that forward may be inside a caller's
        # CUDA-graph capture. The output that forward allocates is not there yet: reserved.
        layout_ok(ext, device)
        output_bytes = (config.batch_size * config.seq_len * config.d_model
                        * dtype.itemsize)
        self.chunks(config.batch_size, config.seq_len, reserve_bytes=output_bytes)

    @staticmethod
    def _weights(p, products: int, qkv_products: int) -> dict:
        """fp16 (hi, lo) parts of the weights; hi only where their linear runs one or two
        products."""
        def parts(w, count):
            return split_fp16(w) if count == 3 else (w.to(torch.float16).contiguous(), None)
        return {"qkv": parts(p.qkv_weight, qkv_products), "out": parts(p.out_weight, products),
                "ffn_in": parts(p.ffn_in_weight, products),
                "ffn_out": parts(p.ffn_out_weight, products)}

    def forward(self, x, valid_token_mask, out=None):
        """Run the kernels, through a CUDA graph once these input buffers repeat."""
        return self.graphed(x, valid_token_mask, out)

    def _forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The eager forward: the batch in chunks that fit, into out (or a new tensor)."""
        b, s, _ = x.shape
        valid = mask_bytes(valid_token_mask)
        out = torch.empty_like(x) if out is None else out
        products = self.plan.products_for(b * s)

        def run_chunk(b0, b1, x2, out2, work):
            self._run(x2, None if valid is None else valid[b0:b1], out2, b1 - b0, s, work,
                      products)
        with programmatic_launches(self.ext, self.plan.pdl):
            run_in_chunks(x, out, self.chunks, workspace(self.config, self.plan),
                          run_chunk)
        return out

    def _run(self, x2, valid, out2, batch, s, work, products):
        """The stack on one chunk: x2 [t, D] in the input dtype -> out2 [t, D], out_proj and
        the FFN with this many fp16 products."""
        ext, cfg, plan = self.ext, self.config, self.plan
        res, qkv = work["residual"], work["qkv"]
        rows = (work["rows_hi"], work["rows_lo"])  # normed rows, then the context
        valid_rows = None if valid is None else valid.reshape(-1)
        fused = plan.runs_ffn_block(x2.shape[0], self.multiprocessors, products)
        tiles = choose_tiles(x2.shape[0], cfg.d_model, cfg.ffn_dim, cfg.head_dim,
                             self.multiprocessors, fuse_norms=plan.fuse_norms and not fused,
                             products=products, smem_limit=self.smem_limit,
                             stream_tile=plan.stream_tile, persistent=plan.persistent_gemm,
                             qkv_products=plan.qkv_products)
        if tiles.norm_ffn_out and plan.fuse_qkv:  # ffn_out norms only the final rows
            plain_ffn_out = gemm_tile(x2.shape[0], cfg.d_model, cfg.ffn_dim,
                                      self.multiprocessors, products, plan.stream_tile,
                                      plan.persistent_gemm)
        else:
            plain_ffn_out = tiles.ffn_out
        final = (self.params.final_weight, self.params.final_bias)
        layers = self.params.layers
        last = len(layers) - 1
        src = x2

        def operand(pair):
            """The fp16 parts of an activation the linears multiply (hi only: one product)."""
            return pair if products > 1 else (pair[0], None)

        def weight(pair):
            """The fp16 parts of a weight the linears multiply (hi only below three)."""
            return pair if products == 3 else (pair[0], None)
        # norm1's rows: a pair where Q/K/V takes three products, else hi alone
        norm1_rows = rows if plan.qkv_products == 3 else (rows[0], None)
        normed = False  # rows[0] holds this block's norm1 (from the last ffn_out's epilogue)
        done = fused  # out2 written
        for i, (p, w) in enumerate(zip(layers, self.weights)):
            # The first block copies its input into the fp32 residual where it is fp16/bf16, or
            # fp32 rows not 16-byte aligned (ffn_block reads its residual 16 bytes at a time).
            copy = res if src.dtype != torch.float32 or src.data_ptr() % 16 else None
            if plan.fuse_qkv:
                norm_qkv(ext, src, p, w["qkv"][0], qkv, copy=copy)
            else:
                if not normed:
                    norm_split(ext, src, p.norm1_weight, p.norm1_bias, norm1_rows,
                               copy=copy, in_registers=plan.norm_in_registers)
                linear(ext, norm1_rows, w["qkv"], p.qkv_bias, epilogue=HALF,
                       tile=tiles.qkv, out_pair=(qkv, None))
            src = src if copy is None else res
            attention(ext, qkv, rows, valid, batch=batch, seq_len=s, num_heads=cfg.num_heads,
                      causal=cfg.causal, block_n=tiles.attention_block_n)
            if fused:
                if i == last:
                    after = RowNorm(*final, out2, zero_invalid=True)
                else:  # the next block's norm1 into rows[0], unless norm_qkv runs it
                    after = (None if plan.fuse_qkv else
                             RowNorm(layers[i + 1].norm1_weight, layers[i + 1].norm1_bias,
                                     rows[0]))
                ffn_block(ext, operand(rows), src, None if i == last else res, valid_rows, p,
                          w, after)
                normed = after is not None and i < last
            else:
                hidden = (work["hidden_hi"], work["hidden_lo"])
                # norm2 into the context's own buffers: each CTA holds the rows it writes.
                norm2 = (RowNorm(p.norm2_weight, p.norm2_bias, rows[0], rows[1])
                         if tiles.norm_out_proj else None)
                linear(ext, operand(rows), weight(w["out"]), p.out_bias,
                       epilogue=RESIDUAL_UPDATE,
                       tile=tiles.out_proj, out=res, residual=src, valid_rows=valid_rows,
                       norm=norm2)
                if norm2 is None:
                    norm_split(ext, res, p.norm2_weight, p.norm2_bias, operand(rows),
                               in_registers=plan.norm_in_registers)
                linear(ext, operand(rows), weight(w["ffn_in"]), p.ffn_in_bias,
                       epilogue=GELU_PAIR,
                       tile=tiles.ffn_in, out_pair=hidden)
                after = None  # the norm in ffn_out's epilogue
                if tiles.norm_ffn_out and i == last:
                    after = RowNorm(*final, out2, zero_invalid=True)
                elif tiles.norm_ffn_out and not plan.fuse_qkv:
                    after = RowNorm(layers[i + 1].norm1_weight, layers[i + 1].norm1_bias,
                                    *norm1_rows)
                linear(ext, operand(hidden), weight(w["ffn_out"]), p.ffn_out_bias,
                       epilogue=RESIDUAL_SUM,
                       tile=tiles.ffn_out if after is not None else plain_ffn_out,
                       out=None if after is not None and i == last else res, residual=res,
                       valid_rows=valid_rows, norm=after)
                normed = after is not None and i < last
                done = after is not None and i == last
            src = res
        if not done:
            norm_out(ext, src, *final, out2, valid_rows)
