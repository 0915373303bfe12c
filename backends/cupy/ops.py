"""Host side of each kernel family: the kernel, grid, shared memory and argument list of one
launch, on PyTorch's current stream, with tensors handed to CuPy through DLPack."""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from layerbench.common.cuda_host import (cdiv, device_arch, max_shared_memory_per_block,
                                         multiprocessor_count)
from layerbench.reference.model import LN_EPS

from . import build, driver, tensor_maps

NORM_ROWS = 4  # rows per LayerNorm block (norm.cu NORM_WARPS)
STAGES, BK_ROW = 3, 40  # linear.cu: pipeline stages, shared row length in halves
# attention_wgmma.cu: K and V buffers of the plain schedule, V buffers of the pipelined one
K_BUFFERS, V_BUFFERS, PIPELINED_V_BUFFERS = 2, 2, 3
NULL = np.uint64(0)
MIN_WGMMA_REGISTERS = 32  # the real 64x64 Hopper GEMM holds 86; its trap body 4


def tile_rows(bm: int, bn: int, products: int) -> int:
    """Rows of the A and W tiles a GEMM stage holds: A's hi half and, past one product, its
    lo half; W's hi half and, at three products, its lo half."""
    return (2 if products > 1 else 1) * bm + (2 if products == 3 else 1) * bn


def linear_shared_bytes(bm: int, bn: int, products: int) -> int:
    """Dynamic shared memory of a GEMM block (linear.cu linear_shared_bytes)."""
    return STAGES * tile_rows(bm, bn, products) * BK_ROW * 2


def wgmma_shared_bytes(bm: int, bn: int, products: int,
                       stages: int = build.GEMM_PLAIN.stages) -> int:
    """Dynamic shared memory of a Hopper GEMM block (linear_wgmma.cu) of stages cp.async
    stages, with 1 KiB to align its 128-byte-swizzled tiles."""
    return stages * tile_rows(bm, bn, products) * 128 + 1024


def norm_prologue_shared_bytes(bm: int, bn: int, products: int) -> int:
    """Dynamic shared memory of a norm-prologue GEMM block (linear_wgmma.cu
    linear_wgmma_norm_prologue: every K tile held, each as one stage)."""
    return wgmma_shared_bytes(bm, bn, products, build.PROLOGUE_STAGES)


def attention_shared_bytes(head_pad: int, bq: int, bkv: int) -> int:
    """Dynamic shared memory of an attention block (attention.cu: Q, K and V tiles, rows
    padded by 8 halves)."""
    return (bq + 2 * bkv) * (head_pad + 8) * 2


def attention_wgmma_shared_bytes(head_pad: int, bq: int, bkv: int,
                                 pipelined: bool = False) -> int:
    """Dynamic shared memory of a Hopper attention block (attention_wgmma.cu: Q, two K tiles
    and two V tiles, three when pipelined, 1 KiB to align them)."""
    v_buffers = PIPELINED_V_BUFFERS if pipelined else V_BUFFERS
    return (bq + (K_BUFFERS + v_buffers) * bkv) * head_pad * 2 + 1024


def attention_wgmma_tma_shared_bytes(head_pad: int, kv_stages: int, bkv: int,
                                     bq: int) -> int:
    """Dynamic shared memory of a TMA-ring attention block (attention_wgmma.cu
    attention_wgmma_tma_shared_bytes: Q of bq rows, kv_stages K and V tiles of bkv rows, 1 KiB
    to align them; its mbarriers are static)."""
    return (bq + 2 * kv_stages * bkv) * head_pad * 2 + 1024


def attention_variant_shared_bytes(head_pad: int, variant: build.AttentionVariant) -> int:
    """Dynamic shared memory of a block of the wgmma attention variant at head_pad."""
    if variant.tma:
        return attention_wgmma_tma_shared_bytes(head_pad, variant.kv_stages, variant.bkv,
                                                variant.bq)
    return attention_wgmma_shared_bytes(head_pad, variant.bq, variant.bkv, variant.pipelined)


