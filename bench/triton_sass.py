"""Compile the Triton kernels for sm_90 (Hopper) without a GPU and read what came out.

For the configurations the official shapes use, each kernel is compiled ahead of time for
sm_90 with the launch's tile sizes, warps and stages; cuobjdump then reports its registers
and stack (spills), Triton its shared memory, and its SASS is searched for tensor-core
instructions (HGMMA: warpgroup MMA, HMMA: warp MMA) and 16-byte global loads (LDG.E.128 or
LDGSTS.E.BYPASS.128).

    python bench/triton_sass.py            # the table
    python bench/triton_sass.py --check    # exit 1 if a kernel spills or misses its MMA

Triton's interpreter must be off (TRITON_INTERPRET unset); ptxas and cuobjdump come with
Triton's NVIDIA backend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from layerbench.backends.triton import attention, launch, linear, narrow_block, norm
from layerbench.backends.triton.layer import DEFAULT_PRECISION

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass import kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@dataclass
class Case:
    """One kernel specialisation: argument types (or constexpr values), warps, stages."""

    label: str
    fn: object
    args: dict
    warps: int
    stages: int
    needs: str  # "HGMMA", "MMA" (HGMMA or HMMA) or "" (no tensor-core work)


def _ptrs(names, dtype):
    return {n: f"*{dtype}" for n in names.split()}


def cases() -> list[Case]:
    """The specialisations the official shapes launch (shape in the label)."""
    bm, bn, bk, w, st = linear.split_tile_config(8192, 1024, 1024)
    split_common = {**_ptrs("a_hi_ptr a_lo_ptr w_hi_ptr w_lo_ptr", "fp16"),
                    "bias_ptr": "*fp32", "res_ptr": "*fp32", "valid_ptr": "*u8",
                    "M": "i32", "N": "i32", "K": "i32", "GROUP_M": 8, "PRODUCTS": 3,
                    "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    tiles = narrow_block.block_config()
    return [
        Case("split_linear residual (8, 14)", linear.split_linear_kernel,
             {**split_common, "out_ptr": "*fp32", "out_lo_ptr": "*fp32", "GELU": False,
              "RESIDUAL": True, "ZERO_MODE": 2, "HAS_VALID": True, "SPLIT_OUT": False}, w, st,
             "HGMMA"),
        Case("split_linear GELU pair (8, 14)", linear.split_linear_kernel,
             {**split_common, "out_ptr": "*fp16", "out_lo_ptr": "*fp16", "GELU": True,
              "RESIDUAL": False, "ZERO_MODE": 0, "HAS_VALID": False, "SPLIT_OUT": True}, w, st,
             "HGMMA"),
        Case("split_linear QKV, one fp16 product (8, 14)", linear.split_linear_kernel,
             {**split_common, "out_ptr": "*fp16", "out_lo_ptr": "*fp16", "GELU": False,
              "RESIDUAL": False, "ZERO_MODE": 0, "HAS_VALID": False, "SPLIT_OUT": False,
              "PRODUCTS": 1}, w, st, "HGMMA"),
        *(Case(f"flash_attention hd {hd} ({shapes})", attention.flash_attention_kernel,
               {"qkv_ptr": "*fp16", "ctx_ptr": "*fp16", "ctx_lo_ptr": "*fp16",
                "valid_ptr": "*u8", "key_end_ptr": "*i32", "S": "i32", "H": "i32", "D": "i32",
                "qk_scale": "fp32", "HEAD_DIM": hd, "HEAD_PAD": hd, "HAS_VALID": True,
                "SPLIT_OUT": True, "PRECISION": "fp16", "BLOCK_M": att.block_m,
                "BLOCK_N": att.block_n, "PDL": launch.dependent_launch()["PDL"], "CAUSAL": True},
               att.warps, att.stages, "MMA")
          for hd, shapes, att in (
              (64, "14", attention.AttentionTiles(*attention.attention_config(64, "fp16"))),
              (32, "1, 5, 6, 13: 64 rows",
               attention.AttentionTiles(*narrow_block.apart_attention_tiles(64))),
              (32, "2-4, 12: 16 rows",
               attention.AttentionTiles(*narrow_block.apart_attention_tiles(16))))),
        Case("norm_qkv d 128, 64 rows (1, 5, 6, 9-11, 13)", narrow_block.norm_qkv_kernel,
             {"x_ptr": "*fp32", "qkv_ptr": "*fp16", **_ptrs("n1_w n1_b bq_ptr", "fp32"),
              **_ptrs("wq_hi wq_lo", "fp16"), "M": "i32", "D": "i32", "eps": "fp32",
              "D_PAD": 128, "BLOCK_M": 64, "PARTS": 3,
              "PRODUCTS": DEFAULT_PRECISION.qkv_products,
              "PDL": launch.dependent_launch()["PDL"]}, 4, 1,
             "MMA"),
        *(Case(f"attention_ffn d 128, hd 32 ({label})", narrow_block.attention_ffn_kernel,
               {"qkv_ptr": "*fp16", "ctx_hi_ptr": "*fp16", "ctx_lo_ptr": "*fp16",
                "x_ptr": "*fp32", "out_ptr": "*fp32", "valid_ptr": "*u8", "key_end_ptr": "*i32",
                **_ptrs("wo_hi wo_lo wi_hi wi_lo wf_hi wf_lo", "fp16"),
                **_ptrs("bo_ptr n2_w n2_b bi_ptr bf_ptr fn_w fn_b", "fp32"),
                "S": "i32", "D": "i32", "F": "i32", "qk_scale": "fp32",
                "eps": "fp32", "H": 4, "HEAD_DIM": 32, "HEAD_PAD": 32, "D_PAD": 128, "F_PAD": 128,
                "HAS_VALID": True, "FINAL": False, "ATT_PRECISION": "fp16",
                "BLOCK_M": block_m, "BLOCK_N": tiles.block_n, "F_CHUNK": f_chunk,
                "CTX_IN_MEMORY": apart, "PDL": launch.dependent_launch()["PDL"],
                "CAUSAL": True},
               tiles.warps, tiles.stages, "MMA")
          for label, f_chunk, apart, block_m in (
              ("1, 5, 6, 13: 64 rows", tiles.ffn_chunk, True, tiles.block_m),
              ("2-4, 12: 16 rows", tiles.ffn_chunk, True, 16),
              ("32 rows", tiles.ffn_chunk, True, 32),
              ("heads in the program", tiles.ffn_chunk, False, tiles.block_m),
              ("heads in the program, FFN chunk 32", 32, False, tiles.block_m))),
        Case("layer_norm pair d 1024 (8, 14)", norm.layer_norm_kernel,
             {"x_ptr": "*fp32", "out_ptr": "*fp16", "out_lo_ptr": "*fp16", "w_ptr": "*fp32",
              "b_ptr": "*fp32", "valid_ptr": "*u8", "M": "i32", "D": "i32", "eps": "fp32",
              "HAS_VALID": False, "SPLIT_OUT": True, "ROWS": 4, "BLOCK_D": 1024}, 4, 1, ""),
    ]


def compile_case(case: Case):
    """The sm_90 compiled kernel of one specialisation (pointers and integers 16-aligned)."""
    names = case.fn.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for name in names:
        value = case.args[name]
        if isinstance(value, str) and (value.startswith("*") or value in ("i32", "fp32")):
            signature[name] = value
            if value.startswith("*") or value == "i32":
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
            constexprs[name] = value
    source = ASTSource(fn=case.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": case.warps, "num_stages": case.stages})


def inspect_kernel(kernel) -> dict:
    """Registers, stack (spill) bytes, shared bytes and instruction counts of a kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        (info,) = kernels(fh.name).values()
    return {key: info[key] for key in ("registers", "stack_bytes", "HGMMA", "HMMA", "load128",
                                       "spill_stores")} | {"shared_bytes": kernel.metadata.shared}


