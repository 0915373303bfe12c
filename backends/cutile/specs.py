"""Every kernel specialisation the backend launches, and each kernel's parameter list.

This table is the contract between the export step (which compiles each entry) and the
launcher (which finds an entry's symbol and packs its parameters); it imports no cuda.tile.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
MAX_ROW_WIDTH = 4096  # LayerNorm rows up to this width (padded to a power of two)
INT32_MAX = 2 ** 31 - 1  # shapes and strides are passed as int32 (cutile_python_v1)
HEAD_PADS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Array:
    """An array parameter: element type, rank, and whether it meets the 16-byte assumptions
    (base address, every stride but the last, and the last dimension's length divisible by
    16 bytes; last stride 1). Without them cuTile loads element by element."""

    dtype: str  # "float32", "float16", "uint8", "int32"
    ndim: int
    aligned: bool = True
    # Arrays of one kernel that may share memory name the same group; the compiler takes all
    # others to be disjoint (declaring every array in one group halves the GEMMs' speed).
    alias_group: str = ""
    output: bool = False  # written by the kernel


@dataclass(frozen=True)
class Scalar:
    """A scalar parameter passed at run time."""

    dtype: str  # "int32" or "float32"


@dataclass(frozen=True)
class Kernel:
    """A kernel's module, its run-time parameters in order, and its constant names; a
    variant names the kernel function it compiles and the ct.kernel hints it adds."""

    module: str
    params: tuple[tuple[str, Array | Scalar], ...]
    constants: tuple[str, ...]
    function: str = ""  # the function in module (default: the kernel's own name)
    hints: tuple[tuple[str, int], ...] = ()  # e.g. (("num_worker_warps", 8),)


F32_2, F16_2 = Array("float32", 2), Array("float16", 2)
RESIDUAL = Array("float32", 2, alias_group="residual")  # a residual GEMM may write in place
OUT_F32_2, OUT_F16_2 = Array("float32", 2, output=True), Array("float16", 2, output=True)
OUT_RESIDUAL = Array("float32", 2, alias_group="residual", output=True)
F32_1 = Array("float32", 1)
F16_4 = Array("float16", 4)
WEIGHTS = (("A_HI", F16_2), ("A_LO", F16_2), ("W_HI", F16_2), ("W_LO", F16_2),
           ("BIAS", F32_1))
GEMM_CONSTANTS = ("TM", "TN", "TK", "PRODUCTS")

KERNELS: dict[str, Kernel] = {
    "layer_norm_split": Kernel("norm", (("X", F32_2), ("W", F32_1), ("B", F32_1),
                                        ("OUT_HI", OUT_F16_2), ("OUT_LO", OUT_F16_2)),
                               ("BM", "BD")),
    "layer_norm_half": Kernel("norm", (("X", F32_2), ("W", F32_1), ("B", F32_1),
                                       ("OUT", OUT_F16_2)), ("BM", "BD")),
    "layer_norm_out": Kernel("norm", (("X", F32_2), ("W", F32_1), ("B", F32_1),
                                      ("VALID", Array("uint8", 1, aligned=False)),
                                      ("OUT", OUT_F32_2), ("has_mask", Scalar("int32"))),
                             ("BM", "BD")),
    "linear_half": Kernel("linear", WEIGHTS + (("OUT", OUT_F16_2),), GEMM_CONSTANTS),
    "linear_gelu": Kernel("linear", WEIGHTS + (("OUT_HI", OUT_F16_2), ("OUT_LO", OUT_F16_2)),
                          GEMM_CONSTANTS),
    "linear_gelu_half": Kernel("linear", WEIGHTS + (("OUT", OUT_F16_2),), GEMM_CONSTANTS),
    "linear_residual": Kernel("linear", WEIGHTS + (
        ("RES", RESIDUAL), ("VALID", Array("uint8", 1, aligned=False)), ("OUT", OUT_RESIDUAL),
        ("has_mask", Scalar("int32")), ("zero_sum", Scalar("int32"))), GEMM_CONSTANTS),
    "linear_residual_norm": Kernel("linear", WEIGHTS + (
        ("RES", RESIDUAL), ("VALID", Array("uint8", 1, aligned=False)), ("OUT", OUT_RESIDUAL),
        ("NORM_W", F32_1), ("NORM_B", F32_1), ("NORM_HI", OUT_F16_2), ("NORM_LO", OUT_F16_2),
        ("NORM_OUT", OUT_F32_2), ("has_mask", Scalar("int32")), ("zero_sum", Scalar("int32")),
        ("final", Scalar("int32"))), GEMM_CONSTANTS),
    "ffn_residual_norm": Kernel("linear", (
        ("A_HI", F16_2), ("A_LO", F16_2), ("W1_HI", F16_2), ("W1_LO", F16_2), ("B1", F32_1),
        ("W2_HI", F16_2), ("W2_LO", F16_2), ("B2", F32_1), ("RES", RESIDUAL),
        ("VALID", Array("uint8", 1, aligned=False)), ("OUT", OUT_RESIDUAL),
        ("NORM_W", F32_1), ("NORM_B", F32_1), ("NORM_HI", OUT_F16_2), ("NORM_LO", OUT_F16_2),
        ("NORM_OUT", OUT_F32_2), ("has_mask", Scalar("int32")), ("final", Scalar("int32"))),
        ("TM", "TN", "TF", "PRODUCTS")),
    "block_narrow": Kernel("block", (
        ("X", Array("float32", 3)), ("OUT", Array("float32", 3, output=True)),
        ("VALID", Array("uint8", 2, aligned=False)), ("WQKV_HI", F16_2), ("WQKV_LO", F16_2),
        ("BQKV", F32_1), ("WO_HI", F16_2), ("WO_LO", F16_2), ("BO", F32_1), ("N1_W", F32_1),
        ("N1_B", F32_1), ("N2_W", F32_1), ("N2_B", F32_1), ("W1_HI", F16_2), ("W1_LO", F16_2),
        ("B1", F32_1), ("W2_HI", F16_2), ("W2_LO", F16_2), ("B2", F32_1), ("NF_W", F32_1),
        ("NF_B", F32_1), ("scale", Scalar("float32")), ("num_heads", Scalar("int32")),
        ("causal", Scalar("int32")), ("has_mask", Scalar("int32")), ("final", Scalar("int32"))),
        ("SP", "QM", "DP", "HP", "FP", "PRODUCTS")),
    "flash_attention": Kernel("attention", (
        ("QKV", F16_4), ("CTX_HI", Array("float16", 4, output=True)),
        ("CTX_LO", Array("float16", 4, output=True)),
        ("VALID", Array("uint8", 2, aligned=False)), ("KEY_INFO", Array("int32", 2)),
        ("scale", Scalar("float32")), ("num_heads", Scalar("int32")),
        ("causal", Scalar("int32")), ("has_mask", Scalar("int32"))), ("TM", "TN", "HP")),
}

# Variants: the same source compiled with other ct.kernel hints, each under its own name
# (`<kernel>_<variant>`); the default build has those the choices below name, a --sweep
# build every one for bench/cutile_sweep.py to compare. On sm_90,
# eight worker warps (three warp groups with the producer) remove the spills of the residual
# GEMM at 128x128 and of attention at 128x128 (head dims 64 and 128); occupancy 2 fits
# attention at 128x128 (head dim 32) and 128x64 (up to 64) in 128 registers, and with eight
# workers 128x64 (up to 64) in 80.
VARIANT_HINTS = {"w8": (("num_worker_warps", 8),), "occ2": (("occupancy", 2),),
                 "occ4": (("occupancy", 4),), "occ8": (("occupancy", 8),),
                 "occ2_w8": (("occupancy", 2), ("num_worker_warps", 8))}
GEMM_VARIANTS = ("w8", "occ2")
ATTENTION_VARIANTS = ("w8", "occ2", "occ2_w8")
NORM_VARIANTS = ("occ2", "occ4", "occ8")
# LayerNorm blocks run with occupancy 4 (at most 64 registers a thread): 2.1x faster than
# the plain kernel on the H200 (C11: 0.024 against 0.049 ms for 8192 rows of 1024, 0.022
# against 0.047 for 65536 of 128), which held 255 registers. Occupancy 8 with half the rows
# is 10% faster still but spills.
NORM_VARIANT = "occ4"
NORM_GEMM_VARIANTS = ("w8", "occ2")
VARIANT_GEMM_TILES = ((128, 128, 64), (128, 64, 64))
VARIANT_ATTENTION_TILES = ((128, 128), (128, 64))
VARIANT_HEAD_PADS = (32, 64, 128)
# Head dim 256 in the sweep: wider key tiles and more query rows, with eight workers.
SWEEP_HP256 = (((64, 32), ""), ((64, 64), ""), ((64, 64), "w8"), ((64, 32), "w8"),
               ((128, 32), "w8"), ((128, 64), "w8"))
# LayerNorm in the sweep: rows per block (times norm_rows) at the official shapes' widths.
SWEEP_NORM_WIDTHS = (128, 1024)
SWEEP_NORM_ROW_FACTORS = (0.5, 2, 4)
# linear_residual_norm in the sweep: rows per tile (K steps of NORM_GEMM_TILE[1]).
SWEEP_NORM_GEMM_ROWS = (128,)
for _base, _variants in (("linear_half", GEMM_VARIANTS), ("linear_gelu", GEMM_VARIANTS),
                         ("linear_gelu_half", GEMM_VARIANTS), ("linear_residual", GEMM_VARIANTS),
                         ("flash_attention", ATTENTION_VARIANTS),
                         ("layer_norm_split", NORM_VARIANTS),
                         ("layer_norm_out", (NORM_VARIANT,)),
                         ("layer_norm_half", (NORM_VARIANT,)),
                         ("linear_residual_norm", NORM_GEMM_VARIANTS),
                         ("block_narrow", ("w8",))):
    for _variant in _variants:
        KERNELS[f"{_base}_{_variant}"] = Kernel(
            KERNELS[_base].module, KERNELS[_base].params, KERNELS[_base].constants,
            function=_base, hints=VARIANT_HINTS[_variant])


def norm_rows(width_pad: int) -> int:
    """Rows per LayerNorm block for rows padded to width_pad columns (about 4096 elements)."""
    return max(1, min(32, 4096 // width_pad))


def norm_widths() -> list[int]:
    """Every padded LayerNorm width: the powers of two from 8 to MAX_ROW_WIDTH."""
    return [1 << i for i in range(3, MAX_ROW_WIDTH.bit_length())]


def variant_name(name: str, variant: str) -> str:
    """The kernel name of a variant of name (VARIANT_HINTS; "" is the kernel itself)."""
    return f"{name}_{variant}" if variant else name


# GEMM choices per kernel, ((TM, TN, TK), variant), largest first: a layer takes the first
# whose grid has at least half as many blocks as the device has multiprocessors (the last
# otherwise). Measured on the H200 (bench/PERFORMANCE.md C10): 128x128 is the fastest tile
# wherever it fills the device; eight worker warps speed up the GELU epilogue by 19-27% and
# remove the residual epilogue's spills at 128x128; 128x64 beats 64x64 on 64-128 blocks
# (for Q/K/V and GELU with eight workers: 35-47% faster than 128x64x32, the plain 128x64x64
# was not built for them). Q/K/V at 128x128 with occupancy 2 (C15): 12-36% faster than the
# plain kernel on every official Q/K/V GEMM; the GELU and residual GEMMs gain nothing.
GELU_CHOICES = (((128, 128, 64), "w8"), ((128, 64, 64), "w8"), ((64, 64, 32), ""))
GEMM_CHOICES = {
    "linear_half": (((128, 128, 64), "occ2"), ((128, 64, 64), "w8"), ((64, 64, 32), "")),
    "linear_gelu": GELU_CHOICES,
    "linear_gelu_half": GELU_CHOICES,  # the same GEMM and GELU, one fp16 output
    "linear_residual": (((128, 128, 64), "w8"), ((128, 64, 64), ""), ((64, 64, 32), "")),
}
# Products per kernel: Q/K/V one (its output is rounded to fp16 for attention anyway),
# the others one (activations rounded to fp16, as under fp16 autocast) or three (activations
# and weights split into fp16 pairs); linear_gelu_half one (it feeds a one-product ffn_out).
GEMM_PRODUCTS = {"linear_half": (1,), "linear_gelu": (1, 3), "linear_gelu_half": (1,),
                 "linear_residual": (1, 3)}
# Two products (activations split, weights rounded once): exported with --sweep only, for
# `cutile_sweep.py products` to weigh its time against its error.
SWEEP_PRODUCTS = (2,)


# Further tiles exported only for bench/cutile_sweep.py (`export --sweep`). On sm_90,
# 128x128 spills in the residual epilogue (11 stores) and in attention at head dim 128
# (341); 256x128 spills everywhere (234-3555) and is not exported.
SWEEP_GEMM_TILES = ((128, 128, 64), (128, 64, 32), (64, 128, 64), (64, 64, 64))
SWEEP_ATTENTION_TILES = ((128, 128), (128, 32), (64, 32))


# LayerNorm in the residual GEMMs' epilogue (CutileBackend(fuse_norms=True)): one tile holds
# whole rows, padded to NORM_GEMM_WIDTHS columns; 64 rows and K steps of 64.
NORM_GEMM_WIDTHS = (8, 16, 32, 64, 128)  # 256 spills registers on sm_90
NORM_GEMM_TILE = (64, 64)
# linear_residual_norm's variant per width: occupancy 2 at 128 (C11: 0.049 against 0.064 ms
# at 65536x128x128, three products); the other widths are unmeasured and stay plain.
NORM_GEMM_VARIANT = {128: "occ2"}
# The whole FFN in one kernel (CutileBackend(fuse_ffn=True)) at those widths: hidden columns
# made and consumed FFN_CHUNK at a time.
FFN_CHUNK = 32  # 64 spills 13-24 stores at width 128 on sm_90


# Spill stores accepted in the default build's sm_90 SASS, per symbol: whole-block kernels
# that spill a little and still beat the separate kernels (C15: shapes 9, 10 and 11).
SPILLS_ACCEPTED: dict[str, int] = {
    "block_narrow_SP128_QM64_DP128_HP8_FP128_PRODUCTS3": 32,
    "block_narrow_w8_SP128_QM64_DP128_HP64_FP128_PRODUCTS3": 2,
    "block_narrow_w8_SP128_QM64_DP128_HP128_FP128_PRODUCTS3": 58,
}


# Attention choices per padded head dim, ((TM, TN), variant): the first where the grid has
# fewer than two 128-query blocks per multiprocessor, the last otherwise. Measured on the
# H200 (C10): at head dims 32 and 64, 128x64 with occupancy 2 and eight worker warps is the
# fastest everywhere (0.127 against 0.199 ms at shape 13, 45 against 62 ms on one sequence
# of shape 14); at 128, 64x64 on few blocks and 128x64 with eight workers on many.
ATTENTION_CHOICES = {
    8: (((64, 64), ""), ((128, 128), "")),
    16: (((64, 64), ""), ((128, 128), "")),
    32: (((128, 64), "occ2_w8"),),
    64: (((128, 64), "occ2_w8"),),
    128: (((64, 64), ""), ((128, 64), "w8")),
    256: (((128, 64), "w8"),),  # C11: 0.036 against 64x32's 0.050 ms at shape 8
}


# The whole-block kernel: query rows per block (fewer where the sequence is shorter), and
# its limits: rows padded to at most 128, d_model and ffn_dim at most 128, power-of-two heads
# of at least 8. The default build has it for the official shapes that fit
# ((seq_len, d_model, head dim, ffn_dim) below, at three products), a --sweep build also for
# SWEEP_BLOCKS at both lengths; other fits compile with the JIT.
BLOCK_ROWS = 64
BLOCK_MAX = 128
BUILD_BLOCKS = ((128, 128, 32, 128), (32, 128, 32, 128), (128, 32, 8, 32),
                (128, 128, 128, 128), (128, 128, 64, 128), (128, 128, 8, 128))
SWEEP_BLOCKS = ((128, 32, 128), (128, 64, 128), (128, 128, 128), (128, 8, 128), (32, 8, 32))
SWEEP_BLOCK_SEQS = (32, 128)


def block_constants(seq_len: int, d_model: int, num_heads: int, ffn_dim: int,
                    products: int) -> dict[str, int] | None:
    """The whole-block kernel's constants for these sizes, or None where it does not fit."""
    head_dim = d_model // num_heads if num_heads else 0
    fits = (seq_len <= BLOCK_MAX and d_model <= BLOCK_MAX and ffn_dim <= BLOCK_MAX
            and head_dim * num_heads == d_model and head_dim >= 8
            and head_dim & (head_dim - 1) == 0)
    if not fits:
        return None
    sp = max(32, 1 << (seq_len - 1).bit_length())
    pad = max(8, 1 << (d_model - 1).bit_length())
    return {"SP": sp, "QM": min(BLOCK_ROWS, sp), "DP": pad, "HP": head_dim,
            "FP": max(8, 1 << (ffn_dim - 1).bit_length()), "PRODUCTS": products}


