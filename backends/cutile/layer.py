"""The cuTile layer: packs the weights as fp16 pairs, plans the workspace, streams the batch
in chunks and launches per block five kernels where the LayerNorms fit the residual GEMMs'
epilogues, seven otherwise (four with fuse_ffn, one with fuse_block where the sequence fits
the whole-block kernel), replayed from a CUDA graph where it can."""
from __future__ import annotations

import torch

from layerbench.common.cuda_host import (MAX_GRID_Y, ChunkPlan, float_rows, forward_in_chunks,
                                         padded, padded_vector, weight_pair)
from layerbench.common.graphs import GraphedForward
from layerbench.common.interface import BuiltLayer
from layerbench.common.params import pack_params

from . import ops, specs
from .launch import ProgrammaticLaunches



def linear_products_for(d_model: int) -> int:
    """fp16 products of out_proj and the FFN: 1 (activations rounded to fp16) from d_model 512
    on, where the GEMMs are bound by the tensor cores; 3 (activations and weights split)
    below, where one product costs more of the contract's margin (shape 6 missed it)."""
    return 1 if d_model >= 512 else 3


def fusions(config, fuse_norms: bool, fuse_ffn: bool) -> tuple[bool, bool]:
    """(norms fused, FFN fused) for config: the LayerNorms run in the residual GEMMs'
    epilogues when asked for and rows fit one tile; the FFN in one kernel when asked for
    and the norms are fused."""
    norms = fuse_norms and ops.norm_gemm_width(config.d_model) is not None
    return norms, norms and fuse_ffn


def workspace(config, fuse_norms: bool = False, fuse_ffn: bool = False,
              fuse_block: bool = False) -> dict[str, tuple[int, torch.dtype]]:
    """Per-token workspace buffers: name -> (columns, dtype). "rows" holds the normed rows,
    then the context, as an fp16 (hi, lo) pair; "hidden" the FFN's hidden rows likewise,
    padded to a multiple of 8 columns (GELU(0) = 0 in the padding), unless fuse_ffn keeps
    them on chip; with fuse_norms, "normed" holds norm2's rows (out_proj writes them while
    it still reads the context); with fuse_block, "shadow" is the residual's other half for
    the whole-block kernel, which reads one and writes the other."""
    d, f = config.d_model, padded(config.ffn_dim)
    buffers = {"residual": (d, torch.float32), "staging": (d, torch.float32),
               "qkv": (3 * d, torch.float16),
               "rows_hi": (d, torch.float16), "rows_lo": (d, torch.float16)}
    if not fuse_ffn:
        buffers.update(hidden_hi=(f, torch.float16), hidden_lo=(f, torch.float16))
    if fuse_norms:
        buffers.update(normed_hi=(d, torch.float16), normed_lo=(d, torch.float16))
    if fuse_block:
        buffers["shadow"] = (d, torch.float32)
    return buffers


def working_bytes_per_sequence(config, seq_len: int | None = None, fuse_norms: bool = False,
                               fuse_ffn: bool = False, fuse_block: bool = False) -> int:
    """Workspace bytes of one sequence (of seq_len tokens, default the config's)."""
    buffers = workspace(config, fuse_norms, fuse_ffn, fuse_block).values()
    per_token = sum(c * t.itemsize for c, t in buffers)
    return (config.seq_len if seq_len is None else seq_len) * per_token