def head_pad(head_dim: int) -> int:
    """The padded head dim attention is compiled for: the power of two >= head_dim, >= 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


class Kernels:
    """The compiled module of one device, launching its kernels on PyTorch's current stream
    and turning CUDA errors into exceptions that name the kernel."""

    def __init__(self, device: torch.device):
        import cupy

        self.cupy = cupy
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self.arch = device_arch(self.device)
        self.has_wgmma = build.nvrtc_arch(self.arch) == build.HOPPER
        self.functions: dict[str, object] = {}
        self.tensor_maps = tensor_maps.TensorMapCache()
        # Compiled, loaded and probed on this device: CuPy builds a module for the device
        # current when a function is first taken from it, which may be another one.
        with cupy.cuda.Device(index):
            self.module = build.module_for(self.arch)
            self.wgmma_problem = self._wgmma_problem() if self.has_wgmma else None
        # why kernels cannot launch as programmatic dependents here, or None
        self.programmatic_problem = (
            None if int(self.arch) >= 90
            else f"programmatic dependent launch needs sm_90 or newer, not sm_{self.arch}")

    def _wgmma_problem(self) -> str | None:
        """Why the module's wgmma kernels cannot run, or None: compiled for plain sm_90 (if
        NVRTC took CuPy's -arch over sm_90a) their bodies are traps of a few registers."""
        probe = self.module.get_function(build.wgmma_name(build.WGMMA_TILES[1], 1, "half"))
        if probe.num_regs < MIN_WGMMA_REGISTERS:
            return (f"the wgmma kernels were not compiled for sm_90a ({probe.num_regs} "
                    "registers: a trap body); this NVRTC took another target")
        return None

    def tensor_map(self, t: torch.Tensor, box_rows: int, seq_len: int | None = None,
                   box_cols: int = tensor_maps.BOX_COLS):
        """The TMA tensor map argument of t ([rows, K] fp16) with boxes of box_cols (64, or
        32) x box_rows (seq_len given: its 3-D view as sequences of seq_len rows;
        tensor_maps.tensor_map, memoised)."""
        return self.tensor_maps(t, box_rows, seq_len, box_cols)

    def function(self, name: str, shared: int):
        """The kernel of name expression name, allowed shared bytes of dynamic memory."""
        kernel = self.functions.get(name)
        if kernel is None:
            kernel = self.functions[name] = self.module.get_function(name)
        if shared > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared:
            kernel.max_dynamic_shared_size_bytes = shared
        return kernel

    def launch(self, name: str, grid, block: int, shared: int, args,
               programmatic: bool = False) -> None:
        """Launch kernel name on PyTorch's current stream; tensors pass through DLPack, None
        as a null pointer. The tensors are exported inside the stream context, so PyTorch sees
        its own stream asked for and adds no cross-stream wait (which would break a CUDA
        graph's capture). programmatic: through the driver's cuLaunchKernelEx, allowed to
        begin while the kernel before it on the stream runs (driver.launch_programmatic)."""
        cupy = self.cupy
        stream = torch.cuda.current_stream(self.device).cuda_stream
        try:
            with cupy.cuda.Device(self.device.index):
                kernel = self.function(name, shared)
                if programmatic:
                    result = driver.launch_programmatic(kernel.kernel.ptr, grid, block, shared,
                                                        stream, args)
                    if result != 0:
                        raise RuntimeError(f"cupy kernel {name} failed to launch: "
                                           f"{driver.error_name(result)} (an asynchronous "
                                           "error of an earlier kernel also surfaces here)")
                    return
                with cupy.cuda.ExternalStream(stream):
                    packed = tuple(NULL if a is None else cupy.from_dlpack(a.detach())
                                   if isinstance(a, torch.Tensor) else a for a in args)
                    kernel(tuple(grid), (block,), packed, shared_mem=shared)
        except (cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError) as exc:
            raise RuntimeError(f"cupy kernel {name} failed to launch: {exc} (an asynchronous "
                               "error of an earlier kernel also surfaces here)") from exc


