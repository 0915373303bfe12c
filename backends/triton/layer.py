"""The Triton layer: packs weights, plans workspace, launches the kernels block by block."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from layerbench.common.cuda_host import (MAX_GRID_Y, ChunkPlan, mask_bytes, run_in_chunks,
                                         split_fp16)
from layerbench.common.errors import Unsupported
from layerbench.common.graphs import GraphedForward
from layerbench.common.interface import BuiltLayer
from layerbench.common.params import pack_params

from .attention import flash_attention, key_extent
from .linear import ZERO_SUM, ZERO_UPDATE, fused_linear, split_linear
from .narrow_block import (apart_attention_tiles, attention_ffn, block_config, fits,
                           heads_apart, norm_qkv, rows_apart)
from .norm import layer_norm
from .precision import MODES

# Attention has no split-operand kernel: "fp16x3" there would silently run plain fp16.
ATTENTION_MODES = tuple(m for m in MODES if m != "fp16x3")


@dataclass(frozen=True)
class Precision:
    """Matmul precision of the linear layers, of attention and of the Q/K/V projection
    (see precision.MODES; qkv None means as the other linears)."""

    linear: str = "fp16x3"
    attention: str = "fp16"
    qkv: str | None = None

    def __post_init__(self):
        """Refuse modes the kernels do not implement, before any layer is built."""
        if self.linear not in MODES:
            raise ValueError(f"linear precision must be one of {MODES}, not {self.linear!r}")
        if self.qkv is not None and self.qkv not in MODES:
            raise ValueError(f"qkv precision must be one of {MODES} or None, not {self.qkv!r}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention precision must be one of {ATTENTION_MODES}, not "
                             f"{self.attention!r}")

    @property
    def qkv_linear(self) -> str:
        """The precision mode of the Q/K/V projection."""
        return self.qkv or self.linear

    @property
    def qkv_products(self) -> int:
        """fp16 products per Q/K/V tile step in the narrow and wide plans (3, or 1 for fp16)."""
        return 1 if self.qkv_linear == "fp16" else 3

    @property
    def qkv_dtype(self) -> torch.dtype:
        """Storage of Q/K/V: fp16 when attention rounds its operands to fp16 anyway."""
        return torch.float16 if self.attention == "fp16" else torch.float32

    @property
    def activation_dtype(self) -> torch.dtype:
        """Storage of the context and FFN hidden rows: fp16 when the linears round to fp16."""
        return torch.float16 if self.linear == "fp16" else torch.float32


FP16_MAX = torch.finfo(torch.float16).max


def store_weight(w: torch.Tensor, mode: str, name: str = "weight"):
    """A weight matrix in the storage a GEMM of precision mode reads: an fp16 (hi, lo) pair
    for "fp16x3", fp16 for "fp16", else fp32. A matrix with an entry past fp16's range, which
    would be stored as inf, raises Unsupported."""
    if mode in ("fp16", "fp16x3"):
        largest = w.abs().max().item() if w.numel() else 0.0
        if largest > FP16_MAX:
            raise Unsupported(f"triton: {name} has an entry of magnitude {largest:.4g}, past "
                              f"fp16's range ({FP16_MAX:.0f}); its {mode} storage would hold "
                              "inf (use Precision('tf32x3', 'tf32x3') for fp32 weights)")
    if mode == "fp16x3":
        return split_fp16(w)
    return w.to(torch.float16 if mode == "fp16" else torch.float32).contiguous()


DEFAULT_PRECISION = Precision(qkv="fp16")  # bench/PERFORMANCE.md, #26


def plan(config, precision: Precision) -> str:
    """Which kernel sequence runs a block: "narrow" (whole rows in one tile: norm1 + Q/K/V,
    then one kernel from attention to the second residual), "wide" (pre-split fp16 operands
    for every GEMM), or "general" (the LayerNorm-fused GEMM in any precision mode)."""
    if (precision.linear != "fp16x3" or precision.attention not in ("fp16", "tf32x3")
            or precision.qkv_linear not in ("fp16x3", "fp16")):
        return "general"
    return "narrow" if fits(config.d_model, config.ffn_dim) else "wide"


def workspace(config, precision: Precision) -> dict[str, tuple[int, torch.dtype]]:
    """Per-token workspace buffers of the plan: name -> (columns, dtype)."""
    d, f = config.d_model, config.ffn_dim
    buffers = {"residual": (d, torch.float32), "qkv": (3 * d, precision.qkv_dtype)}
    kind = plan(config, precision)
    if kind == "narrow" and heads_apart():  # attention's output, two fp16 halves
        buffers.update(ctx_hi=(d, torch.float16), ctx_lo=(d, torch.float16))
    elif kind == "wide":  # the normed rows and the context share "rows"; two fp16 halves each
        buffers.update(rows_hi=(d, torch.float16), rows_lo=(d, torch.float16),
                       hidden_hi=(f, torch.float16), hidden_lo=(f, torch.float16))
    elif kind == "general":
        act = precision.activation_dtype
        buffers.update(ctx=(d, act), hidden=(f, act))
    return buffers


def working_bytes_per_sequence(config, precision: Precision) -> int:
    """Workspace bytes per sequence of the plan's buffers."""
    return config.seq_len * sum(c * t.itemsize for c, t in workspace(config, precision).values())


