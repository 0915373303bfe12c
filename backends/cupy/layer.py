"""The cupy layer: packs the weights as fp16 pairs, plans the workspace, streams the batch in
chunks and launches seven kernels per block (five where the LayerNorms run in the residual
GEMMs' epilogues or in the prologues of the GEMMs that read them; three with the
after-attention kernel; one with the whole-block kernel), replayed from a CUDA graph where it
can."""
from __future__ import annotations

import torch

from layerbench.common.cuda_host import (MAX_GRID_Y, ChunkPlan, cdiv, float_rows,
                                         forward_in_chunks, multiprocessor_count, padded,
                                         padded_vector, weight_pair)
from layerbench.common.graphs import GraphedForward
from layerbench.common.interface import BuiltLayer
from layerbench.common.params import pack_params

from . import build, ops, tensor_maps

WEIGHTS = ("qkv_weight", "out_weight", "ffn_in_weight", "ffn_out_weight")


def linear_products_for(d_model: int) -> int:
    """fp16 products of out_proj and the FFN: 1 (activations rounded to fp16) from d_model
    512 on, where the GEMMs are bound by the tensor cores; 3 (activations and weights split)
    below, where one product costs more of the contract's margin."""
    return 1 if d_model >= 512 else 3


FUSED_NORM_WAVES = 3  # a fused grid this many blocks per SM hides its lost width
# Long sequences at head dim 64 run the TMA-ring attention where no variant is named: on one
# 100000-token sequence of shape 14 on the H200, its packed overlap with three consumers
# (FlashAttention-3's configuration) ran at 482 TFLOP/s, the 128x128 ping-pong at 384, the
# plain ring at 277 and the default at 247; at 8192 tokens (causal grid in launch order) 234
# against 225 and 155 (at 1024 tokens, head dim 32, every ring of one block an SM was the
# slower).
LONG_ATTENTION = build.WGMMA_TMA_OVERLAP_3WG
LONG_ATTENTION_HEAD_DIM, LONG_ATTENTION_MIN_KEYS = 64, 4096
# Head dim 32 exactly (the ring's boxes are 32 columns wide) runs the plain TMA ring at two
# blocks an SM where no variant is named: four consumer warpgroups an SM with no block barrier
# and no copy addresses. H200, shape 13's attention 0.114 ms against the default's 0.146;
# whole layers: shape 13 -9%, 6 -5%, 1-4 -3-4%, 5 -3%, 12 level.
NARROW_ATTENTION, NARROW_ATTENTION_HEAD_DIM = build.WGMMA_TMA_2_PER_SM, 32
WHOLE_BLOCK_MAX_WIDTH = max(d for d, _ in build.WHOLE_BLOCK_WIDTHS)
# Where no choice is made, the whole-block kernel runs at d_model up to
# WHOLE_BLOCK_DEFAULT_MAX_WIDTH on one wave of 64-row blocks, and at any width from
# WHOLE_BLOCK_MIN_SEQUENCES sequences with heads of 16 columns or more. H200, time against
# the per-kernel plan's in the same run (ops.whole_block_rows choosing the rows a block):
# shape 7 (d_model 32) 0.59; at d_model 128, 64 sequences or more: shapes 1 0.97, 5 0.72,
# 6 0.94, 9 0.82, 10 0.86, 12 0.87, but shape 11 (16 heads of 8 columns) 1.04; fewer
# sequences leave most multiprocessors idle: shapes 2, 3, 4 (1, 4, 16 sequences) 1.17-1.30.
WHOLE_BLOCK_DEFAULT_MAX_WIDTH = 32
WHOLE_BLOCK_MIN_SEQUENCES, WHOLE_BLOCK_MIN_HEAD_DIM = 64, 16
# Where no choice is made, the after-attention plan (three launches a block) runs where its
# 64-row blocks make one wave, from d_model 64. H200 (bench/PERFORMANCE.md K47), time against
# the plan it replaces in the same run: shapes 2, 3, 4 0.68, 0.66, 0.75 (per-kernel plan), 11
# 0.84, 1 0.81, 12 0.80, 9 0.96, 10 0.91 (whole-block kernel); on more rows the whole-block
# kernel and the per-kernel plan are faster: shapes 5 1.08, 6 1.10, 13 1.01; at d_model 32
# the whole-block kernel: shape 7 1.08.
AFTER_ATTENTION_MIN_WIDTH = 64


