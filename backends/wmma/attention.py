"""Attention launches (attention.cu): flash attention over the packed Q/K/V rows.

Two kernel families compute the same thing:
- "flash" variants (FLASH_VARIANTS, `flash_attention_kernel<HP, MF, WARPS, BN, EXACT>`):
  scores, probabilities and the context stay in wmma fragments in registers for the whole key
  loop; K/V double-buffered by cp.async. They rely on the element layout of the accumulator
  and matrix_a fragments, which the wmma API leaves unspecified, so they run only where the
  layout probe (ext.attention_layout_mismatches, once per extension and device) finds it.
  Each variant picks its own query and key blocks per head_pad (see kInstances in
  attention.cu); the layer's block_n does not apply to them.
- "legacy" (`attention_kernel<block_n>`): scores, P and O through shared memory, documented
  API only; the fallback, with the key block block_n (tiles.py).

attention(..., kernel=None) picks: legacy where the probe fails; else "flash_m64" (64 query
rows per block) when 128-row blocks would leave multiprocessors idle, the head dim is at
most 32, or it is above 128 and two 64-row blocks fit one multiprocessor's shared memory;
"flash" otherwise; "flash_m64" also where the chosen variant exceeds the device's shared memory
per block (99 KB devices at head_pad 112 and 128), legacy where that one does too.
"""
from __future__ import annotations

import math

import torch

from layerbench.common.cuda_host import (max_shared_memory_per_block, multiprocessor_count,
                                         shared_memory_per_multiprocessor)

from .tiles import ATTENTION_BLOCK_M, MAX_HEAD_DIM, pad16

LEGACY = "legacy"
# The flash variants of attention.cu (kVariantNames), by index.
FLASH_VARIANTS = ("flash", "flash_w8", "flash_m64")
KERNELS = FLASH_VARIANTS + (LEGACY,)
FLASH_BLOCK_M = 128  # query rows per block of "flash" and "flash_w8" ("flash_m64": 64)

_layout_checked: dict[tuple[int, int], bool] = {}


def supported_head_dim(head_dim: int) -> bool:
    """Whether the attention kernel takes this head dim (multiples of 8 up to 256)."""
    return head_dim % 8 == 0 and 8 <= head_dim <= MAX_HEAD_DIM


def max_seq_len() -> int:
    """The longest sequence every attention kernel covers (the legacy kernel's query blocks in
    grid dimension y; the flash kernels take any int32 length)."""
    return 65535 * ATTENTION_BLOCK_M


def legacy_block_n(head_dim: int) -> int:
    """The legacy kernel's key block: 64, or 32 above head dim 128 (as tiles.choose_tiles)."""
    return 64 if pad16(head_dim) <= 128 else 32


def shared_bytes(ext, head_dim: int, block_n: int) -> int:
    """Dynamic shared memory of one legacy attention block."""
    return ext.attention_smem_bytes(pad16(head_dim), block_n)


def layout_mismatches(ext, device: torch.device) -> list[int]:
    """The fragment-layout probe's 4 mismatch counts on device (runs a kernel; synchronises):
    accumulator load, matrix_a load, matrix_a built from the layout through mma_sync,
    accumulator built from the layout through store_matrix_sync."""
    with torch.cuda.device(device):
        return list(ext.attention_layout_mismatches())


