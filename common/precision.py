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


def deep_stack(config) -> bool:
    """Whether config has more blocks than DEEP_STACK_BLOCKS."""
    return config.num_layers > DEEP_STACK_BLOCKS


def default_products(config, shallow: int) -> int:
    """fp16 products of out_proj and the FFN by default: shallow (the backend's choice for
    the width) up to DEEP_STACK_BLOCKS blocks, DEEP_STACK_PRODUCTS beyond."""
    return DEEP_STACK_PRODUCTS if deep_stack(config) else shallow


# A Q/K/V of one fp16 product (cupy's and cutile's) errs past the contract in deeper stacks
# of these widths even with three products elsewhere (bench/depth_study.py: error/allowed
# 0.94-0.97 at 24 blocks of d_model 512 and 1024, 1.17 at 32 of d_model 1024; at d_model 128,
# 0.51-0.92 up to 64 blocks).
ONE_PRODUCT_QKV_MAX_BLOCKS = 24
ONE_PRODUCT_QKV_MIN_WIDTH = 512


def one_product_qkv_refusal(config) -> str | None:
    """Why a stack whose Q/K/V runs one fp16 product cannot keep the contract, or None."""
    if (config.num_layers > ONE_PRODUCT_QKV_MAX_BLOCKS
            and config.d_model >= ONE_PRODUCT_QKV_MIN_WIDTH):
        return (f"{config.num_layers} blocks of d_model {config.d_model}: with one fp16 product "
                f"for Q/K/V the error grows past the contract beyond "
                f"{ONE_PRODUCT_QKV_MAX_BLOCKS} blocks at d_model {ONE_PRODUCT_QKV_MIN_WIDTH} "
                f"and above (bench/depth_study.py)")
    return None