class TritonLayer(BuiltLayer):
    """Streams the batch in chunks that fit; each chunk runs plan()'s kernels block by block."""

    def __init__(self, backend, config, state_dict, device, dtype, precision: Precision):
        super().__init__(backend, config, device, dtype)
        self.precision = precision
        params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        # Each block's matrices are stored once, in the precision's storage (the fp32 copies
        # are dropped as each block is converted, so the weights stay within the memory plan).
        self.weights = []
        for i, p in enumerate(params.layers):
            self.weights.append(self._weights(p, i))
            params.layers[i] = replace(p, qkv_weight=None, out_weight=None,
                                       ffn_in_weight=None, ffn_out_weight=None)
        self.params = params
        # The attention grid's second dimension (sequences x heads) is at most MAX_GRID_Y.
        # Free memory is asked after the weights are packed: nothing fixed to add.
        self.chunks = ChunkPlan(
            device, lambda s: working_bytes_per_sequence(replace(config, seq_len=s), precision),
            0, MAX_GRID_Y // config.num_heads)
        self.graphed = GraphedForward(self._forward)

    def _weights(self, p, block: int) -> dict:
        """The four weight matrices, each in the storage of the mode its GEMM runs: Q/K/V in
        the general plan at precision.qkv_linear, every other (and Q/K/V in the narrow and
        wide plans, whose kernels read an (hi, lo) pair and use hi alone for one product) at
        precision.linear."""
        linear = self.precision.linear
        qkv = (self.precision.qkv_linear if plan(self.config, self.precision) == "general"
               else linear)
        modes = {"qkv_weight": qkv, "out_weight": linear, "ffn_in_weight": linear,
                 "ffn_out_weight": linear}
        return {n: store_weight(getattr(p, n), mode, f"block {block}'s {n}")
                for n, mode in modes.items()}

    def forward(self, x, valid_token_mask, out=None):
        """Run the kernels, through a CUDA graph once these input buffers repeat."""
        return self.graphed(x, valid_token_mask, out)

    def _forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        valid, key_end = mask_bytes(valid_token_mask), None
        if valid is not None:
            key_end = key_extent(valid, torch.empty(b, device=x.device, dtype=torch.int32))
        out = torch.empty_like(x) if out is None else out
        run = {"narrow": self._run_narrow, "wide": self._run_wide,
               "general": self._run_general}[plan(self.config, self.precision)]

        def run_chunk(b0, b1, x2, out2, work):
            masks = (None, None) if valid is None else (valid[b0:b1], key_end[b0:b1])
            run(x2, masks, out2, b1 - b0, s, work)
        run_in_chunks(x, out, self.chunks, workspace(self.config, self.precision),
                      run_chunk)
        return out

    def _run_narrow(self, x2, masks, out2, batch, s, work):
        """Per block: norm1 + Q/K/V, attention apart (a program per query block and head),
        then one kernel for the rest (and the final norm)."""
        res, qkv = work["residual"], work["qkv"]
        ctx = (work["ctx_hi"], work["ctx_lo"]) if "ctx_hi" in work else None
        valid, key_end = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        heads, causal = self.config.num_heads, self.config.causal
        src = x2
        last = len(self.params.layers) - 1
        rows = rows_apart(batch * s, x2.device) if ctx is not None else block_config().block_m
        for i, (p, w) in enumerate(zip(self.params.layers, self.weights)):
            norm_qkv(src, qkv, p, w, products=self.precision.qkv_products, block_m=rows)
            if ctx is not None:
                flash_attention(qkv, ctx, valid, key_end, batch=batch, seq_len=s,
                                num_heads=heads, precision=self.precision.attention,
                                config=apart_attention_tiles(rows), causal=causal)
            attention_ffn(
                qkv, src, out2 if i == last else res, valid_rows, key_end, p, w,
                final=(self.params.final_weight, self.params.final_bias) if i == last else None,
                batch=batch, seq_len=s, num_heads=heads, precision=self.precision.attention,
                ctx=ctx, block_m=rows, causal=causal)
            src = res

    def _run_wide(self, x2, masks, out2, batch, s, work):
        """Per block: LayerNorm to an fp16 pair, then GEMMs on pre-split operands."""
        res, qkv = work["residual"], work["qkv"]
        rows = (work["rows_hi"], work["rows_lo"])
        hidden = (work["hidden_hi"], work["hidden_lo"])
        valid, key_end = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        src = x2
        for p, w in zip(self.params.layers, self.weights):
            layer_norm(src, p.norm1_weight, p.norm1_bias, rows)
            split_linear(rows, w["qkv_weight"], p.qkv_bias, qkv,
                         products=self.precision.qkv_products)
            flash_attention(qkv, rows, valid, key_end, batch=batch, seq_len=s,
                            num_heads=self.config.num_heads, precision=self.precision.attention,
                            causal=self.config.causal)
            split_linear(rows, w["out_weight"], p.out_bias, res, residual=src,
                         zero_mode=ZERO_UPDATE, valid=valid_rows)
            layer_norm(res, p.norm2_weight, p.norm2_bias, rows)
            split_linear(rows, w["ffn_in_weight"], p.ffn_in_bias, hidden, gelu=True)
            split_linear(hidden, w["ffn_out_weight"], p.ffn_out_bias, res, residual=res,
                         zero_mode=ZERO_SUM, valid=valid_rows)
            src = res
        layer_norm(src, self.params.final_weight, self.params.final_bias, out2, valid_rows)

    def _run_general(self, x2, masks, out2, batch, s, work):
        """Per block: five kernels, every GEMM in the configured precision mode."""
        lin, att = self.precision.linear, self.precision.attention
        res, qkv, ctx, hidden = work["residual"], work["qkv"], work["ctx"], work["hidden"]
        valid, key_end = masks
        valid_rows = None if valid is None else valid.reshape(-1)
        src = x2
        for p, w in zip(self.params.layers, self.weights):
            fused_linear(src, w["qkv_weight"], p.qkv_bias, qkv,
                         precision=self.precision.qkv_linear,
                         ln=(p.norm1_weight, p.norm1_bias))
            flash_attention(qkv, ctx, valid, key_end, batch=batch, seq_len=s,
                            num_heads=self.config.num_heads, precision=att,
                            causal=self.config.causal)
            fused_linear(ctx, w["out_weight"], p.out_bias, res, precision=lin, residual=src,
                         zero_mode=ZERO_UPDATE, valid=valid_rows)
            fused_linear(res, w["ffn_in_weight"], p.ffn_in_bias, hidden, precision=lin,
                         ln=(p.norm2_weight, p.norm2_bias), gelu=True)
            fused_linear(hidden, w["ffn_out_weight"], p.ffn_out_bias, res, precision=lin,
                         residual=res, zero_mode=ZERO_SUM, valid=valid_rows)
            src = res
        layer_norm(src, self.params.final_weight, self.params.final_bias, out2, valid_rows)
