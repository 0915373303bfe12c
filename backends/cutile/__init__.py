"""cutile: the whole stack in NVIDIA's CUDA tile model (cuda.tile), compiled by tileiras and
launched through cuda-python, either from an exported build or just in time."""
from __future__ import annotations

from layerbench.common.errors import Unsupported
from layerbench.common.interface import Backend, Capabilities
from layerbench.common.memory import PARAMETERS, MemoryPlan
from layerbench.common.params import param_bytes
from layerbench.common.precision import default_products, one_product_qkv_refusal

from . import specs
from .launch import cuda_device, kernels_for
from .layer import CutileLayer, fusions, linear_products_for, working_bytes_per_sequence

HEAD_DIMS = tuple(range(8, 257, 8))


def programmatic_refusal(device, kernels) -> str | None:
    """Why the layer cannot launch its kernels as programmatic dependents on device with
    kernels, or None: the device must be sm_90 or later and the launcher able to (an older
    cuda.core cannot: launch.programmatic_launch_problem)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "pdl needs sm_90 or later (programmatic dependent launch)"
    why = getattr(kernels, "programmatic_problem", None)
    return None if why is None else f"pdl cannot launch here: {why}"


class CutileBackend(Backend):
    """The stack in cuTile kernels: LayerNorm to fp16 pairs, split-fp16 GEMMs with fused
    epilogues, flash attention; replayed as one CUDA graph where the input allows.

    mode: "aot" (cubins exported by `python -m layerbench.backends.cutile.export`), "jit"
    (ct.launch; needs cuda-tile[tileiras]) or "auto" (a build of these sources for the
    device's architecture if there is one, else the JIT). linear_products: fp16 products of
    out_proj and the FFN (1 or 3; default 1 from d_model 512 on, 3 below, and 3 in stacks
    of more than four blocks: common.precision.default_products; 2 needs a build exported
    with --sweep). fuse_norms: LayerNorms in the residual GEMMs' epilogues where
    rows are at most 128 wide (5 launches per block instead of 7; measured 1-17% faster on
    the official shapes it applies to). fuse_ffn: with fused norms, the whole FFN in one
    kernel, its hidden rows kept on chip (4 launches per block; off: slower on 10 of the 11
    official shapes it applies to). lean_pairs: LayerNorm and GELU rows that only a
    one-product GEMM reads are written as one fp16 array, without the low half (on: 3%
    faster at d_model 1024, no change where the FFN takes three products). pdl: each kernel
    is launched to start while the one before it finishes (programmatic dependent launch);
    None (default) where the device has it (sm_90 on), True requires it. fuse_block: where
    sequences fit (specs.block_constants: up to 128 rows, d_model and ffn_dim up to 128,
    power-of-two head dims of at least 8), one kernel runs each whole
    block; None (default) where the launcher has that kernel, the separate kernels
    elsewhere; True refuses a build without the kernel for the config's own length.
    """

    name = "cutile"
    summary = "cuTile (cuda.tile): LayerNorm, split-fp16 GEMMs, flash attention, CUDA graph"
    capabilities = Capabilities(
        devices=("cuda",), head_dims=HEAD_DIMS,
        notes=f"d_model up to {specs.MAX_ROW_WIDTH}; fp32 residual stream; runs exported "
              "cubins (aot) or compiles with ct.launch (jit)")

    def __init__(self, mode: str = "auto", linear_products: int | None = None,
                 fuse_norms: bool = True, fuse_ffn: bool = False, lean_pairs: bool = True,
                 pdl: bool | None = None, fuse_block: bool | None = None):
        built = sorted(set(specs.GEMM_PRODUCTS["linear_gelu"]) &
                       set(specs.GEMM_PRODUCTS["linear_residual"]) | set(specs.SWEEP_PRODUCTS))
        if linear_products is not None and linear_products not in built:
            raise ValueError(f"cutile linear_products must be one of {built}, "
                             f"not {linear_products}")
        self.mode = mode
        self.linear_products = linear_products
        self.fuse_norms = fuse_norms
        self.fuse_ffn = fuse_ffn
        self.lean_pairs = lean_pairs
        self.pdl = pdl
        self.fuse_block = fuse_block
        self._kernels = {}

    def kernels(self, device):
        """The launcher for device (built once; raises Unsupported with the reason)."""
        device = cuda_device(device)
        if device not in self._kernels:
            self._kernels[device] = kernels_for(device, self.mode)
        return self._kernels[device]

    def unavailable_reason(self, device):
        """cuda-python must import, and a build or the JIT must serve the device."""
        try:
            import cuda.core  # noqa: F401
        except ImportError as exc:
            return f"cuda-python (cuda.core) is not installed ({exc}); pip install '.[cutile]'"
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device, and this machine has none"
        try:
            self.kernels(device)
        except Unsupported as exc:
            return str(exc)
        return None

    def check(self, config, device, dtype, *, built=False):
        """The interface's checks, plus the widest LayerNorm row the kernels were built for,
        the 32-bit strides of one sequence's Q/K/V rows and the depth its one-product Q/K/V
        keeps the contract to."""
        refusal = one_product_qkv_refusal(config)
        if refusal:
            raise Unsupported(f"{self.name}: {refusal}")
        if config.d_model > specs.MAX_ROW_WIDTH:
            raise Unsupported(f"{self.name} handles d_model up to {specs.MAX_ROW_WIDTH}, "
                              f"not {config.d_model}")
        if config.seq_len * 3 * config.d_model > specs.INT32_MAX:
            raise Unsupported(f"{self.name} indexes with 32 bits: seq_len x 3 x d_model must "
                              f"stay below 2^31, not {config.seq_len * 3 * config.d_model}")
        super().check(config, device, dtype, built=built)

    def memory_plan(self, config, dtype):
        """One sequence's workspace (the layer streams the batch) plus the packed weights."""
        norms, ffn = fusions(config, self.fuse_norms, self.fuse_ffn)
        block = self.fuse_block is not False and specs.block_constants(
            config.seq_len, config.d_model, config.num_heads, config.ffn_dim, 3) is not None
        one = working_bytes_per_sequence(config, None, norms, ffn, block)
        return MemoryPlan({"one sequence": one, PARAMETERS: param_bytes(config)})

    def _build(self, config, state_dict, device, dtype):
        products = self.linear_products or default_products(
            config, linear_products_for(config.d_model))
        kernels = self.kernels(device)
        (tm, tn, tk), variant = specs.GEMM_CHOICES["linear_gelu"][-1]
        if not kernels.has(specs.variant_name("linear_gelu", variant),
                           {"TM": tm, "TN": tn, "TK": tk, "PRODUCTS": products}):
            raise Unsupported(f"{self.name}: this build has no kernels with {products} fp16 "
                              f"product(s) per weight; export it with --sweep")
        block = specs.block_constants(config.seq_len, config.d_model, config.num_heads,
                                      config.ffn_dim, products)
        if self.fuse_block is True and block is not None and not kernels.has(
                specs.block_kernel(block), block):
            raise Unsupported(f"{self.name}: this build has no whole-block kernel for {block} "
                              f"(a --sweep build has those of the official shapes; the JIT "
                              f"compiles any)")
        import torch

        device = torch.device(device)
        no_pdl = programmatic_refusal(device, kernels)
        if self.pdl and no_pdl:
            raise Unsupported(f"{self.name}: {no_pdl}")
        return CutileLayer(self, config, state_dict, device, dtype, kernels, products,
                           self.fuse_norms, self.fuse_ffn, lean_pairs=self.lean_pairs,
                           pdl=no_pdl is None if self.pdl is None else self.pdl,
                           fuse_block=self.fuse_block is not False)

    def describe(self):
        """Name, summary, capabilities, and how kernels are launched on this machine."""
        import torch

        row = super().describe()
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            why = self.unavailable_reason(device)
            row["notes"] += ("; launch: " + self._kernels[device].mode if why is None
                             else f"; unavailable: {why}")
        return row