def after_attention_by_default(config, rows: int, products: int, device: torch.device) -> bool:
    """Whether a call of rows tokens runs the after-attention plan where no choice is made:
    on a CUDA device, where its kernel runs the config, d_model from
    AFTER_ATTENTION_MIN_WIDTH and its 64-row blocks make one wave."""
    return (device.type == "cuda" and config.d_model >= AFTER_ATTENTION_MIN_WIDTH
            and ops.after_attention_refusal(config, products, device) is None
            and cdiv(rows, max(build.AFTER_ATTENTION_ROWS)) <= multiprocessor_count(device))


def fuses_norms(config, fuse_norms: bool | None, wgmma: bool, products: int = 1,
                device: torch.device | None = None) -> bool:
    """Whether the LayerNorms run in the residual GEMMs' epilogues: on the wgmma GEMMs, rows
    one block holds (d_model up to 128), and asked for (True), or by default (None) where
    it costs no parallelism: the fused grid (whole rows a block) is as large as the
    unfused one, or at least FUSED_NORM_WAVES blocks per SM (measured on the H200: slower
    at shapes 1 and 5, faster at 6, 7 and 13)."""
    if not (fuse_norms is not False and wgmma and config.d_model <= build.MAX_NORM_WIDTH):
        return False
    if fuse_norms or device is None or device.type != "cuda":
        return bool(fuse_norms)
    rows, d = config.batch_size * config.seq_len, config.d_model
    bm, _ = ops.gemm_tile(rows, d, device, products, wgmma=True, norm=True)
    ubm, ubn = ops.gemm_tile(rows, d, device, products, wgmma=True)
    fused = cdiv(rows, bm)
    return (fused >= cdiv(rows, ubm) * cdiv(d, ubn)
            or fused >= FUSED_NORM_WAVES * multiprocessor_count(device))


def uses_norm_prologue(config, norm_prologue: bool | None, wgmma: bool,
                       fuse_norms: bool) -> bool:
    """Whether norm1 and norm2 run in the prologues of Q/K/V and ffn_in: asked for, on the
    wgmma GEMMs, rows one block norms whole (d_model up to build.MAX_PROLOGUE_K), and the
    norms not fused into the residual GEMMs' epilogues (fuse_norms wins where both apply)."""
    return bool(norm_prologue and wgmma and config.d_model <= build.MAX_PROLOGUE_K
                and not fuse_norms)


def workspace(config) -> dict[str, tuple[int, torch.dtype]]:
    """Per-token workspace buffers: name -> (columns, dtype). "rows" holds the normed rows,
    then the context, as an fp16 (hi, lo) pair; "hidden" the FFN's hidden rows, padded to a
    multiple of 8 columns (GELU(0) = 0 there); "residual_next" (d_model up to
    WHOLE_BLOCK_MAX_WIDTH) the whole-block kernel's second residual buffer."""
    d, f = config.d_model, padded(config.ffn_dim)
    # the whole-block kernel's second residual buffer (its blocks read one and write the other)
    following = {"residual_next": (d, torch.float32)} if d <= WHOLE_BLOCK_MAX_WIDTH else {}
    return {"residual": (d, torch.float32), "staging": (d, torch.float32), **following,
            "qkv": (3 * d, torch.float16), "rows_hi": (d, torch.float16),
            "rows_lo": (d, torch.float16), "hidden_hi": (f, torch.float16),
            "hidden_lo": (f, torch.float16)}


def working_bytes_per_sequence(config, seq_len: int | None = None) -> int:
    """Workspace bytes of one sequence (of seq_len tokens, default the config's)."""
    per_token = sum(c * t.itemsize for c, t in workspace(config).values())
    return (config.seq_len if seq_len is None else seq_len) * per_token


