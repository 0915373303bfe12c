"""wmma: the whole stack in CUDA C++ on nvcuda::wmma tensor-core fragments, compiled just in
time (split fp16 linears, register-resident flash attention, fp32 LayerNorm/softmax/residual)."""
from __future__ import annotations

import torch

from layerbench.common.cuda_host import capability_shortfall, max_shared_memory_per_block
from layerbench.common.errors import Unsupported
from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan

from . import block, build
from .attention import max_seq_len, shared_memory_refusal, supported_head_dim
from .layer import (Plan, WmmaLayer, plan_products, qkv_products_for, weight_bytes,
                    working_bytes_per_sequence)
from .tiles import GEMM_TILES, choose_tiles, replaces_stream_tile


PROGRAMMATIC_CAPABILITY = (9, 0)  # griddepcontrol: programmatic dependent launch


class WmmaBackend(Backend):
    """The stack in CUDA C++ kernels on wmma fragments (see Plan for the fused kernels),
    replayed as one CUDA graph where the input allows."""

    name = "wmma"
    summary = "CUDA C++ on nvcuda::wmma: split-fp16 linears, flash attention, CUDA graph"
    capabilities = Capabilities(
        devices=("cuda",),
        head_dims=tuple(range(8, 257, 8)),
        notes="JIT-built with nvcc (sm_80+); fp32 residual stream; fp16/bf16 computed in fp32; "
              "attention in registers where a fragment-layout probe passes, else through "
              "shared memory",
    )

    def __init__(self, fuse_qkv: bool = False, fuse_ffn: bool | None = None,
                 linear_products: int | None = None, fuse_norms: bool = True,
                 stream_tile: str | None = None, norm_in_registers: bool = True,
                 pdl: bool | None = None, persistent_gemm: bool = False):
        # norm_qkv is off by default: on an H200 the separate kernels run every official
        # shape faster (shape 2: 0.177 ms unfused, 0.211 with norm_qkv).
        self.fuse_qkv = fuse_qkv  # norm_qkv where d_model allows (see Plan)
        # ffn_block where whole rows fit its tile: True always, None (the default) on calls
        # whose rows it runs faster (layer.ffn_block_pays), False never
        self.fuse_ffn = fuse_ffn
        if linear_products not in (None, 1, 2, 3):
            raise ValueError(f"linear_products must be 1, 2, 3 or None, not {linear_products}")
        # fp16 products of out_proj and the FFN in every call; None: linear_products_for
        # (d_model), and large_call_products_for(d_model) in forwards of many tokens, or
        # three in stacks of more than four blocks (layer.plan_products)
        self.linear_products = linear_products
        # LayerNorms in the residual GEMMs' epilogues where a tile holds whole rows (see Plan
        # and choose_tiles, which takes them only where such tiles fill the SMs).
        self.fuse_norms = fuse_norms
        # The stream GEMM variant (a GEMM_TILES name) of the linears with K <= 128 whose
        # rows give each SM two 128x128 tiles; any stream variant holding 128 columns, or
        # None (the default): tiles.long_stream_tile's rule by product count.
        names = [v.name for v in GEMM_TILES]
        choices = [name for t, name in enumerate(names) if replaces_stream_tile(t)]
        if stream_tile is not None and stream_tile not in choices:
            raise ValueError(f"stream_tile must be one of {choices} or None, not "
                             f"{stream_tile!r}")
        self.stream_tile = None if stream_tile is None else names.index(stream_tile)
        # norm_split reading each row once into registers where the row and pointers allow
        # (norm.norm_split; H100, shape 8: 2.409 ms against 2.471)
        self.norm_in_registers = norm_in_registers
        # programmatic dependent launches (Plan.pdl): None (the default) on from sm_90, True
        # requires sm_90, False launches each kernel after the one before it has finished
        self.pdl = pdl
        # the linears with K > 128 on the persistent pipelined tile (Plan); not yet timed
        self.persistent_gemm = persistent_gemm

    def unavailable_reason(self, device):
        """A CUDA toolkit must be found, the device must have compute capability 8.0+, and
        the toolkit's nvcc must compile for it."""
        if build.cuda_home() is None:
            return build.toolkit_missing()
        return capability_shortfall(device) or (
            build.arch_unsupported(device)
            if device.type == "cuda" and torch.cuda.is_available() else None)

    def memory_plan(self, config, dtype):
        """One sequence's workspace (the layer streams the batch; the largest plan's) plus the
        packed weights."""
        return MemoryPlan({"one sequence": working_bytes_per_sequence(config),
                           PARAMETERS: weight_bytes(config)})

    def check(self, config, device, dtype, *, built=False):
        """The shapes the kernels take, then the interface's checks."""
        if not supported_head_dim(config.head_dim):
            raise Unsupported(f"wmma: head dim {config.head_dim} is not a multiple of 8 in "
                              "8..256")
        if config.ffn_dim % 8:
            raise Unsupported(f"wmma: ffn_dim {config.ffn_dim} is not a multiple of 8")
        if config.seq_len > max_seq_len():
            raise Unsupported(f"wmma: seq_len {config.seq_len} exceeds {max_seq_len()}")
        super().check(config, device, dtype, built=built)
        if self.pdl:
            short = capability_shortfall(torch.device(device), PROGRAMMATIC_CAPABILITY)
            if short:
                raise Unsupported(f"wmma: pdl (programmatic dependent launch, sm_90): {short}")

    def _build(self, config, state_dict, device, dtype):
        ext = build.load(device)
        block_n = choose_tiles(1, config.d_model, config.ffn_dim, config.head_dim,
                               1).attention_block_n
        limit = max_shared_memory_per_block(device)
        refusal = shared_memory_refusal(ext, device, config.head_dim, block_n)
        if refusal:
            raise Unsupported(f"wmma: {refusal}")
        products, large = plan_products(config, self.linear_products)
        fuse_ffn = (self.fuse_ffn is not False
                    and block.fits(config.d_model, config.ffn_dim, products)
                    and (limit is None
                         or block.shared_bytes(ext, config.d_model, config.ffn_dim) <= limit))
        programmatic = not capability_shortfall(torch.device(device), PROGRAMMATIC_CAPABILITY)
        qkv_products = qkv_products_for(config)
        plan = Plan(self.fuse_qkv and config.d_model <= block.MAX_QKV_WIDTH and qkv_products == 1,
                    fuse_ffn,
                    products, self.fuse_norms, ffn_auto=self.fuse_ffn is None,
                    large_call_products=large, stream_tile=self.stream_tile,
                    norm_in_registers=self.norm_in_registers,
                    pdl=programmatic if self.pdl is None else self.pdl,
                    persistent_gemm=self.persistent_gemm, qkv_products=qkv_products)
        return WmmaLayer(self, config, state_dict, device, dtype, ext, plan)