class ProgrammaticKernels:
    """Kernels whose every launch may begin while the kernel before it on the stream still
    runs (programmatic dependent launch): each kernel first waits for that one to complete
    (common.cuh start_after_previous), so only the launch latency overlaps."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def launch(self, name: str, grid, block: int, shared: int, args) -> None:
        """Launch kernel name as a programmatic dependent (Kernels.launch)."""
        self.kernels.launch(name, grid, block, shared, args, programmatic=True)


@functools.cache
def kernels_for(device: torch.device) -> Kernels:
    """The compiled kernels of device (built once per process)."""
    return Kernels(device)


def layer_norm(k: Kernels, x, weight, bias, *, pair=None, half=None, out=None,
               valid_rows=None, eps: float = LN_EPS) -> None:
    """LayerNorm of x's rows into an fp16 pair, fp16 alone (half) or fp32 (out, rows whose
    valid byte is 0 set to 0)."""
    m, d = x.shape
    if pair is not None:
        output, hi, lo, stride = "pair", pair[0], pair[1], pair[0].stride(0)
    elif half is not None:
        output, hi, lo, stride = "half", half, None, half.stride(0)
    else:
        output, hi, lo, stride = "float", None, None, out.stride(0)
    k.launch(build.norm_name(output, d), (cdiv(m, NORM_ROWS), 1, 1), NORM_ROWS * 32, 0,
             (x, np.int64(x.stride(0)), weight, bias, np.int32(m), np.int32(d),
              np.float32(eps), hi, lo, np.int64(stride), out, valid_rows))


def gemm_tile(m: int, n: int, device: torch.device, products: int = 1, wgmma: bool = False,
              norm: bool = False, prologue: bool = False):
    """(BM, BN, WM, WN), or (BM, BN) with wgmma (norm: of the residual_norm epilogue, BN 128;
    prologue: of the norm-prologue GEMM, the wgmma tiles): the large tile where that grid has
    at least one block per multiprocessor and its shared memory fits the device, else the
    small."""
    tiles = build.NORM_TILES if norm else build.WGMMA_TILES if wgmma else build.GEMM_TILES
    sizer = (norm_prologue_shared_bytes if prologue else wgmma_shared_bytes if wgmma
             else linear_shared_bytes)
    need = sizer(tiles[0][0], tiles[0][1], products)
    limit = max_shared_memory_per_block(device)
    fits = limit is None or need <= limit
    if fits and cdiv(m, tiles[0][0]) * cdiv(n, tiles[0][1]) >= multiprocessor_count(device):
        return tiles[0]
    return tiles[1]


def linear(k: Kernels, a, weight, bias, epilogue: str, products: int, *, out_pair=None,
           out_half=None, res=None, out=None, valid_rows=None, zero_sum: bool = False,
           norm=None, norm_out=None, eps: float = LN_EPS, tile=None,
           wgmma: bool = False, gemm_variant: str | None = None,
           prologue_norm=None, staged: int = 0, short_norm: bool = False) -> None:
    """out = epilogue(a @ weight^T + bias) with a and weight as fp16 (hi, lo) pairs over
    products fp16 products (1: a_hi w_hi; 2: + a_lo w_hi; 3: + a_hi w_lo; ValueError where
    the module has no GEMM for the epilogue at that count, see build.gemm_compiled); "half"
    writes out_half, "gelu_pair" out_pair (its lo half may be None: hi alone), "residual"
    out = res + ... (see linear.cu); wgmma: the Hopper kernel (linear_wgmma.cu), which also
    has "residual_norm": the residual, then LayerNorm (norm = (weight, bias)) of out's rows
    into norm_out (an fp16 pair, or (hi, None) for hi alone); rows up to 128 wide.
    gemm_variant: one of build.GEMM_VARIANTS by name, its tile and schedule (None: the
    default schedule on gemm_tile's tile); ValueError where it is not compiled (see
    build.gemm_variant_compiled) or contradicts tile. A TMA variant (linear_wgmma_tma) also
    takes the tensor maps of a's hi half and weight's (k.tensor_map); ValueError where either
    cannot be described by one (tensor_maps.check: a misaligned base or row stride).
    prologue_norm = (x, norm_weight, norm_bias), with a None: A is LayerNorm(x) of the fp32
    rows x (eps), computed in the GEMM's prologue as layer_norm computes it (see
    linear_norm_prologue). staged (1 or True): where the plain schedule runs on
    build.STAGED_TILE, its twin with the epilogue through shared memory (the same values;
    residual_norm's row statistics summed in another order); 2: the same, eight lanes a row
    for build.EIGHT_LANE_EPILOGUES where N is a multiple of 4 (1 otherwise). short_norm:
    residual_norm with no tile given and K at most build.SHORT_NORM_STAGES x 64 runs the
    short residual-norm GEMM (build.short_norm_name: 64 x 128 tiles, two stages, staged)."""
    if prologue_norm is not None or a is None:
        linear_norm_prologue(k, prologue_norm, a, weight, bias, epilogue, products,
                             out_pair=out_pair, out_half=out_half, res=res, out=out,
                             norm=norm, eps=eps, tile=tile, wgmma=wgmma,
                             gemm_variant=gemm_variant)
        return
    m, kdim = a[0].shape
    n = weight[0].shape[0]
    if res is not None and (out is None or res.stride(0) != out.stride(0)):
        # the kernels address res with out's row stride (linear.cu, linear_wgmma.cu)
        raise ValueError(f"cupy residual GEMM reads res with out's row stride: res rows "
                         f"{res.stride(0)} apart, out rows "
                         f"{None if out is None else out.stride(0)} apart")
    if not build.gemm_compiled(epilogue, products):
        raise ValueError(f"cupy GEMMs are not compiled for {epilogue} at {products} products "
                         f"(two products: {', '.join(build.TWO_PRODUCT_EPILOGUES)} only)")
    variant = build.GEMM_PLAIN
    if gemm_variant is not None:
        variant = build.gemm_variant(gemm_variant)
        if not wgmma:
            raise ValueError(f"cupy GEMM variant {gemm_variant!r} needs the wgmma GEMMs "
                             "(wgmma=True)")
        if not build.gemm_variant_compiled(variant, epilogue, products):
            raise ValueError(f"cupy GEMM variant {gemm_variant!r} is compiled for "
                             f"{', '.join(build.GEMM_VARIANT_EPILOGUES)} at "
                             f"{build.GEMM_VARIANT_PRODUCTS} product, not {epilogue} at "
                             f"{products}")
        if tile is not None and tuple(tile) != variant.tile:
            raise ValueError(f"cupy GEMM variant {gemm_variant!r} runs tile {variant.tile}, "
                             f"not {tile}")
        tile = variant.tile
    fused_norm = epilogue == build.NORM_EPILOGUE
    if fused_norm:
        if not wgmma:
            raise ValueError("cupy residual_norm runs on the wgmma GEMMs only")
        if n > build.MAX_NORM_WIDTH:
            raise ValueError(f"cupy residual_norm needs rows of at most "
                             f"{build.MAX_NORM_WIDTH} columns, not {n}")
        if norm is None or norm_out is None:
            raise ValueError("cupy residual_norm needs norm and norm_out")
        if tile is not None and tuple(tile) not in build.NORM_TILES:
            raise ValueError(f"cupy residual_norm runs on the tiles {build.NORM_TILES}, "
                             f"not {tile}")
    short_norm = (short_norm and fused_norm and wgmma and tile is None and gemm_variant is None
                  and kdim <= build.SHORT_NORM_STAGES * 64)  # 64: the K columns of a stage
    if short_norm:
        tile = build.SHORT_NORM_TILE
    tile = tile or gemm_tile(m, n, a[0].device, products, wgmma, norm=fused_norm)
    hi = out_half if epilogue == "half" else (out_pair[0] if out_pair is not None else None)
    lo = out_pair[1] if out_pair is not None else None
    stride = (hi if hi is not None else out).stride(0)
    args = (a[0], a[1], np.int64(a[0].stride(0)), weight[0], weight[1],
            np.int64(weight[0].stride(0)), bias, np.int32(m), np.int32(n), np.int32(kdim),
            hi, lo, np.int64(stride), res, out, valid_rows, np.int32(int(zero_sum)))
    if wgmma:
        bm, bn = tile
        stages = build.SHORT_NORM_STAGES if short_norm else variant.stages
        if short_norm:  # every K tile in its own stage, two blocks an SM
            name, threads = build.short_norm_name(products), 2 * bm
        elif variant.warp_specialised or variant.tma:  # linear_wgmma_ws / _tma
            name, threads = build.gemm_variant_name(variant, products, epilogue), variant.threads
        else:  # staged: the plain schedule's 128 x 128 kernels have the staged twin
            fits = (tuple(tile) == build.STAGED_TILE
                    and variant.tile_schedule == build.GEMM_PLAIN.tile_schedule)
            eight = (staged == 2 and epilogue in build.EIGHT_LANE_EPILOGUES
                     and n % 4 == 0)  # a lane's columns four at a time
            staged = 0 if not (staged and fits) else (2 if eight else 1)
            name = build.wgmma_name(tile, products, epilogue, variant.stages, variant.pending,
                                    staged=staged)
            threads = 2 * bm
        shared = wgmma_shared_bytes(bm, bn, products, stages)
        norm_w, norm_b = norm if fused_norm else (None, None)
        norm_hi, norm_lo = norm_out if fused_norm else (None, None)
        args += (norm_w, norm_b, np.float32(eps), norm_hi, norm_lo,
                 np.int64(norm_hi.stride(0) if fused_norm else 0))
        if variant.tma:  # the maps of A [M, K] and W [N, K] (its first K columns)
            try:
                args += (k.tensor_map(a[0], bm), k.tensor_map(weight[0][:, :kdim], bn))
            except ValueError as exc:
                raise ValueError(f"cupy GEMM variant {variant.name!r} cannot run on these "
                                 f"operands: {exc}") from exc
    else:
        bm, bn, wm, wn = tile
        name, threads = build.gemm_name(tile, products, epilogue), wm * wn * 32
        shared = linear_shared_bytes(bm, bn, products)
    grid = (cdiv(m, bm), cdiv(n, bn), 1)
    if wgmma and variant.persistent:  # blocks_per_sm blocks an SM at most, walking the tiles
        grid = (min(grid[0] * grid[1],
                    variant.blocks_per_sm * multiprocessor_count(a[0].device)), 1, 1)
    k.launch(name, grid, threads, shared, args)


def norm_prologue_refusal(x, norm_weight, norm_bias, weight, epilogue: str, products: int,
                          *, a=None, res=None, out=None, norm=None, tile=None,
                          wgmma: bool = False, gemm_variant: str | None = None) -> str | None:
    """Why the norm-prologue GEMM cannot run this launch, or None."""
    if a is not None:
        return "takes x's rows through prologue_norm, not an A pair as well"
    if x is None:
        return "needs an A pair or prologue_norm"
    if not wgmma:
        return "runs on the wgmma GEMMs only (wgmma=True)"
    if gemm_variant is not None and gemm_variant != build.GEMM_PLAIN.name:
        return f"runs the plain schedule, not GEMM variant {gemm_variant!r}"
    if not build.norm_prologue_compiled(epilogue, products):
        compiled = ", ".join(f"{e} at {' or '.join(map(str, c))}"
                             for e, c in build.PROLOGUE_EPILOGUES.items())
        return f"is compiled for {compiled} products, not {epilogue} at {products}"
    if res is not None or out is not None or norm is not None:
        return "has no residual or residual_norm epilogue"
    if tile is not None and tuple(tile) not in build.WGMMA_TILES:
        return f"runs on the tiles {build.WGMMA_TILES}, not {tile}"
    m, kdim = x.shape
    if kdim > build.MAX_PROLOGUE_K or kdim % 8:
        return (f"norms rows of a multiple of 8 columns up to {build.MAX_PROLOGUE_K} (one "
                f"block holds them whole), not {kdim}")
    if weight[0].shape[1] < kdim:
        return f"needs weights of at least {kdim} columns, not {weight[0].shape[1]}"
    if x.dtype != torch.float32 or norm_weight.dtype != torch.float32 or (
            norm_bias.dtype != torch.float32):
        return "reads fp32 rows, norm weight and bias"
    if (x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 16
            or any(t.stride(0) != 1 or t.data_ptr() % 16 or t.shape[0] < kdim
                   for t in (norm_weight, norm_bias))):
        return "reads x's rows, the norm weight and bias as 16-byte-aligned float4s"
    return None


def linear_norm_prologue(k: Kernels, prologue_norm, a, weight, bias, epilogue: str,
                         products: int, *, out_pair=None, out_half=None, res=None, out=None,
                         norm=None, eps: float = LN_EPS, tile=None, wgmma: bool = False,
                         gemm_variant: str | None = None) -> None:
    """out = epilogue(LayerNorm(x) @ weight^T + bias), prologue_norm = (x, norm_weight,
    norm_bias): linear_wgmma_norm_prologue (linear_wgmma.cu), which norms its own BM rows of
    the fp32 x in its prologue, as layer_norm does, straight into its shared A tiles; "half"
    at one product or "gelu_pair" at one to three (the norm's lo half for two and three), on
    the wgmma tiles and plain schedule, rows of K up to build.MAX_PROLOGUE_K columns.
    ValueError naming why where it does not apply (norm_prologue_refusal)."""
    x, norm_weight, norm_bias = prologue_norm if prologue_norm is not None else (None,) * 3
    why = norm_prologue_refusal(x, norm_weight, norm_bias, weight, epilogue, products, a=a,
                                res=res, out=out, norm=norm, tile=tile, wgmma=wgmma,
                                gemm_variant=gemm_variant)
    if why:
        raise ValueError(f"cupy norm-prologue GEMM {why}")
    m, kdim = x.shape
    n = weight[0].shape[0]
    bm, bn = tile or gemm_tile(m, n, x.device, products, wgmma=True, prologue=True)
    hi = out_half if epilogue == "half" else out_pair[0]
    lo = out_pair[1] if epilogue == "gelu_pair" else None
    args = (x, np.int64(x.stride(0)), norm_weight, norm_bias, np.float32(eps), weight[0],
            weight[1], np.int64(weight[0].stride(0)), bias, np.int32(m), np.int32(n),
            np.int32(kdim), hi, lo, np.int64(hi.stride(0)))
    k.launch(build.norm_prologue_name((bm, bn), products, epilogue),
             (cdiv(m, bm), cdiv(n, bn), 1), 2 * bm, norm_prologue_shared_bytes(bm, bn, products),
             args)


def attention_tile(head_padded: int, blocks: int, device: torch.device):
    """(BQ, BKV) for attention: 128 queries a block where compiled and the grid still has
    two blocks per multiprocessor, else the first compiled tile."""
    tiles = build.ATTENTION_TILES[head_padded]
    wide = [t for t in tiles if t[0] == 128]
    if wide and cdiv(blocks, 2) >= 2 * multiprocessor_count(device):
        return wide[0]
    return tiles[0]


def wgmma_attention_pad(head_dim: int) -> int | None:
    """The padded head dim the wgmma attention kernel runs head_dim at, or None where it has
    none (head dims above 256)."""
    wide = max(32, head_pad(head_dim))
    return wide if wide in build.ATTENTION_WGMMA else None


def attention(k: Kernels, qkv, ctx, valid, info, *, batch: int, seq_len: int, num_heads: int,
              head_dim: int, causal: bool, wgmma: bool = False,
              variant: str | None = None) -> None:
    """ctx (an fp16 pair of [tokens, H * hd] rows; its lo half may be None: hi alone) =
    attention of qkv ([tokens, 3 H hd]);
    wgmma: the Hopper kernel where it has the head dim by default (attention_wgmma.cu),
    variant: one of build.ATTENTION_WGMMA's by name (None: the default); ValueError for a
    variant where the wgmma kernel does not run or has no such variant, or that refuses the
    head dim (AttentionVariant.refusal). A TMA variant (flash_attention_wgmma_tma) also takes the
    3-D tensor maps (k.tensor_map with seq_len) of qkv's first batch x seq_len rows with
    boxes of the padded head dim's columns by BQ rows (Q) and BKV (K and V); ValueError where
    qkv cannot be described by one."""
    hp = head_pad(head_dim)
    wide = wgmma_attention_pad(head_dim)
    if variant is not None and not (wgmma and wide):
        raise ValueError(f"cupy attention variant {variant!r} needs the wgmma kernel "
                         f"(wgmma=True, head dim up to 256), not wgmma={wgmma} at {head_dim}")
    maps = ()
    if wgmma and wide:
        v = build.attention_variant(wide, variant, head_dim)
        bq, threads = v.bq, v.threads
        name = build.attention_wgmma_name(wide, v)
        shared = attention_variant_shared_bytes(wide, v)
        if v.tma:
            rows = qkv[:batch * seq_len]
            try:
                maps = (k.tensor_map(rows, v.bq, seq_len, wide),
                        k.tensor_map(rows, v.bkv, seq_len, wide))
            except ValueError as exc:
                raise ValueError(f"cupy attention variant {v.name!r} cannot run on this qkv: "
                                 f"{exc}") from exc
    else:
        bq, bkv = attention_tile(hp, cdiv(seq_len, 64) * batch * num_heads, qkv.device)
        name, threads = build.attention_name(hp, bq, bkv), bq // 16 * 32
        shared = attention_shared_bytes(hp, bq, bkv)
    k.launch(name, (cdiv(seq_len, bq), batch * num_heads, 1), threads, shared,
             (qkv, np.int64(qkv.stride(0)), ctx[0], ctx[1], np.int64(ctx[0].stride(0)),
              valid, info, np.int32(seq_len), np.int32(num_heads), np.int32(head_dim),
              np.float32(1.0 / math.sqrt(head_dim)), np.int32(int(causal))) + maps)


def whole_block_shared_bytes(d_model: int, ffn_width: int) -> int:
    """Dynamic shared memory of a whole-block kernel (whole_block.cu whole_block_shared_bytes):
    two weight buffers (the second also holds the block's Q rows) and the keys and values of
    WHOLE_BLOCK_MAX_SEQ rows (later ffn_out's pair), rows of width + 8 halves."""
    buffer0 = 2 * d_model * (d_model + 8)
    q_row = max(d_model, ffn_width)
    buffer1 = max(q_row + build.WHOLE_BLOCK_MAX_SEQ, 2 * ffn_width) * (d_model + 8)
    keys = max(2 * build.WHOLE_BLOCK_MAX_SEQ * (d_model + 8), 2 * d_model * (ffn_width + 8))
    return 2 * (buffer0 + buffer1 + keys)


def whole_block_refusal(config, seq_len: int, products: int,
                        device: torch.device | None = None) -> str | None:
    """Why the whole-block kernel cannot run a block of config on sequences of seq_len tokens,
    or None: three products, sequences up to WHOLE_BLOCK_MAX_SEQ tokens, a compiled (d_model,
    FFN width padded to 16) and its shared memory within the device's."""
    width = (config.d_model, cdiv(config.ffn_dim, 16) * 16)
    if products != 3:
        return f"the whole-block kernel runs three fp16 products, not {products}"
    if seq_len > build.WHOLE_BLOCK_MAX_SEQ:
        return (f"the whole-block kernel holds sequences up to {build.WHOLE_BLOCK_MAX_SEQ} "
                f"tokens, not {seq_len}")
    if width not in build.WHOLE_BLOCK_WIDTHS:
        return (f"the whole-block kernel is compiled for (d_model, FFN width) "
                f"{build.WHOLE_BLOCK_WIDTHS}, not {width}")
    limit = None if device is None else max_shared_memory_per_block(device)
    need = whole_block_shared_bytes(*width)
    if limit is not None and need > limit:
        return f"the whole-block kernel needs {need} bytes of shared memory; the device has {limit}"
    return None


def whole_block_one_wave(batch: int, seq_len: int, multiprocessors: int) -> bool:
    """Whether 64-row whole-block blocks of batch sequences of seq_len tokens make one wave
    (at most one a multiprocessor)."""
    return batch * cdiv(seq_len, build.WHOLE_BLOCK_ROWS[0]) <= multiprocessors


def whole_block_rows(batch: int, seq_len: int, multiprocessors: int) -> int:
    """Query rows a whole-block launch takes a block: 64 (four warps) where those blocks make
    one wave, else a whole sequence (eight warps: its keys and values computed once). H200,
    d_model 128, time against the per-kernel plan's in the same run, 64 rows / whole
    sequences: 64 sequences of 128 tokens (shape 1) 0.97 / 1.09; 128 sequences (shape 5)
    1.02 / 0.72; 10000 (shape 6) 1.37 / 0.94."""
    if whole_block_one_wave(batch, seq_len, multiprocessors):
        return build.WHOLE_BLOCK_ROWS[0]
    return build.WHOLE_BLOCK_MAX_SEQ


def whole_block(k: Kernels, x, out, p, w, ffn_in_bias, valid, info, *, batch: int,
                seq_len: int, num_heads: int, causal: bool, rows: int, final=None,
                final_out=None, eps: float = LN_EPS) -> None:
    """One Transformer block of batch sequences of seq_len tokens (whole_block.cu): out =
    the block of x (fp32 rows; out must not be x), p its parameters (norms and biases), w its
    fp16 weight pairs; with final (weight, bias), the final LayerNorm of the block's output
    goes to final_out instead (rows whose valid byte is 0 set to 0) and out keeps the sum after
    out_proj's residual. rows: query rows a block, one of build.WHOLE_BLOCK_ROWS
    (whole_block_rows chooses)."""
    d = x.shape[1]
    f8 = w["ffn_in_weight"][0].shape[0]
    width = cdiv(f8, 16) * 16
    head_dim = d // num_heads
    final_w, final_b = final if final is not None else (None, None)
    k.launch(build.whole_block_name(d, width, rows), (cdiv(seq_len, rows), batch, 1), 2 * rows,
             whole_block_shared_bytes(d, width),
             (x, np.int64(x.stride(0)), out, np.int64(out.stride(0)),
              w["qkv_weight"][0], p.qkv_bias, *w["out_weight"], p.out_bias,
              *w["ffn_in_weight"], ffn_in_bias, *w["ffn_out_weight"], p.ffn_out_bias,
              p.norm1_weight, p.norm1_bias, p.norm2_weight, p.norm2_bias, final_w, final_b,
              final_out, np.int64(0 if final_out is None else final_out.stride(0)),
              valid, info, np.int32(seq_len), np.int32(f8), np.int32(num_heads),
              np.int32(head_dim), np.float32(1.0 / math.sqrt(head_dim)),
              np.int32(int(causal)), np.float32(eps)))


def after_attention_shared_bytes(d_model: int, ffn_width: int, rows: int) -> int:
    """Dynamic shared memory of an after-attention block (after_attention.cu
    after_attention_shared_bytes): out_proj's weight pair (later ffn_out's), ffn_in's, the
    block's operand pair and hidden pair (rows of width + 8 halves), and the rows' partial
    sums (two floats per column warp and row)."""
    weights0 = 2 * d_model * (max(d_model, ffn_width) + 8)
    halves = (weights0 + 2 * ffn_width * (d_model + 8) + 2 * rows * (d_model + 8)
              + 2 * rows * (ffn_width + 8))
    return 2 * halves + 4 * 2 * after_attention_column_warps(d_model) * rows


def after_attention_column_warps(d_model: int) -> int:
    """Warps that share a 16-row group of the after-attention kernel (after_attention.cu
    aa_column_warps): each takes at least 16 columns of every product."""
    return 4 if d_model >= 64 else 2


def after_attention_refusal(config, products: int,
                            device: torch.device | None = None) -> str | None:
    """Why the after-attention kernel cannot run a block of config, or None: three products,
    a compiled (d_model, FFN width padded to 16), and its shared memory within the device's
    at the largest rows a block."""
    width = (config.d_model, cdiv(config.ffn_dim, 16) * 16)
    if products != 3:
        return f"the after-attention kernel runs three fp16 products, not {products}"
    if width not in build.AFTER_ATTENTION_WIDTHS:
        return (f"the after-attention kernel is compiled for (d_model, FFN width) "
                f"{build.AFTER_ATTENTION_WIDTHS}, not {width}")
    limit = None if device is None else max_shared_memory_per_block(device)
    need = after_attention_shared_bytes(*width, max(build.AFTER_ATTENTION_ROWS))
    if limit is not None and need > limit:
        return (f"the after-attention kernel needs {need} bytes of shared memory; the device "
                f"has {limit}")
    return None


def after_attention_rows(rows: int, multiprocessors: int) -> int:
    """Rows an after-attention block takes: the fewest of AFTER_ATTENTION_ROWS whose grid has
    at most a block a multiprocessor, else the most (as the Triton narrow plan's rows)."""
    *fewer, most = build.AFTER_ATTENTION_ROWS
    return next((r for r in fewer if cdiv(rows, r) <= multiprocessors), most)


def after_attention(k: Kernels, ctx, x, out, p, w, ffn_in_bias, valid_rows, *, rows: int,
                    norm=None, norm_out=None, final_out=None, eps: float = LN_EPS) -> None:
    """A block's work after attention on x's fp32 rows (after_attention.cu): out = x +
    out_proj(ctx) + FFN(norm2(...)) with the residual rules (out None: not stored; out may
    be x), then with norm (weight, bias) its LayerNorm into norm_out (fp16, may be ctx's hi
    half) or final_out (fp32, 0 on invalid rows; may be x). ctx: the context's fp16 pair;
    p the block's parameters, w its weight pairs; rows: rows a block (after_attention_rows)."""
    m, d = x.shape
    f8 = w["ffn_in_weight"][0].shape[0]
    width = cdiv(f8, 16) * 16
    norm_w, norm_b = norm if norm is not None else (None, None)
    threads = rows // 16 * after_attention_column_warps(d) * 32

    def stride(t):
        return np.int64(0 if t is None else t.stride(0))
    k.launch(build.after_attention_name(d, width, rows), (cdiv(m, rows), 1, 1), threads,
             after_attention_shared_bytes(d, width, rows),
             (x, stride(x), ctx[0], ctx[1], stride(ctx[0]), out, stride(out),
              *w["out_weight"], p.out_bias, *w["ffn_in_weight"], ffn_in_bias,
              *w["ffn_out_weight"], p.ffn_out_bias, p.norm2_weight, p.norm2_bias,
              norm_w, norm_b, norm_out, stride(norm_out), final_out, stride(final_out),
              valid_rows, np.int32(m), np.int32(f8), np.float32(eps)))