class CupyLayer(BuiltLayer):
    """Per block: norm1 (fp16, read by one product), Q/K/V, attention, out_proj + residual,
    norm2, ffn_in + GELU, ffn_out + residual (one, two or three fp16 products each: at two
    the activations' pairs are read and the weights' hi halves alone); the final norm into
    the output. With wgmma, the GEMMs and attention (head dims up to 256) run on Hopper's
    wgmma (linear_wgmma.cu, attention_wgmma.cu;
    attention_variant names the attention kernel's variant, None attention_variant_for's
    choice; gemm_variant names a GEMM variant, used by each GEMM it fits, see
    gemm_variant_for). With fuse_norms (wgmma, d_model up to 128), out_proj's epilogue
    writes norm2's rows and ffn_out's the next block's norm1 rows: five launches per block;
    the first norm1 and the final norm stay separate. With norm_prologue (see
    uses_norm_prologue), Q/K/V norms the fp32 residual rows itself (norm1) and ffn_in
    likewise (norm2), wherever that GEMM runs the plain schedule (no GEMM variant fits it):
    five launches per block and the final norm. With pdl, every launch is a programmatic
    dependent of the one before it (ops.ProgrammaticKernels). With staged_epilogue, the
    wgmma GEMMs that have it write through shared memory (ops.linear's staged, and
    build.LAYER_GEMM_VARIANT rather than build.UNSTAGED_GEMM_VARIANT). With short_norm_gemm,
    the fused residual-norm GEMMs of short reductions run ops.linear's short_norm. With
    context_hi_only, attention writes the context's hi half alone where out_proj reads
    nothing else (one product). With eight_lane_rows (and staged_epilogue), the staged
    residual and residual-norm epilogues take a row by eight lanes (ops.linear's staged 2).
    Where runs_whole_blocks says so (whole_block), a call launches the whole-block kernel
    once a block instead (_run_whole_blocks); where runs_after_attention says so
    (after_attention), three launches a block: Q/K/V, attention, and one kernel for the rest
    (_run_after_attention)."""

    def __init__(self, backend, config, state_dict, device, dtype, kernels, products: int,
                 wgmma: bool = False, fuse_norms: bool | None = False,
                 attention_variant: str | None = None, gemm_variant: str | None = None,
                 norm_prologue: bool | None = False, pdl: bool = False,
                 staged_epilogue: bool = False, short_norm_gemm: bool = False,
                 context_hi_only: bool = False, eight_lane_rows: bool = False,
                 whole_block: bool | None = False, after_attention: bool | None = False):
        super().__init__(backend, config, device, dtype)
        self.after_attention = after_attention  # see runs_after_attention
        self.whole_block = whole_block  # one launch a block: see runs_whole_blocks
        self.eight_lane_rows = eight_lane_rows  # staged fp32 epilogues eight lanes a row
        self.context_hi_only = context_hi_only  # no context lo half where none is read
        self.staged_epilogue = staged_epilogue  # GEMM epilogues through shared memory
        self.short_norm_gemm = short_norm_gemm  # residual-norm GEMMs two blocks an SM
        self.pdl = pdl  # each launch a programmatic dependent of the one before it
        self.kernels = ops.ProgrammaticKernels(kernels) if pdl else kernels
        self.products = products
        self.wgmma = wgmma
        self.attention_variant = attention_variant
        self.gemm_variant = None if gemm_variant is None else build.gemm_variant(gemm_variant)
        self.fuse_norms = fuses_norms(config, fuse_norms, wgmma, products, self.device)
        self.norm_prologue = uses_norm_prologue(config, norm_prologue, wgmma, self.fuse_norms)
        self.params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        self.weights = [{n: weight_pair(getattr(p, n)) for n in WEIGHTS}
                        for p in self.params.layers]
        self.ffn_in_biases = [padded_vector(p.ffn_in_bias) for p in self.params.layers]
        for p in self.params.layers:  # the fp16 pairs replace the fp32 matrices
            for n in WEIGHTS:
                setattr(p, n, None)
        self.chunks = ChunkPlan(device, lambda s: working_bytes_per_sequence(config, s), 0,
                                MAX_GRID_Y // config.num_heads)
        self.graphed = GraphedForward(self._forward)

    def gemm_variant_for(self, epilogue: str, products: int, weight, rows: int,
                         a=None) -> str | None:
        """The GEMM variant's name for a GEMM of this epilogue, product count, weight pair
        and row count where the wgmma GEMMs run, the module has its kernel, its tile is no
        wider than the output and its grid has a block for every SM, and (a TMA variant)
        tensor maps can describe the operand pair a's hi half and the weight's; else None
        (the plain schedule). The variant is the one named, or where none is,
        build.LAYER_GEMM_VARIANT (without staged_epilogue build.UNSTAGED_GEMM_VARIANT) on
        reductions of build.LAYER_TMA_MIN_K columns or more."""
        v = self.gemm_variant
        n, k = weight[0].shape[0], (a[0].shape[1] if a is not None else 0)
        if v is None and k >= build.LAYER_TMA_MIN_K:
            v = (build.LAYER_GEMM_VARIANT if self.staged_epilogue
                 else build.UNSTAGED_GEMM_VARIANT)
        fits = (v is not None and self.wgmma and n >= v.bn
                and build.gemm_variant_compiled(v, epilogue, products)
                and cdiv(rows, v.bm) * cdiv(n, v.bn) >= multiprocessor_count(self.device))
        if fits and v.tma:
            fits = (a is not None and tensor_maps.describable(a[0], v.bm)
                    and tensor_maps.describable(weight[0][:, :a[0].shape[1]], v.bn))
        return v.name if fits else None

    def gemm_options(self, epilogue: str, products: int, weight, rows: int, a) -> dict:
        """ops.linear's family and variant keywords for a GEMM of this epilogue, product
        count, weight pair, row count and A operand pair."""
        staged = (2 if self.eight_lane_rows else 1) if self.staged_epilogue else 0
        return {"wgmma": self.wgmma, "staged": staged, "short_norm": self.short_norm_gemm,
                "gemm_variant": self.gemm_variant_for(epilogue, products, weight, rows, a)}

    def attention_variant_for(self, seq_len: int) -> str | None:
        """The attention variant's name for sequences of seq_len tokens: the one named, else
        on the wgmma attention LONG_ATTENTION at head dim LONG_ATTENTION_HEAD_DIM from
        LONG_ATTENTION_MIN_KEYS tokens on, NARROW_ATTENTION at head dim
        NARROW_ATTENTION_HEAD_DIM, else None (the head dim's default)."""
        if self.attention_variant is not None or not self.wgmma:
            return self.attention_variant
        if (self.config.head_dim == LONG_ATTENTION_HEAD_DIM
                and seq_len >= LONG_ATTENTION_MIN_KEYS):
            return LONG_ATTENTION.name
        if self.config.head_dim == NARROW_ATTENTION_HEAD_DIM:
            return NARROW_ATTENTION.name
        return None

    def forward(self, x, valid_token_mask, out=None):
        """Run the kernels, through a CUDA graph once these input buffers repeat."""
        return self.graphed(x, valid_token_mask, out)

    def _forward(self, x, valid_token_mask, out=None):
        return forward_in_chunks(x, valid_token_mask, out, self.chunks, workspace(self.config),
                                 self._run)

    def _run(self, x2, masks, out2, batch, s, work):
        """The stack on one chunk of sequences (x2, out2: [tokens, d_model] views)."""
        cfg, k, products = self.config, self.kernels, self.products
        if self.runs_whole_blocks(batch, s):
            return self._run_whole_blocks(x2, masks, out2, batch, s, work)

        if self.runs_after_attention(batch, s):
            return self._run_after_attention(x2, masks, out2, batch, s, work)

        def gemm(epilogue: str, count: int, weight, a) -> dict:
            """The GEMM family and variant of one launch (count: its products, a: its A
            operand pair)."""
            return self.gemm_options(epilogue, count, weight, x2.shape[0], a)
        valid, info = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        res, qkv = work["residual"], work["qkv"]

        def normed_gemm(epilogue: str, count: int, weight, rows_in, x_in, norm):
            """(A operand, keywords) of the GEMM reading norm's rows of x_in: None and the
            prologue's inputs where the norm-prologue GEMM runs it, else rows_in (which the
            caller fills with layer_norm) and its family and variant."""
            kwargs = gemm(epilogue, count, weight, rows_in)
            if self.norm_prologue and kwargs["gemm_variant"] is None:
                return None, {**kwargs, "prologue_norm": (x_in, *norm)}
            return rows_in, kwargs

        def residual(a, weight, bias, res_in, zero_sum: bool, norm, norm_out) -> None:
            """res = res_in + a @ weight^T + bias (invalid rows kept, or zeroed with
            zero_sum); with norm (weight, bias), also its LayerNorm of res into norm_out."""
            epilogue = "residual" if norm is None else "residual_norm"
            ops.linear(k, a, weight, bias, epilogue, products, res=res_in, out=res,
                       valid_rows=valid_rows, zero_sum=zero_sum, norm=norm, norm_out=norm_out,
                       **gemm(epilogue, products, weight, a))
        rows = (work["rows_hi"], work["rows_lo"])
        hidden = (work["hidden_hi"], work["hidden_lo"])
        # norm2's rows: the pair past one product, the hi half alone at one (ffn_in's only)
        normed = rows if products > 1 else (rows[0], None)
        # the context: out_proj reads its hi half alone at one product
        context = (rows[0], None) if products == 1 and self.context_hi_only else rows
        src, target = float_rows(x2, out2, work["staging"])
        layers = list(zip(self.params.layers, self.weights, self.ffn_in_biases))
        for i, (p, w, ffn_in_bias) in enumerate(layers):
            a, kwargs = normed_gemm("half", 1, w["qkv_weight"], rows, src,
                                    (p.norm1_weight, p.norm1_bias))
            if a is not None and (i == 0 or not self.fuse_norms):
                ops.layer_norm(k, src, p.norm1_weight, p.norm1_bias, half=rows[0])
            ops.linear(k, a, w["qkv_weight"], p.qkv_bias, "half", 1, out_half=qkv, **kwargs)
            ops.attention(k, qkv, context, valid, info, batch=batch, seq_len=s,
                          num_heads=cfg.num_heads, head_dim=cfg.head_dim, causal=cfg.causal,
                          variant=self.attention_variant_for(s), wgmma=self.wgmma)
            # With fused norms, out_proj's epilogue writes norm2's rows over the context it
            # reads: safe, as each block holds whole rows (one block along N) and writes them
            # after its last read of A.
            norm2 = (p.norm2_weight, p.norm2_bias) if self.fuse_norms else None
            residual(rows, w["out_weight"], p.out_bias, src, False, norm2, normed)
            a, kwargs = normed_gemm("gelu_pair", products, w["ffn_in_weight"], rows, res,
                                    (p.norm2_weight, p.norm2_bias))
            if norm2 is None and a is not None:
                if products == 1:
                    ops.layer_norm(k, res, p.norm2_weight, p.norm2_bias, half=rows[0])
                else:
                    ops.layer_norm(k, res, p.norm2_weight, p.norm2_bias, pair=rows)
            # at one product ffn_out reads the hi half alone: the lo half is not written
            ops.linear(k, a, w["ffn_in_weight"], ffn_in_bias, "gelu_pair", products,
                       out_pair=hidden if products > 1 else (hidden[0], None), **kwargs)
            # ... and ffn_out's the next block's norm1 rows, read by Q/K/V: the hi half
            following = layers[i + 1][0] if i + 1 < len(layers) else None
            norm1 = (None if following is None or not self.fuse_norms
                     else (following.norm1_weight, following.norm1_bias))
            residual(hidden, w["ffn_out_weight"], p.ffn_out_bias, res, True, norm1,
                     (rows[0], None))
            src = res
        ops.layer_norm(k, src, self.params.final_weight, self.params.final_bias, out=target,
                       valid_rows=valid_rows)
        if target is not out2:
            out2.copy_(target)

    def runs_whole_blocks(self, batch: int, seq_len: int) -> bool:
        """Whether a call of batch sequences of seq_len tokens runs the whole-block kernel:
        never where it refuses the call (ops.whole_block_refusal) or with whole_block False;
        with True wherever it runs; with None on a CUDA device at d_model up to
        WHOLE_BLOCK_DEFAULT_MAX_WIDTH on a grid of at most one 64-row block a multiprocessor,
        or from WHOLE_BLOCK_MIN_SEQUENCES sequences at head dims from
        WHOLE_BLOCK_MIN_HEAD_DIM where the after-attention plan's default does not take the
        call (after_attention_by_default); never with after_attention True."""
        if self.whole_block is False or ops.whole_block_refusal(
                self.config, seq_len, self.products, self.device) is not None:
            return False
        if self.whole_block is None and self.after_attention:
            return False  # asked for by name: the default gives way
        if self.whole_block:
            return True
        cfg = self.config
        if self.device.type != "cuda":
            return False
        if (cfg.d_model <= WHOLE_BLOCK_DEFAULT_MAX_WIDTH
                and ops.whole_block_one_wave(batch, seq_len, multiprocessor_count(self.device))):
            return True
        if self.after_attention is None and after_attention_by_default(
                cfg, batch * seq_len, self.products, self.device):
            return False
        return (batch >= WHOLE_BLOCK_MIN_SEQUENCES
                and cfg.d_model // cfg.num_heads >= WHOLE_BLOCK_MIN_HEAD_DIM)

    def _run_whole_blocks(self, x2, masks, out2, batch, s, work):
        """The stack on one chunk, one whole-block launch a block (ops.whole_block), reading
        one residual buffer and writing the other; the last launch also writes the final
        norm, unless the output is the rows it reads (then a LayerNorm launch follows)."""
        cfg, k = self.config, self.kernels
        valid, info = masks
        src, target = float_rows(x2, out2, work["staging"])
        buffers = (work["residual"], work["residual_next"])
        final = (self.params.final_weight, self.params.final_bias)
        layers = list(zip(self.params.layers, self.weights, self.ffn_in_biases))
        fused_final = False
        rows = ops.whole_block_rows(batch, s, multiprocessor_count(self.device))
        for i, (p, w, ffn_in_bias) in enumerate(layers):
            fused_final = i + 1 == len(layers) and target.data_ptr() != src.data_ptr()
            ops.whole_block(k, src, buffers[i % 2], p, w, ffn_in_bias, valid, info,
                            batch=batch, seq_len=s, num_heads=cfg.num_heads, causal=cfg.causal,
                            rows=rows, final=final if fused_final else None,
                            final_out=target if fused_final else None)
            src = buffers[i % 2]
        if not fused_final:
            ops.layer_norm(k, src, *final, out=target,
                           valid_rows=None if valid is None else valid.reshape(-1))
        if target is not out2:
            out2.copy_(target)

    def runs_after_attention(self, batch: int, seq_len: int) -> bool:
        """Whether a call runs the after-attention plan (where the whole-block kernel does
        not run): never where its kernel refuses the config (ops.after_attention_refusal) or
        with after_attention False; with True wherever it runs; with None where
        after_attention_by_default says so."""
        if self.after_attention is None:  # the default checks the refusal itself
            return after_attention_by_default(self.config, batch * seq_len, self.products,
                                              self.device)
        return self.after_attention and ops.after_attention_refusal(
            self.config, self.products, self.device) is None

    def _run_after_attention(self, x2, masks, out2, batch, s, work):
        """The stack on one chunk, three launches a block: Q/K/V from norm1's fp16 rows,
        attention into the context's pair, then ops.after_attention (out_proj to the second
        residual, then the next block's norm1 over the context's hi half, or the final norm
        into the output); the first norm1 apart."""
        cfg, k = self.config, self.kernels
        valid, info = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        res, qkv = work["residual"], work["qkv"]
        rows = (work["rows_hi"], work["rows_lo"])
        src, target = float_rows(x2, out2, work["staging"])
        layers = list(zip(self.params.layers, self.weights, self.ffn_in_biases))
        per_block = ops.after_attention_rows(x2.shape[0], multiprocessor_count(self.device))
        ops.layer_norm(k, src, layers[0][0].norm1_weight, layers[0][0].norm1_bias,
                       half=rows[0])
        for i, (p, w, ffn_in_bias) in enumerate(layers):
            ops.linear(k, rows, w["qkv_weight"], p.qkv_bias, "half", 1, out_half=qkv,
                       **self.gemm_options("half", 1, w["qkv_weight"], x2.shape[0], rows))
            ops.attention(k, qkv, rows, valid, info, batch=batch, seq_len=s,
                          num_heads=cfg.num_heads, head_dim=cfg.head_dim, causal=cfg.causal,
                          variant=self.attention_variant_for(s), wgmma=self.wgmma)
            if i + 1 < len(layers):
                following = layers[i + 1][0]
                ops.after_attention(k, rows, src, res, p, w, ffn_in_bias, valid_rows,
                                    rows=per_block,
                                    norm=(following.norm1_weight, following.norm1_bias),
                                    norm_out=rows[0])
            else:
                ops.after_attention(k, rows, src, None, p, w, ffn_in_bias, valid_rows,
                                    rows=per_block,
                                    norm=(self.params.final_weight, self.params.final_bias),
                                    final_out=target)
            src = res
        if target is not out2:
            out2.copy_(target)