def block_kernel(constants: dict[str, int]) -> str:
    """The whole-block kernel's name for its constants: with eight worker warps, except at
    d_model 32 or head dim 8 over 128 rows, where the plain kernel spills less. sm_90 spill
    stores, plain / eight workers: 128 rows x d_model 128 at head dim 32 87 / 0, 64 217 / 2,
    128 355 / 58, 8 32 / 232; 32 rows at head dim 8 698 / 197; d_model 32 0 / 78."""
    plain = constants["DP"] <= 32 or (constants["HP"] == 8 and constants["SP"] >= 128)
    return "block_narrow" if plain else "block_narrow_w8"


def sweep_gemm_choices(name: str) -> tuple:
    """Every ((TM, TN, TK), variant) a --sweep build has for GEMM kernel name."""
    return tuple(dict.fromkeys(
        GEMM_CHOICES[name] + tuple((t, "") for t in SWEEP_GEMM_TILES)
        + tuple((t, v) for v in GEMM_VARIANTS for t in VARIANT_GEMM_TILES)))


def sweep_attention_choices(head_pad: int) -> tuple:
    """Every ((TM, TN), variant) a --sweep build has for attention at a padded head dim."""
    choices = ATTENTION_CHOICES[head_pad]
    if head_pad <= 128:
        choices += tuple((t, "") for t in SWEEP_ATTENTION_TILES)
    if head_pad in VARIANT_HEAD_PADS:
        choices += tuple((t, v) for v in ATTENTION_VARIANTS for t in VARIANT_ATTENTION_TILES)
    if head_pad == 256:
        choices += SWEEP_HP256
    return tuple(dict.fromkeys(choices))