def layout_ok(ext, device: torch.device) -> bool:
    """Whether the flash kernels' fragment layout holds on device (probed once per extension
    and device, outside any CUDA-graph capture: the layer's first forward runs eagerly)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (id(ext), index)
    if key not in _layout_checked:
        _layout_checked[key] = not any(layout_mismatches(ext, torch.device("cuda", index)))
    return _layout_checked[key]


def kernel_names(ext, device: torch.device) -> list[str]:
    """The kernels attention(kernel=) runs on device: the flash variants where the layout
    probe passes, and legacy."""
    return list(KERNELS) if layout_ok(ext, device) else [LEGACY]


def instance(ext, kernel: str, head_dim: int) -> tuple[str, int, int, int, int, int]:
    """(kernel name, head_pad, block_m, block_n, threads, shared bytes) of what kernel runs
    at head_dim."""
    if kernel == LEGACY:
        block_n = legacy_block_n(head_dim)
        return (f"attention_kernel<{block_n}>", pad16(head_dim), ATTENTION_BLOCK_M, block_n, 128,
                shared_bytes(ext, head_dim, block_n))
    return tuple(ext.attention_instance(FLASH_VARIANTS.index(kernel), pad16(head_dim)))


def choose_kernel(ext, device: torch.device, *, batch: int, seq_len: int, num_heads: int,
                  head_dim: int) -> str:
    """The kernel attention(kernel=None) runs (see the module docstring)."""
    if not layout_ok(ext, device):
        return LEGACY
    blocks = batch * num_heads * math.ceil(seq_len / FLASH_BLOCK_M)
    # 64-row blocks where 128-row ones leave multiprocessors idle, at head dims up to 32,
    # where more resident warps hide the softmax (H200, B=64 S=1024 hd 32: 0.160 ms against
    # 0.206 for "flash"; S=100000 hd 64: "flash" 296 TFLOP/s, "flash_m64" 239), and above 128,
    # where two 64-row blocks fit an SM's shared memory and one 128-row block (H100, B=64
    # S=128 hd 256: 0.066 ms against 0.080).
    head_pad = pad16(head_dim)
    small = blocks < multiprocessor_count(device) or head_pad <= 32
    if head_pad > 128:
        per_sm = shared_memory_per_multiprocessor(device)
        # two blocks, each with the 1 KB the CUDA runtime reserves per block
        small = small or (per_sm is not None and
                          2 * (instance(ext, "flash_m64", head_dim)[5] + 1024) <= per_sm)
    kernel = "flash_m64" if small else "flash"
    limit = max_shared_memory_per_block(device)
    if limit is None:
        return kernel
    # Where the 128-row blocks exceed the device's shared memory per block (99 KB devices
    # such as sm_86 and sm_89 at head_pad 112 and 128), the 64-row blocks may still fit.
    for candidate in dict.fromkeys((kernel, "flash_m64")):
        if instance(ext, candidate, head_dim)[5] <= limit:
            return candidate
    return LEGACY


def shared_memory_refusal(ext, device: torch.device, head_dim: int, block_n: int) -> str | None:
    """Why no attention kernel that attention(kernel=None) may run at head_dim fits the
    device's shared memory per block, or None: the legacy kernel (key block block_n) fits, or
    the layout probe passes and flash_m64 (the smallest flash variant) fits, so that
    choose_kernel never picks the legacy kernel."""
    limit = max_shared_memory_per_block(device)
    need = shared_bytes(ext, head_dim, block_n)
    if limit is None or need <= limit:
        return None
    if layout_ok(ext, device) and instance(ext, "flash_m64", head_dim)[5] <= limit:
        return None
    return (f"attention needs {need} bytes of shared memory per block (legacy kernel, key "
            f"block {block_n}; no flash variant runs within the limit here), the device "
            f"allows {limit}")


def attention_kernel_name(ext, device: torch.device, *, head_dim: int, batch: int = 1,
                          seq_len: int = 4096, num_heads: int = 1) -> str:
    """The CUDA kernel attention(kernel=None) launches for these sizes on device, e.g.
    'flash_attention_kernel<64, 2, 4, 64, true>' or 'attention_kernel<64>'."""
    kernel = choose_kernel(ext, device, batch=batch, seq_len=seq_len, num_heads=num_heads,
                           head_dim=head_dim)
    return instance(ext, kernel, head_dim)[0]


def attention(ext, qkv: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor],
              valid: torch.Tensor | None, *, batch: int, seq_len: int, num_heads: int,
              causal: bool, block_n: int | None = None, kernel: str | None = None) -> None:
    """ctx (an fp16 (hi, lo) pair [B*S, D]) = softmax(q k^T / sqrt(hd)) v for every head, from
    qkv [B*S, 3D] fp16; valid [B, S] uint8 masks keys (None: all valid).

    kernel: None (choose_kernel), a flash variant, or "legacy". block_n is the legacy kernel's
    key block (None: legacy_block_n); the flash variants choose their own blocks."""
    head_dim = ctx[0].shape[1] // num_heads
    if kernel is None:
        kernel = choose_kernel(ext, qkv.device, batch=batch, seq_len=seq_len,
                               num_heads=num_heads, head_dim=head_dim)
        if kernel != LEGACY and (ctx[0].data_ptr() % 4 or ctx[1].data_ptr() % 4):
            kernel = LEGACY  # the flash kernels store two halves at a time
    if kernel == LEGACY:
        block_n = legacy_block_n(head_dim) if block_n is None else block_n
        ext.attention(qkv, ctx[0], ctx[1], valid, batch, seq_len, num_heads, causal, block_n,
                      -1)
        return
    if kernel not in FLASH_VARIANTS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    ext.attention(qkv, ctx[0], ctx[1], valid, batch, seq_len, num_heads, causal, 0,
                  FLASH_VARIANTS.index(kernel))
