"""TMA tensor maps for linear_wgmma_tma (linear_wgmma.cu) and flash_attention_wgmma_tma
(attention_wgmma.cu): a 2-D fp16 row-major tensor [rows, K] described by the driver's
cuTensorMapEncodeTiled (boxes of 64 K columns, 128 bytes, by box_rows rows, 128-byte swizzle,
zeros outside the tensor; see _encoder for why through ctypes), packed as the kernel's
128-byte lb::TensorMap argument; or, given seq_len, the same rows viewed as [rows / seq_len
sequences][seq_len][K] (rank 3, boxes of 64 x box_rows x 1), so that TMA zero-fills past
each sequence's end. Boxes are 64 columns (128-byte swizzle) or, given box_cols 32, 32
columns (64 bytes, 64-byte swizzle: flash_attention_wgmma_tma at head dim 32).

The argument is a 0-d NumPy array of TENSOR_MAP_DTYPE, not a NumPy scalar: CuPy passes a
one-element numpy.ndarray by value from its data (cupy/cuda/function.pyx, _pointer:
CNumpyArray), in every 14.x release, while a structured scalar goes through
_scalar.CScalar, which in CuPy 14.0.x asserts that the item is smaller than 64 bytes
(cupy/_core/_scalar.pyx, _store_c_value; 14.1 allocates larger ones)."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from . import driver

WORDS = 16  # 64-bit words of a CUtensorMap
TENSOR_MAP_DTYPE = np.dtype([("words", "<u8", (WORDS,))])  # 128 bytes, as lb::TensorMap
BOX_COLS = 64  # K columns a box: 128 bytes, one 128B-swizzle row (linear_wgmma.cu BK)
MAX_BOX_ROWS = 256  # TMA's limit on a box dimension
CACHE_SIZE = 256  # maps kept by a TensorMapCache before it starts afresh


def check(t: torch.Tensor, box_rows: int, seq_len: int | None = None,
          box_cols: int = BOX_COLS) -> None:
    """ValueError unless t is a 2-D fp16 row-major tensor a tensor map can describe (columns
    contiguous, a row stride of a multiple of 8 elements, a 16-byte-aligned base, at least
    one row and column), box_rows is 1 .. 256, seq_len, where given, is positive and
    divides the rows (the 3-D view) and box_cols is one of SWIZZLES."""
    shape = tuple(t.shape)
    if t.dim() != 2 or t.dtype != torch.float16:
        raise ValueError(f"TMA tensor map needs a 2-D fp16 tensor, not {t.dtype} {shape}")
    rows, cols = shape
    if rows < 1 or cols < 1:
        raise ValueError(f"TMA tensor map needs a non-empty tensor, not {shape}")
    if cols > 1 and t.stride(1) != 1:
        raise ValueError(f"TMA tensor map needs contiguous rows, not strides {t.stride()} "
                         f"for {shape}")
    if t.stride(0) % 8 != 0 or t.stride(0) < cols:
        raise ValueError(f"TMA tensor map needs a row stride of a multiple of 8 elements (16 "
                         f"bytes) covering the row, not {t.stride(0)} for {shape}")
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"TMA tensor map needs a 16-byte-aligned base, not {t.data_ptr():#x} "
                         f"for {shape}")
    if not 1 <= box_rows <= MAX_BOX_ROWS:
        raise ValueError(f"TMA box rows must be 1 .. {MAX_BOX_ROWS}, not {box_rows}")
    if box_cols not in SWIZZLES:
        raise ValueError(f"TMA box columns must be one of {sorted(SWIZZLES)}, not {box_cols}")
    if seq_len is not None and (seq_len < 1 or rows % seq_len != 0):
        raise ValueError(f"TMA sequence view needs rows a multiple of seq_len {seq_len}, not "
                         f"{shape}")


def layout(t: torch.Tensor, box_rows: int, seq_len: int | None = None,
           box_cols: int = BOX_COLS):
    """(global dims, global strides in bytes, box) of t's map, innermost first: 2-D [K, rows],
    [row bytes], [box_cols, box_rows]; with seq_len 3-D [K, seq_len, rows / seq_len], [row
    bytes, seq_len row bytes], [box_cols, box_rows, 1]."""
    rows, cols = t.shape
    row_bytes = t.stride(0) * t.element_size()
    if seq_len is None:
        return [cols, rows], [row_bytes], [box_cols, box_rows]
    return ([cols, seq_len, rows // seq_len], [row_bytes, seq_len * row_bytes],
            [box_cols, box_rows, 1])


def describable(t: torch.Tensor, box_rows: int = 1, seq_len: int | None = None,
                box_cols: int = BOX_COLS) -> bool:
    """Whether check passes for t."""
    try:
        check(t, box_rows, seq_len, box_cols)
    except ValueError:
        return False
    return True


# cuTensorMapEncodeTiled's enum values (cuda.h; test_tensor_maps checks them against
# cuda.bindings.driver's CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion and
# ...FloatOOBfill)
FLOAT16, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZEROS = 6, 0, 3, 3, 0
SWIZZLE_64B = 2
SWIZZLES = {64: SWIZZLE_128B, 32: SWIZZLE_64B}  # box columns -> the swizzle of one box row


@functools.cache
def _encoder():
    """The driver's cuTensorMapEncodeTiled, called through ctypes (driver.libcuda). Not
    through cuda-bindings' driver.cuTensorMapEncodeTiled: it encodes into a CUtensorMap
    object whose storage CPython aligns to 16 bytes only (getPtr() % 64 == 32 with
    cuda-bindings 13.5), where the driver needs 64 (cuda-python pull request 1692: a
    segmentation fault)."""
    fn = driver.libcuda().cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_tiled(t: torch.Tensor, box_rows: int, seq_len: int | None = None,
                 box_cols: int = BOX_COLS) -> tuple[int, np.ndarray]:
    """cuTensorMapEncodeTiled of t ([rows, K] fp16, row-major) into a 64-byte-aligned buffer:
    data type FLOAT16, rank 2 (3 with seq_len), global dims, strides and box of layout
    (2-D: [K, rows], [the row stride in bytes], [64, box_rows]), element strides all 1, no
    interleave, 128-byte swizzle (64-byte for boxes of 32 columns), 256-byte L2 promotion,
    zeros outside (OOB fill none). Returns (its CUresult, the map's 16 words)."""
    dims, strides, box = layout(t, box_rows, seq_len, box_cols)
    rank = len(dims)
    store = np.zeros(WORDS + 8, dtype=np.uint64)
    first = (-store.ctypes.data % 64) // 8  # 64-byte alignment, as CUtensorMap
    words = store[first:first + WORDS]
    assert words.ctypes.data % 64 == 0
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    result = _encoder()(words.ctypes.data, FLOAT16, rank, t.data_ptr(), (u64 * rank)(*dims),
                        (u64 * (rank - 1))(*strides), (u32 * rank)(*box),
                        (u32 * rank)(*[1] * rank), INTERLEAVE_NONE, SWIZZLES[box_cols],
                        L2_PROMOTION_256B, OOB_FILL_ZEROS)
    return int(result), words.copy()


def pack(words) -> np.ndarray:
    """16 64-bit words as a 0-d array of TENSOR_MAP_DTYPE (128 bytes, in order)."""
    words = [int(w) for w in words]
    if len(words) != WORDS:
        raise ValueError(f"a tensor map has {WORDS} words, not {len(words)}")
    out = np.zeros((), dtype=TENSOR_MAP_DTYPE)
    out["words"] = np.array(words, dtype=np.uint64)
    return out


def tensor_map(t: torch.Tensor, box_rows: int, encode=encode_tiled,
               seq_len: int | None = None, box_cols: int = BOX_COLS) -> np.ndarray:
    """The tensor map of t ([rows, K] fp16, row-major; see check) with boxes of box_cols
    columns by box_rows rows (seq_len given: the 3-D view of layout, boxes box_cols x
    box_rows x 1), as the kernel argument (a 0-d array of TENSOR_MAP_DTYPE). ValueError where
    t cannot be described, RuntimeError naming t's shape where the driver refuses (encode:
    (CUresult, words) of t, box_rows, seq_len and box_cols, encode_tiled but in tests)."""
    check(t, box_rows, seq_len, box_cols)
    result, words = encode(t, box_rows, seq_len, box_cols)
    if int(result) != 0:
        view = "" if seq_len is None else f", sequences of {seq_len}"
        raise RuntimeError(f"cuTensorMapEncodeTiled failed for a tensor {tuple(t.shape)} "
                           f"(strides {t.stride()}, box {box_cols} x {box_rows}{view}): "
                           f"CUresult {int(result)}")
    return pack(words)


def key(t: torch.Tensor, box_rows: int, seq_len: int | None = None,
        box_cols: int = BOX_COLS) -> tuple:
    """Everything a tensor map depends on: the base address, shape, strides, dtype, box, the
    sequence length of a 3-D view."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, box_rows, seq_len,
            box_cols)


class TensorMapCache:
    """tensor_map memoised on key: a map is a function of the key alone, so an entry stays
    right whatever tensor now lives at its address. Cleared when CACHE_SIZE are held."""

    def __init__(self, encode=encode_tiled):
        self.encode = encode
        self.maps: dict[tuple, np.ndarray] = {}

    def __call__(self, t: torch.Tensor, box_rows: int, seq_len: int | None = None,
                 box_cols: int = BOX_COLS) -> np.ndarray:
        k = key(t, box_rows, seq_len, box_cols)
        found = self.maps.get(k)
        if found is None:
            if len(self.maps) >= CACHE_SIZE:
                self.maps.clear()
            found = self.maps[k] = tensor_map(t, box_rows, self.encode, seq_len, box_cols)
        return found
