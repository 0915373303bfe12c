"""cupy: the whole stack as CUDA C++ compiled at run time by NVRTC through cupy.RawModule, on
PTX-level tensor-core instructions (mma.sync, ldmatrix, cp.async)."""
from __future__ import annotations

from layerbench.common.cuda_host import capability_shortfall
from layerbench.common.errors import Unsupported
from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import param_bytes
from layerbench.common.precision import default_products, one_product_qkv_refusal

from . import build
from .layer import CupyLayer, linear_products_for, working_bytes_per_sequence

HEAD_DIMS = tuple(range(8, 257, 8))


class CupyBackend(Backend):
    """The stack in NVRTC-compiled kernels: LayerNorm, split-fp16 GEMMs with fused epilogues
    and flash attention on wgmma (sm_90, the default there) or mma.sync; replayed as one CUDA
    graph where the input allows.

    linear_products: fp16 products of out_proj and the FFN (1: activations and weights
    rounded to fp16; 2: activations split into fp16 pairs, weights rounded; 3: both split;
    default 1 from d_model 512 on, 3 below, and 3 in stacks of more than four blocks:
    common.precision.default_products). wgmma: the GEMMs and attention (head dims up
    to 256) on Hopper's wgmma.mma_async; None
    (default) uses it wherever the device and compiled module allow (sm_90), True requires
    it, False keeps mma.sync. fuse_norms: the
    LayerNorms in the residual GEMMs' epilogues (out_proj writes norm2's rows, ffn_out the
    next block's norm1 rows: five launches per block instead of seven) where the wgmma GEMMs
    run and d_model is at most 128; elsewhere the plan is unchanged. None (default): where
    the fused grid loses no parallelism (see layer.fuses_norms); True: wherever it applies.
    gemm_variant: a variant of the wgmma GEMMs by name (build.GEMM_VARIANTS): "wgmma 128x128"
    (the default schedule on 128x128 tiles), "wgmma 128x128 wait1 4-stage" (each K tile's
    wgmma group left running over the next tile's barrier and copies), "wgmma 128x256
    wait1" (the same on 128x256 tiles), "wgmma 128x256 warp-specialised" / "wgmma 128x128
    warp-specialised 6-stage" (a producer warpgroup's copies handed to two consumer
    warpgroups through mbarriers), or "wgmma 128x256 TMA" / "wgmma 128x128 TMA 6-stage" (the
    same consumers fed by TMA tensor copies from one thread; only where tensor maps can
    describe both operands), "wgmma 128x128 TMA 2/SM" (the same at two blocks an SM) or
    "wgmma 128x128 TMA 2/SM persistent" (two blocks an SM in all, each taking output tiles
    in turn, the next tile's copies under this tile's epilogue) or "wgmma 128x128 TMA 2/SM
    staged epilogue" (two blocks an SM, the epilogue through shared memory a warp a row). A
    GEMM runs it where the module has it for the GEMM's epilogue and product count (the
    non-default ones: half, gelu_pair and residual at one product, so every GEMM from
    d_model 512, Q/K/V alone below), the output is at least one tile wide and the grid has a
    block for every SM; the other GEMMs keep the plain schedule. Needs the wgmma GEMMs.
    None (default): "wgmma 128x128 TMA 2/SM staged epilogue" ("wgmma 128x128 TMA 2/SM" with
    staged_epilogue=False) where it fits on reductions of 512 columns or more, elsewhere the
    plain schedule, its tile picked per GEMM (layer.gemm_variant_for).
    attention_variant: a variant of the wgmma attention kernel by name
    (build.ATTENTION_WGMMA; None: "wgmma 192x128 TMA overlap" at head dim 64 from 4096
    tokens (layer.LONG_ATTENTION), "wgmma 128x64 TMA 2/SM" at head dim 32 exactly
    (layer.NARROW_ATTENTION),
    "wgmma 128x64 2/SM" at other head dims up to 64 and shorter sequences, "wgmma 128x128"
    above up to 128, "wgmma 128x64" above up to 256); needs the wgmma attention (sm_90, head
    dims up to 256).
    norm_prologue: norm1 and norm2 in the prologues of the GEMMs that read their rows (Q/K/V
    and ffn_in norm their own rows of the fp32 residual stream into shared memory, bit for
    bit as the LayerNorm kernel: five launches per block instead of seven) where the wgmma
    GEMMs run, d_model is at most 128 and the norms are not fused into the residual GEMMs
    (fuse_norms wins where both apply), on each of the two GEMMs that runs the plain
    schedule; elsewhere the plan is unchanged. None or False (default): off (slower on the
    H200: bench/PERFORMANCE.md K24).
    pdl: programmatic dependent launch: each kernel may begin launching while the one before
    it runs, and waits for it before touching memory (griddepcontrol; through the driver's
    cuLaunchKernelEx), also inside the replayed CUDA graph. None (default): on from sm_90;
    True requires it; False launches each kernel after the one before it has finished.
    staged_epilogue: the wgmma GEMMs' epilogues through shared memory, so that a warp reads
    and writes whole rows (the plain schedule's 128 x 128 kernels, and "wgmma 128x128 TMA
    2/SM staged epilogue" in place of "wgmma 128x128 TMA 2/SM" where no variant is named);
    the plain kernels' residual and residual-norm epilogues run eight lanes a row by default
    (eight_lane_rows, on by default) and a warp a row with it off; the same values
    (residual_norm's row statistics but for their order of summation). None (default) or
    True: on where the wgmma GEMMs run; False: off.
    short_norm_gemm: the fused residual-norm GEMMs (fuse_norms) of reductions up to 128
    columns on 64 x 128 tiles with both K tiles resident (two stages, 97 KiB at three
    products), so that two blocks share an SM, their epilogues staged. None or False
    (default): off (slower on the H200: bench/PERFORMANCE.md K33); True: where it applies.
    context_hi_only: at one product (out_proj reads the context's hi half alone), attention
    writes the hi half alone (bench/PERFORMANCE.md K34). None (default) or True: on; False:
    both halves.
    eight_lane_rows: the staged residual and residual-norm epilogues (staged_epilogue) take
    a row by eight lanes, four rows a warp instruction, with 3-level butterflies for the
    norm's sums, instead of a warp a row (the same values; residual_norm's row statistics
    summed in another order). None (default) or True: on where the staged epilogue runs;
    False: a warp a row (slower on the H200: bench/PERFORMANCE.md K40).
    whole_block: one launch a Transformer block (whole_block.cu: norm1, Q/K/V, attention,
    out_proj, norm2 and the FFN of 64 query rows a block, or of a whole sequence where
    64-row blocks would take more than one wave (ops.whole_block_rows); mma.sync, the rows
    in registers between products; the final norm in the last launch) on calls whose
    sequences it holds (up to 128 tokens, three products, d_model and FFN width it is
    compiled for: ops.whole_block_refusal); elsewhere the plan above. None (default): where
    it runs, at d_model up to 32 on one wave of 64-row blocks, and from 64 sequences at head
    dims from 16 (layer.runs_whole_blocks; bench/PERFORMANCE.md K41, K43); True: wherever it
    runs; False: off.
    after_attention: three launches a block (Q/K/V, attention, and after_attention.cu for
    out_proj, its residual, norm2, the FFN, its residual and the next block's norm1 or the
    final norm, 16, 32 or 64 rows a block, four warps sharing each 16 rows' columns; three
    fp16 products on mma.sync, the FFN's hidden rows in shared memory) where the whole-block
    kernel does not run and the kernel is compiled for the widths
    (ops.after_attention_refusal). None (default): from d_model 64 where its 64-row blocks
    make one wave (layer.after_attention_by_default; bench/PERFORMANCE.md K47), before the
    whole-block kernel's default; True: wherever it runs, before the whole-block kernel's
    default; False: off.
    """

    name = "cupy"
    summary = ("CuPy RawModule (NVRTC): wgmma (sm_90) or mma.sync GEMMs and flash attention, "
               "programmatic launches (sm_90), CUDA graph")
    capabilities = Capabilities(
        devices=("cuda",), head_dims=HEAD_DIMS,
        notes="sm_80+; fp32 residual stream; kernels compiled at run time by NVRTC")

    def __init__(self, linear_products: int | None = None, wgmma: bool | None = None,
                 fuse_norms: bool | None = None, attention_variant: str | None = None,
                 gemm_variant: str | None = None, norm_prologue: bool | None = None,
                 pdl: bool | None = None, staged_epilogue: bool | None = None,
                 short_norm_gemm: bool | None = None, context_hi_only: bool | None = None,
                 eight_lane_rows: bool | None = None, whole_block: bool | None = None,
                 after_attention: bool | None = None):
        if linear_products not in (None, 1, 2, 3):
            raise ValueError(f"cupy linear_products must be 1, 2 or 3, not {linear_products}")
        names = build.attention_variant_names()
        if attention_variant is not None and attention_variant not in names:
            raise ValueError(f"cupy attention_variant must be one of {names}, not "
                             f"{attention_variant!r}")
        gemm_names = build.gemm_variant_names()
        if gemm_variant is not None and gemm_variant not in gemm_names:
            raise ValueError(f"cupy gemm_variant must be one of {gemm_names}, not "
                             f"{gemm_variant!r}")
        self.linear_products = linear_products
        self.wgmma = wgmma
        self.fuse_norms = fuse_norms
        self.attention_variant = attention_variant
        self.gemm_variant = gemm_variant
        self.norm_prologue = norm_prologue
        self.pdl = pdl
        self.staged_epilogue = staged_epilogue
        self.short_norm_gemm = short_norm_gemm
        self.context_hi_only = context_hi_only
        self.eight_lane_rows = eight_lane_rows
        self.whole_block = whole_block
        self.after_attention = after_attention

    def unavailable_reason(self, device):
        """CuPy must import, the CUDA headers must be found, and the device must have compute
        capability 8.0 or newer."""
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            return f"CuPy is not installed ({exc}); pip install '.[cupy]'"
        try:
            build.cuda_include()
        except Unsupported as exc:
            return str(exc)
        return capability_shortfall(device)

    def check(self, config, device, dtype, *, built=False):
        """The interface's checks, after the depth its one-product Q/K/V keeps the contract to."""
        refusal = one_product_qkv_refusal(config)
        if refusal:
            raise Unsupported(f"{self.name}: {refusal}")
        super().check(config, device, dtype, built=built)

    def memory_plan(self, config, dtype):
        """One sequence's workspace (the layer streams the batch) plus the packed weights."""
        return MemoryPlan({"one sequence": working_bytes_per_sequence(config),
                           PARAMETERS: param_bytes(config)})

    def _build(self, config, state_dict, device, dtype):
        from .ops import kernels_for, wgmma_attention_pad

        products = self.linear_products or default_products(
            config, linear_products_for(config.d_model))
        kernels = kernels_for(device)
        if self.wgmma and not kernels.has_wgmma:
            raise Unsupported(f"{self.name}: wgmma needs an sm_90 device, not sm_{kernels.arch}")
        if self.wgmma and kernels.wgmma_problem:
            raise Unsupported(f"{self.name}: {kernels.wgmma_problem}")
        wgmma = self.wgmma
        if wgmma is None:
            wgmma = kernels.has_wgmma and not kernels.wgmma_problem
        variant = self.attention_variant
        if variant is not None:
            wide = wgmma_attention_pad(config.head_dim)
            if not (wgmma and wide):
                raise Unsupported(f"{self.name}: attention_variant {variant!r} needs the wgmma "
                                  f"attention kernel (sm_90, head dim up to 256)")
            try:
                build.attention_variant(wide, variant, config.head_dim)
            except ValueError as exc:
                raise Unsupported(f"{self.name}: {exc}") from exc
        if self.gemm_variant is not None and not wgmma:
            raise Unsupported(f"{self.name}: gemm_variant {self.gemm_variant!r} needs the wgmma "
                              "GEMMs (sm_90)")
        pdl = self.pdl
        if pdl and kernels.programmatic_problem:
            raise Unsupported(f"{self.name}: pdl: {kernels.programmatic_problem}")
        if pdl is None:
            pdl = kernels.programmatic_problem is None
        return CupyLayer(self, config, state_dict, device, dtype, kernels, products,
                         wgmma=wgmma, fuse_norms=self.fuse_norms, attention_variant=variant,
                         gemm_variant=self.gemm_variant, norm_prologue=self.norm_prologue,
                         pdl=pdl, staged_epilogue=self.staged_epilogue is not False,
                         short_norm_gemm=bool(self.short_norm_gemm),
                         context_hi_only=self.context_hi_only is not False,
                         eight_lane_rows=self.eight_lane_rows is not False,
                         whole_block=self.whole_block, after_attention=self.after_attention)
