"""Programmatic dependent launch: a kernel's programs start while the previous kernel drains.

Kernels that take a PDL flag call start_after_previous first: it lets the next kernel launch
at once and then waits until the previous kernel's writes are visible, so nothing a kernel
reads or writes can race with its neighbours. Off in the interpreter and where Triton lacks it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .precision import INTERPRETER


def _available() -> bool:
    """Whether this Triton can launch kernels as programmatic dependents."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(tl.extra, "cuda", None)
    return ("launch_pdl" in CUDAOptions.__dataclass_fields__
            and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))


AVAILABLE = not INTERPRETER and _available()
DEPENDENT_LAUNCH = False  # slower on the H200 (bench/PERFORMANCE.md, #27); used where AVAILABLE


@triton.jit
def start_after_previous(PDL: tl.constexpr):
    """Let the next kernel launch now, then wait for the previous kernel's writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def dependent_launch() -> dict:
    """Keyword arguments of a kernel launch: its PDL flag and, when on, the launch option."""
    if DEPENDENT_LAUNCH and AVAILABLE:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