def problems(case: Case, info: dict) -> list[str]:
    """What a kernel's cubin lacks: no spills, and its tensor-core instructions."""
    found = []
    if info["stack_bytes"] or info["spill_stores"]:
        found.append(f"spills: {info['stack_bytes']} stack bytes, {info['spill_stores']} STL")
    if case.needs == "HGMMA" and not info["HGMMA"]:
        found.append("no HGMMA")
    if case.needs == "MMA" and not (info["HGMMA"] or info["HMMA"]):
        found.append("no tensor-core instruction")
    return found


def main() -> int:
    """Print the table; with --check, exit 1 when a kernel has a problem."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    print("| kernel (shapes) | warps | stages | registers | stack bytes | shared bytes | "
          "HGMMA | HMMA | 16-byte loads | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = False
    rows = []
    for case in cases():
        info = inspect_kernel(compile_case(case))
        found = problems(case, info)
        failed |= bool(found)
        rows.append({"kernel": case.label, "needs": case.needs, "problems": found, **info})
        print(f"| {case.label} | {case.warps} | {case.stages} | {info['registers']} | "
              f"{info['stack_bytes']} | {info['shared_bytes']} | {info['HGMMA']} | "
              f"{info['HMMA']} | {info['load128']} | {'; '.join(found) or '-'} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
