"""Matrix-multiply precision modes shared by the Triton kernels."""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's CPU interpreter runs each block op through numpy: large tiles mean fewer ops.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

# "fp16": operands rounded to fp16, fp32 accumulation (the fastest tensor-core path);
# "fp16x3": each operand split into fp16 high and low parts, three fp16 products
# (hi*hi + lo*hi + hi*lo) that recover nearly fp32 accuracy at half the cost of "tf32x3";
# "tf32": fp32 operands on TF32 tensor cores; "tf32x3": three TF32 products; "ieee": fp32 FMA.
MODES = ("fp16", "fp16x3", "tf32", "tf32x3", "ieee")


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in the requested precision (fp32 accumulation)."""
    if PRECISION == "fp16" or PRECISION == "fp16x3":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)


@triton.jit
def split_halves(x):
    """(hi, lo) fp16 parts of fp32 x in registers: hi + lo == x to about 22 bits."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def split_dot(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + (a_hi + a_lo) @ (b_hi + b_lo) as three fp16 products (lo @ lo is dropped)."""
    acc = tl.dot(a_lo, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def mma_split(a, b_hi, b_lo, acc):
    """acc + a @ (b_hi + b_lo) with a split into fp16 high and low parts in registers."""
    a_hi, a_lo = split_halves(a)
    return split_dot(a_hi, a_lo, b_hi, b_lo, acc)


@triton.jit
def store_rows(ptr, lo_ptr, offsets, x, mask, SPLIT: tl.constexpr):
    """Store x at ptr in ptr's dtype, or (SPLIT) its fp16 (hi, lo) parts at ptr and lo_ptr."""
    if SPLIT:
        hi, lo = split_halves(x)
        tl.store(ptr + offsets, hi, mask=mask)
        tl.store(lo_ptr + offsets, lo, mask=mask)
    else:
        tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu(x):
    """The exact (erf) GELU."""
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


def pad16(n: int) -> int:
    """n rounded up to a power of two of at least 16 (the smallest tensor-core K)."""
    return max(16, triton.next_power_of_2(n))

