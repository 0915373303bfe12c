"""Float32 matmul precision (strict IEEE or TF32) as a context manager, and the default fp16
product count of the split-fp16 stacks by depth."""
from __future__ import annotations

import contextlib

import torch

_NEW_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _get() -> object:
    if _NEW_API:
        return torch.backends.cuda.matmul.fp32_precision
    return torch.backends.cuda.matmul.allow_tf32


def _set(value: object) -> None:
    if _NEW_API:
        torch.backends.cuda.matmul.fp32_precision = value
    else:
        torch.backends.cuda.matmul.allow_tf32 = value


@contextlib.contextmanager
def fp32_matmul(mode: str):
    """Run CUDA float32 matmuls as 'ieee' (strict) or 'tf32' inside the block, then restore."""
    if mode not in ("ieee", "tf32"):
        raise ValueError(f"mode must be 'ieee' or 'tf32', got {mode!r}")
    value = mode if _NEW_API else (mode == "tf32")
    old = _get()
    _set(value)
    try:
        yield
    finally:
        _set(old)


# Split-fp16 stacks (wmma, cupy, cutile) deeper than the official shapes' four blocks run
# out_proj and the FFN at DEEP_STACK_PRODUCTS fp16 products by default: with fewer, the
# rounding error grows with depth past the contract (bench/depth_study.py).
DEEP_STACK_BLOCKS = 4
DEEP_STACK_PRODUCTS = 3


def default_products(config, shallow: int) -> int:
    """fp16 products of out_proj and the FFN by default: shallow (the backend's choice for
    the width) up to DEEP_STACK_BLOCKS blocks, DEEP_STACK_PRODUCTS beyond."""
    return DEEP_STACK_PRODUCTS if config.num_layers > DEEP_STACK_BLOCKS else shallow