def sweep_norm_rows(width_pad: int) -> tuple[int, ...]:
    """LayerNorm rows per block a --sweep build has at a padded width (SWEEP_NORM_WIDTHS)."""
    base = norm_rows(width_pad)
    return tuple(dict.fromkeys([base] + [max(1, int(base * f))
                                         for f in SWEEP_NORM_ROW_FACTORS]))


def sweep_norm_gemm_choices() -> tuple:
    """(rows per tile, variant) of linear_residual_norm a --sweep build has (three
    products, every width)."""
    return tuple(itertools.product((NORM_GEMM_TILE[0],) + SWEEP_NORM_GEMM_ROWS,
                                   ("",) + NORM_GEMM_VARIANTS))


def specialisations(sweep: bool = False) -> list[tuple[str, dict[str, int]]]:
    """Every (kernel name, constants) the backend may launch (with sweep, also the
    candidates bench/cutile_sweep.py compares)."""
    out = []
    for name in ("layer_norm_split", "layer_norm_half", "layer_norm_out"):
        out += [(variant_name(name, NORM_VARIANT), {"BM": norm_rows(w), "BD": w})
                for w in norm_widths()]
    if sweep:
        out += [(variant_name("layer_norm_split", v), {"BM": bm, "BD": w})
                for w in SWEEP_NORM_WIDTHS for v in ("",) + NORM_VARIANTS
                for bm in sweep_norm_rows(w)]
    extra = SWEEP_PRODUCTS if sweep else ()
    for name, counts in GEMM_PRODUCTS.items():
        choices = sweep_gemm_choices(name) if sweep else GEMM_CHOICES[name]
        counts = counts + (extra if len(counts) > 1 else ())
        for ((tm, tn, tk), variant), p in itertools.product(choices, counts):
            out.append((variant_name(name, variant), {"TM": tm, "TN": tn, "TK": tk,
                                                      "PRODUCTS": p}))
    tm, tk = NORM_GEMM_TILE
    for width, p in itertools.product(NORM_GEMM_WIDTHS,
                                      GEMM_PRODUCTS["linear_residual"] + extra):
        out.append((variant_name("linear_residual_norm", NORM_GEMM_VARIANT.get(width, "")),
                    {"TM": tm, "TN": width, "TK": tk, "PRODUCTS": p}))
        out.append(("ffn_residual_norm", {"TM": tm, "TN": width, "TF": FFN_CHUNK,
                                          "PRODUCTS": p}))
    if sweep:
        out += [(variant_name("linear_residual_norm", v),
                 {"TM": rows, "TN": width, "TK": tk, "PRODUCTS": 3})
                for width in NORM_GEMM_WIDTHS for rows, v in sweep_norm_gemm_choices()]
    blocks = list(BUILD_BLOCKS)
    if sweep:
        blocks += [(seq_len, dp, hp, fp) for (dp, hp, fp), seq_len
                   in itertools.product(SWEEP_BLOCKS, SWEEP_BLOCK_SEQS)]
    for seq_len, dp, hp, fp in blocks:
        constants = block_constants(seq_len, dp, dp // hp, fp, 3)
        out.append((block_kernel(constants), constants))
    for hp in HEAD_PADS:
        choices = sweep_attention_choices(hp) if sweep else ATTENTION_CHOICES[hp]
        out += [(variant_name("flash_attention", variant), {"TM": tm, "TN": tn, "HP": hp})
                for (tm, tn), variant in choices]
    unique = dict.fromkeys((name, tuple(constants.items())) for name, constants in out)
    return [(name, dict(constants)) for name, constants in unique]


def symbol(name: str, constants: dict[str, int]) -> str:
    """The exported symbol of a specialisation, e.g. linear_half_TM64_TN64_TK32_PRODUCTS1."""
    return "_".join([name] + [f"{k}{constants[k]}" for k in KERNELS[name].constants])


def source_hash() -> str:
    """A hash of the kernel sources, this table and the export step (which sets what each
    kernel may assume of its arrays): a build is valid only for this hash."""
    h = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.py")) + [Path(__file__), Path(__file__).with_name(
            "export.py")]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