class CutileLayer(BuiltLayer):
    """Per block: norm1, Q/K/V (one fp16 product), attention, out_proj + residual, norm2,
    ffn_in + GELU, ffn_out + residual; the final norm into the output. With fuse_norms
    (rows up to 128 wide), out_proj's epilogue writes norm2 and ffn_out's the next block's
    norm1 or the final norm: five launches per block instead of seven. With fuse_ffn too,
    one kernel runs the whole FFN (ffn_residual_norm): four launches per block. With
    lean_pairs, rows only a one-product GEMM reads (norm1's always, norm2's and the hidden
    rows' at one product) are written as their fp16 hi half alone. With pdl, each kernel is
    launched to start while the one before it finishes (launch.ProgrammaticLaunches). With
    fuse_block, where the sequence fits the whole-block kernel (specs.block_constants) and
    the launcher has it, one launch per block runs it all (block_narrow)."""

    def __init__(self, backend, config, state_dict, device, dtype, kernels, products: int,
                 fuse_norms: bool, fuse_ffn: bool, lean_pairs: bool = False, pdl: bool = False,
                 fuse_block: bool = False):
        super().__init__(backend, config, device, dtype)
        self.pdl = pdl
        self.fuse_block = fuse_block
        self.kernels = ProgrammaticLaunches(kernels) if pdl else kernels
        self.products = products
        self.lean_pairs = lean_pairs
        self.fuse_norms, self.fuse_ffn = fusions(config, fuse_norms, fuse_ffn)
        self.params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        names = ("qkv_weight", "out_weight", "ffn_in_weight", "ffn_out_weight")
        self.weights = [{n: weight_pair(getattr(p, n)) for n in names}
                        for p in self.params.layers]
        self.ffn_in_biases = [padded_vector(p.ffn_in_bias) for p in self.params.layers]
        for p in self.params.layers:  # the fp16 pairs replace the fp32 matrices
            for n in names:
                setattr(p, n, None)
        # Free memory is asked after the weights are packed: nothing fixed to add. (At 112 or
        # more workspace bytes per token, the rows of a chunk stay far below 2^31.)
        self.chunks = ChunkPlan(
            device,
            lambda s: working_bytes_per_sequence(config, s, self.fuse_norms, self.fuse_ffn,
                                                 self._whole_blocks(s)),
            0, MAX_GRID_Y // config.num_heads)
        self.graphed = GraphedForward(self._forward)

    def forward(self, x, valid_token_mask, out=None):
        """Run the kernels, through a CUDA graph once these input buffers repeat."""
        return self.graphed(x, valid_token_mask, out)

    def _forward(self, x, valid_token_mask, out=None):
        # The shadow half of the residual only where the whole-block kernel runs this length.
        blocks = self._whole_blocks(x.shape[1])
        return forward_in_chunks(
            x, valid_token_mask, out, self.chunks,
            workspace(self.config, self.fuse_norms, self.fuse_ffn, blocks), self._run)

    def _run(self, x2, masks, out2, batch, s, work):
        """The stack on one chunk of sequences (x2, out2: [tokens, d_model] views)."""
        cfg, k = self.config, self.kernels
        d, h = cfg.d_model, cfg.num_heads
        valid, info = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        res, staging, qkv = work["residual"], work["staging"], work["qkv"]
        rows = (work["rows_hi"], work["rows_lo"])
        hidden = None if self.fuse_ffn else (work["hidden_hi"], work["hidden_lo"])
        heads = [t.view(batch, s, h, d // h) for t in rows]
        qkv_heads = qkv.view(batch, s, 3 * h, d // h)
        src, target = float_rows(x2, out2, staging)
        direct = target is out2
        layers = list(zip(self.params.layers, self.weights, self.ffn_in_biases))
        final = (self.params.final_weight, self.params.final_bias)
        if self._whole_blocks(s):
            self._run_blocks(src, valid, target, layers, final, batch, s, work)
            if not direct:
                out2.copy_(staging)
            return
        for i, (p, w, ffn_in_bias) in enumerate(layers):
            if i == 0 or not self.fuse_norms:
                self._norm(src, p.norm1_weight, p.norm1_bias, rows, hi_only=self.lean_pairs)
            ops.linear_half(k, rows, w["qkv_weight"], p.qkv_bias, qkv)
            ops.attention(k, qkv_heads, heads, valid, info, num_heads=h, causal=cfg.causal)
            if self.fuse_norms:
                normed = (work["normed_hi"], work["normed_lo"])
                ops.linear_residual_norm(k, rows, w["out_weight"], p.out_bias, src, valid_rows,
                                         res, (p.norm2_weight, p.norm2_bias), pair=normed,
                                         products=self.products, zero_sum=False)
                last = i == len(layers) - 1
                norm = final if last else (layers[i + 1][0].norm1_weight,
                                           layers[i + 1][0].norm1_bias)
                written = {"pair": None if last else rows, "final": target if last else None}
                if self.fuse_ffn:
                    ops.ffn_residual_norm(k, normed, (w["ffn_in_weight"], ffn_in_bias),
                                          (w["ffn_out_weight"], p.ffn_out_bias), res,
                                          valid_rows, res, norm, products=self.products,
                                          **written)
                else:
                    ops.linear_gelu(k, normed, w["ffn_in_weight"], ffn_in_bias, hidden,
                                    self.products)
                    ops.linear_residual_norm(k, hidden, w["ffn_out_weight"], p.ffn_out_bias,
                                             res, valid_rows, res, norm, products=self.products,
                                             zero_sum=True, **written)
            else:
                ops.linear_residual(k, rows, w["out_weight"], p.out_bias, src, valid_rows,
                                    res, self.products, zero_sum=False)
                lean = self.lean_pairs and self.products == 1
                self._norm(res, p.norm2_weight, p.norm2_bias, rows, hi_only=lean)
                if lean:
                    ops.linear_gelu_half(k, rows, w["ffn_in_weight"], ffn_in_bias, hidden[0],
                                         self.products)
                else:
                    ops.linear_gelu(k, rows, w["ffn_in_weight"], ffn_in_bias, hidden,
                                    self.products)
                ops.linear_residual(k, hidden, w["ffn_out_weight"], p.ffn_out_bias, res,
                                    valid_rows, res, self.products, zero_sum=True)
            src = res
        if not self.fuse_norms:
            ops.layer_norm_out(k, src, *final, valid_rows, target)
        if not direct:
            out2.copy_(staging)

    def _whole_blocks(self, seq_len: int) -> bool:
        """Whether fuse_block applies to sequences of seq_len: they fit the whole-block kernel
        and the launcher has it."""
        cfg = self.config
        constants = specs.block_constants(seq_len, cfg.d_model, cfg.num_heads, cfg.ffn_dim,
                                          self.products)
        return (self.fuse_block and constants is not None
                and self.kernels.has(specs.block_kernel(constants), constants))

    def _run_blocks(self, src, valid, target, layers, final, batch, s, work) -> None:
        """One block_narrow launch per block, from src through the residual and its shadow
        (a kernel reads one, writes the other) into target with the final norm."""
        cfg = self.config
        halves = (work["residual"], work["shadow"])
        x = src
        for i, (p, w, ffn_in_bias) in enumerate(layers):
            last = i == len(layers) - 1
            dst = target if last and target.data_ptr() != x.data_ptr() else halves[i % 2]
            ops.block_narrow(self.kernels, x.view(batch, s, -1), dst.view(batch, s, -1), valid,
                             p, w, ffn_in_bias, final if last else None,
                             num_heads=cfg.num_heads, causal=cfg.causal,
                             products=self.products)
            x = dst
        if x.data_ptr() != target.data_ptr():
            target.copy_(x)

    def _norm(self, x, weight, bias, rows, hi_only: bool) -> None:
        """LayerNorm of x into rows: the fp16 pair, or its hi half alone (hi_only)."""
        if hi_only:
            ops.layer_norm_half(self.kernels, x, weight, bias, rows[0])
        else:
            ops.layer_norm_split(self.kernels, x, weight, bias, *rows)
