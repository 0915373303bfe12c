"""The CUDA driver calls CuPy does not make, through ctypes on the process's libcuda (loaded
by PyTorch and CuPy): programmatic dependent launches (cuLaunchKernelEx) here, and the TMA
tensor-map encoding (tensor_maps.py)."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

# cuda.h's CUlaunchAttributeID value (test_cupy checks it against cuda.bindings.driver's)
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (here its first
    int, programmaticStreamSerializationAllowed)."""

    _fields_ = [("id", ctypes.c_int), ("padding", ctypes.c_int),
                ("allowed", ctypes.c_int), ("rest", ctypes.c_ubyte * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig: grid, block, dynamic shared bytes, stream and launch attributes."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("count", ctypes.c_uint)]


@functools.cache
def libcuda():
    """The driver library, initialised (cuInit a no-op after PyTorch's and CuPy's)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit(ctypes.c_uint(0))
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    return lib


def error_name(result: int) -> str:
    """The driver's name of a CUresult (cuGetErrorName), with its number."""
    name = ctypes.c_char_p()
    try:
        known = libcuda().cuGetErrorName(ctypes.c_int(int(result)), ctypes.byref(name)) == 0
    except (OSError, AttributeError):  # no driver library here
        known = False
    if known and name.value:
        return f"{name.value.decode()} (CUresult {int(result)})"
    return f"CUresult {int(result)}"


def argument_buffers(args) -> list[np.ndarray]:
    """Each kernel argument as the bytes the kernel takes: a tensor or None as its 64-bit
    device address (0 for None), a NumPy scalar or 0-d array (a tensor map) as itself;
    TypeError for anything else (a Python number has no size the kernel could agree on)."""
    buffers = []
    for a in args:
        if a is None or isinstance(a, torch.Tensor):
            buffers.append(np.array(0 if a is None else a.data_ptr(), dtype=np.uint64))
        elif isinstance(a, (np.generic, np.ndarray)):
            buffers.append(np.asarray(a))
        else:
            raise TypeError(f"a kernel argument must be a tensor, None or a NumPy scalar, "
                            f"not {type(a).__name__}")
    return buffers


def launch_programmatic(function: int, grid, block: int, shared: int, stream: int,
                        args) -> int:
    """cuLaunchKernelEx of the CUfunction handle function on stream with programmatic stream
    serialization allowed: the launch may begin while the kernel before it runs (each kernel
    waits for it first: common.cuh's start_after_previous). Returns the CUresult."""
    buffers = argument_buffers(args)  # alive until the driver has copied them at launch
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*[b.ctypes.data for b in buffers])
    attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, allowed=1)
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(block, 1, 1), shared,
                          stream, ctypes.pointer(attribute), 1)
    return libcuda().cuLaunchKernelEx(ctypes.byref(config), function,
                                      ctypes.cast(pointers, ctypes.c_void_p), None)
