"""Comparisons of the cupy backend on a GPU: whole-layer plans of one option (both built on the
same inputs, checked against one reference and timed in alternating rounds), and attention
and GEMM kernel sweeps.

    python bench/cupy_sweep.py plans --plan wgmma --shapes 8,13,6,1   # wgmma kernels on / off
    python bench/cupy_sweep.py plans --plan norm_prologue --shapes 2,5,1,13
        # norm1 and norm2 in the prologues of Q/K/V and ffn_in on / off (where the norms
        # are not fused by default: shape 13 fuses them, so both of its plans are one)
    python bench/cupy_sweep.py plans --plan pdl --shapes 2,5,1,3,8,13
        # programmatic dependent launches on / off
    python bench/cupy_sweep.py plans --plan staged_epilogue --shapes 13,5,1,2,6,8
        # the GEMM epilogues through shared memory on / off (short_norm_gemm likewise)
    python bench/cupy_sweep.py plans --plan "wgmma 128x256 TMA" --shapes 8  # a GEMM variant / default
    python bench/cupy_sweep.py plans --plan "attention:wgmma 64x64 4/SM" --shapes 13
        # an attention variant against the default attention
    python bench/cupy_sweep.py sources --baseline DIR --shapes 13,6,1
        # this tree's kernel sources against those in DIR (e.g. `git archive REV
        # backends/cupy | tar -x -C DIR`, then DIR/backends/cupy), the same options; both
        # compiled with this tree's name expressions (build.py), so DIR's sources must define
        # every kernel they name
    python bench/cupy_sweep.py products --shapes 13,6 --products 1,2,3  # out_proj and FFN
    python bench/cupy_sweep.py attention --batch 1 --seq-len 100000 --heads 16 --head-dim 64
        # the mma.sync attention kernel and every wgmma variant of the head dim on one input:
        # ms, TFLOP/s, error (--repeats 10 on small inputs: launches replayed from a graph)
    python bench/cupy_sweep.py gemm --epilogue half
        # every wgmma GEMM variant (and torch's fp16 matmul) on the GEMM sizes of shapes 8 and
        # 14 at one product: ms, TFLOP/s, max relative error against an fp32 matmul
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

from layerbench.backends.cupy import CupyBackend, build, ops
from layerbench.common import runner
from layerbench.common.timing import alternating_medians_ms, replayed

# M x N x K of shape 8's GEMMs (8192 tokens: Q/K/V, then out_proj and the FFN at d_model =
# ffn = 1024) and of one 100000-token sequence of shape 14 (Q/K/V)
GEMM_SIZES = "8192x3072x1024,8192x1024x1024,100000x3072x1024"


ATTENTION_PLAN = "attention:"  # --plan's prefix naming an attention variant


def plan_backend(plan: str, on: bool) -> CupyBackend:
    """The backend with option plan on or off; a GEMM variant's name as plan: that variant
    against the default GEMMs; ATTENTION_PLAN and an attention variant's name (some names
    are both): that variant against the default attention."""
    if plan.startswith(ATTENTION_PLAN):
        variant = plan[len(ATTENTION_PLAN):]
        return CupyBackend(attention_variant=variant if on else None)
    if plan in build.gemm_variant_names():
        return CupyBackend(gemm_variant=plan if on else None)
    return CupyBackend(**{plan: on})


@contextlib.contextmanager
def kernel_sources(folder: str | None):
    """While the body runs, kernels are compiled from the sources in folder (a module of
    their own; None: this tree's); this tree's again after it."""
    saved = build.SOURCE_DIR
    if folder is not None:
        if not (Path(folder) / build.SOURCES[0]).exists():
            raise SystemExit(f"{folder} holds no {build.SOURCES[0]}")
        build.SOURCE_DIR = Path(folder).resolve()
    build.module_for.cache_clear()
    ops.kernels_for.cache_clear()
    try:
        yield
    finally:
        build.SOURCE_DIR = saved
        build.module_for.cache_clear()
        ops.kernels_for.cache_clear()


def sweep(args) -> list[dict] | None:
    """The rows of the comparison asked for, or None where it cannot run here."""
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    why = CupyBackend().unavailable_reason(device)
    if why:
        print(f"cupy: {why}", file=sys.stderr)
        return None
    if args.what == "attention":
        return sweep_attention(args, device)
    if args.what == "gemm":
        return sweep_gemm(args, device)
    if args.what == "plans":
        return runner.compare_plans(
            args.shapes,
            lambda on, cfg, sd: plan_backend(args.plan, on).build(cfg, sd, device=device),
            padding=args.padding, rounds=args.rounds, device=device, label=args.plan)
    if args.what == "sources":
        if not args.baseline:
            raise SystemExit("sources needs --baseline DIR")

        def build_from(folder, cfg, sd):
            with kernel_sources(None if folder == "this tree" else folder):
                return CupyBackend().build(cfg, sd, device=device)

        return runner.compare_plans(args.shapes, build_from, plans=("this tree", args.baseline),
                                    padding=args.padding, rounds=args.rounds, device=device,
                                    label="sources")
    return runner.compare_plans(
        args.shapes,
        lambda n, cfg, sd: CupyBackend(linear_products=n).build(cfg, sd, device=device),
        plans=tuple(int(p) for p in args.products.split(",")), padding=args.padding,
        rounds=args.rounds, device=device, label="products")


def sweep_attention(args, device) -> list[dict]:
    """The mma.sync attention kernel and, where the head dim has the wgmma kernel, each of its
    variants (build.ATTENTION_WGMMA, by name) that takes the head dim."""
    kernels = ops.kernels_for(device)
    shape = dict(batch=args.batch, seq_len=args.seq_len, num_heads=args.heads,
                 head_dim=args.head_dim, causal=not args.full)

    def kernel(wgmma: bool, variant: str | None = None):
        return lambda qkv, ctx: ops.attention(kernels, qkv, ctx, None, None, wgmma=wgmma,
                                              variant=variant, **shape)
    choices = {"mma.sync": kernel(False)}
    wide = ops.wgmma_attention_pad(args.head_dim)
    if kernels.has_wgmma and not kernels.wgmma_problem and wide:
        for v in build.ATTENTION_WGMMA[wide]:
            if not v.refusal(args.head_dim, wide):  # the TMA ring runs head dim 64 only
                choices[v.name] = kernel(True, v.name)
    return runner.compare_attention_kernels(
        choices, batch=args.batch, seq_len=args.seq_len, heads=args.heads,
        head_dim=args.head_dim, causal=not args.full, rounds=args.rounds, device=device,
        label="cupy attention", repeats=args.repeats or 1)


def sweep_gemm(args, device) -> list[dict]:
    """Every wgmma GEMM variant (build.GEMM_VARIANTS, the first the plain schedule, the layer's
    own build.LAYER_GEMM_VARIANT among them) and, for the half epilogue, torch's fp16 matmul
    (cuBLAS, bias in fp16) on each M x N x K of args.sizes at one product with epilogue
    args.epilogue, each replayed --repeats times (20) from a CUDA graph and timed in
    alternating rounds; error: the largest |got - want| / max(|want|, 1) against torch's fp32
    matmul of the same fp16 operands, through the epilogue in fp32."""
    kernels = ops.kernels_for(device)
    if not kernels.has_wgmma or kernels.wgmma_problem:
        print(f"cupy gemm: no wgmma GEMMs here ({kernels.wgmma_problem or kernels.arch})",
              file=sys.stderr)
        return []
    epilogue, rows = args.epilogue, []
    for size in args.sizes.split(","):
        m, n, k = (int(x) for x in size.split("x"))
        gen = torch.Generator(device=device).manual_seed(m + n + k)
        a = torch.randn(m, k, device=device, generator=gen).half()
        w = (torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)).half()
        bias = torch.randn(n, device=device, generator=gen)
        res = None
        matmul = torch.backends.cuda.matmul
        tf32, matmul.allow_tf32 = matmul.allow_tf32, False
        want = a.float() @ w.float().t() + bias  # full fp32, not TF32
        matmul.allow_tf32 = tf32
        if epilogue == "gelu_pair":
            want = torch.nn.functional.gelu(want)
        elif epilogue == "residual":
            res = torch.randn(m, n, device=device, generator=gen)
            want += res

        def variant_run(name: str):
            """(output, a run of the wgmma GEMM of variant name writing it)."""
            if epilogue == "residual":  # out = res + ..., out of place: every run the same
                out = torch.empty(m, n, device=device)
                kw = {"res": res, "out": out}
            else:
                out = torch.empty(m, n, device=device, dtype=torch.float16)
                kw = {"out_half": out} if epilogue == "half" else {"out_pair": (out, None)}
            return out, lambda: ops.linear(kernels, (a, None), (w, None), bias, epilogue, 1,
                                           wgmma=True, gemm_variant=name, **kw)
        choices = {v.name: variant_run(v.name) for v in build.GEMM_VARIANTS}
        if epilogue == "half":
            out16, bias16 = torch.empty(m, n, device=device, dtype=torch.float16), bias.half()
            choices["torch fp16 (cuBLAS)"] = (
                out16, lambda: torch.addmm(bias16, a, w.t(), out=out16))
        repeats = args.repeats or 20
        runs = [replayed(run, repeats, device) for _, run in choices.values()]
        medians = alternating_medians_ms(runs, device, rounds=args.rounds)
        flop = 2.0 * m * n * k
        for (name, (out, _)), total in zip(choices.items(), medians):
            ms = total / repeats
            err = ((out.float() - want).abs() / want.abs().clamp_min(1.0))
            err = err.nan_to_num(nan=math.inf).max().item()
            rows.append({"size": size, "epilogue": epilogue, "kernel": name, "ms": ms,
                         "tflops": flop / ms / 1e9, "max_rel": err})
            print(f"cupy gemm {size:18s} {epilogue:9s} {name:38s} {ms:8.4f} ms "
                  f"{flop / ms / 1e9:6.1f} TFLOP/s max rel {err:.1e}", flush=True)
        del choices, runs, want
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["plans", "sources", "products", "attention", "gemm"])
    parser.add_argument("--shapes", default="1,2,7,8,13,6", help="official shape numbers")
    parser.add_argument("--plan", choices=["wgmma", "fuse_norms", "norm_prologue", "pdl",
                                           "staged_epilogue", "short_norm_gemm",
                                           "context_hi_only", "eight_lane_rows",
                                           "whole_block", "after_attention",
                                           *build.gemm_variant_names(),
                                           *(ATTENTION_PLAN + n
                                             for n in build.attention_variant_names())],
                        default="wgmma",
                        help="plans: the option (or GEMM variant: \"wgmma 128x128\" forces "
                             "the plain schedule; or \"attention:\" and an attention "
                             "variant) compared on against off (the default)")
    parser.add_argument("--baseline", help="sources: the folder of the baseline's kernel "
                                           "sources (*.cu, *.cuh)")
    parser.add_argument("--products", default="1,3",
                        help="products: the counts compared (two or more of 1, 2, 3)")
    parser.add_argument("--padding", type=float, default=0.0, help="padding ratio")
    parser.add_argument("--batch", type=int, default=1, help="attention: sequences")
    parser.add_argument("--seq-len", type=int, default=100000, help="attention: tokens each")
    parser.add_argument("--heads", type=int, default=16, help="attention: heads")
    parser.add_argument("--head-dim", type=int, default=64, help="attention: head dim")
    parser.add_argument("--full", action="store_true", help="attention: not causal")
    parser.add_argument("--sizes", default=GEMM_SIZES, help="gemm: MxNxK, comma-separated")
    parser.add_argument("--epilogue", choices=list(build.GEMM_VARIANT_EPILOGUES),
                        default="half", help="gemm: the epilogue timed")
    parser.add_argument("--repeats", type=int,
                        help="launches per CUDA-graph replay timed (gemm: 20 by default; "
                             "attention: 1, each launch timed alone, by default)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = sweep(args)
    if rows is not None and args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 2 if rows is None else 0


if __name__ == "__main__":
    sys.exit(main())
