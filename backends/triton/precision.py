"""Matrix-multiply precision modes shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl

# "fp16": operands rounded to fp16, fp32 accumulation (the fastest tensor-core path);
# "tf32": fp32 operands on TF32 tensor cores; "tf32x3": three TF32 products that recover
# nearly full fp32 accuracy; "ieee": plain fp32 FMA.
MODES = ("fp16", "tf32", "tf32x3", "ieee")


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in the requested precision (fp32 accumulation)."""
    if PRECISION == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
