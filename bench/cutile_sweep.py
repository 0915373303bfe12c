"""Kernel-level sweeps of the cutile backend on a GPU: GEMM, attention, LayerNorm and
residual-norm tiles and compiler-hint variants on the same inputs, timed in alternating
rounds (CUDA events, median; with --repeats above 1 each timed call replays a CUDA graph of
that many launches, so the host's time between launches stays out), each output checked.

    python -m layerbench.backends.cutile.export --arch sm_90 --sweep --out build/cutile
    python bench/cutile_sweep.py gemm                  # the linears of shapes 8, 6, 13, 5, 1
    python bench/cutile_sweep.py gemm --cases 8192x1024x1024:1:residual
    python bench/cutile_sweep.py attention --batch 1 --seq-len 100000 --heads 16 --head-dim 64
    python bench/cutile_sweep.py plans --shapes 1,2,7,13  # fuse_norms on against off
    python bench/cutile_sweep.py plans --plan ffn         # fuse_ffn on against off
    python bench/cutile_sweep.py plans --plan lean --shapes 8,5  # lean_pairs on against off
    python bench/cutile_sweep.py plans --plan pdl --shapes 2,1,13  # programmatic launches
    python bench/cutile_sweep.py plans --plan block --shapes 2,1,7,12  # whole-block kernel
    python bench/cutile_sweep.py products --shapes 8,13 --products 1,3  # out_proj and FFN
    python bench/cutile_sweep.py norm                  # LayerNorm rows per block, occupancy
    python bench/cutile_sweep.py residual-norm         # linear_residual_norm rows, variants
    python bench/cutile_sweep.py sass [--arch sm_90]  # no GPU needed: the build's SASS

"plans" builds the layer with fuse_norms (--plan ffn: fuse_ffn, lean: lean_pairs, pdl: pdl,
block: fuse_block) on and off, checks both against one reference and times them in
alternating rounds; "products" does the same for two counts of fp16 products in out_proj
and the FFN (a --sweep build has 1, 2 and 3).
"sass" prints, per kernel of the build ($LAYERBENCH_CUTILE_BUILD or the default root),
registers, stack bytes, HGMMA, 16- and 2-byte load counts and spill stores
(cuobjdump -sass), without a GPU.
A GEMM case is MxNxK:products:kind (kind half, gelu or residual); TFLOP/s count every fp16
product. The sweep tiles need a build exported with --sweep; tiles missing from the build
are reported and skipped. Attention is checked against fp32 attention where the sequence is
at most 4096 long, and between tiles (against the first) above that.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from layerbench.backends.cutile import CutileBackend, ops, specs
from layerbench.common import runner
from layerbench.common.cuda_host import split_fp16, weight_pair
from layerbench.common.errors import Unsupported
from layerbench.common.timing import alternating_medians_ms, replayed
from layerbench.reference import packed_attention

GEMM_CASES = (
    "8192x3072x1024:1:half",        # shape 8 Q/K/V
    "8192x1024x1024:1:residual",    # shape 8 out_proj / ffn_out
    "8192x1024x1024:1:gelu",        # shape 8 ffn_in
    "65536x384x128:1:half",         # shape 13 Q/K/V
    "16384x384x128:1:half",         # shape 5 Q/K/V
    "16384x128x128:3:gelu",         # shape 5 ffn_in
    "1280000x384x128:1:half",       # shape 6 Q/K/V
    "1280000x128x128:3:residual",   # shape 6 out_proj / ffn_out
    "65536x128x128:3:gelu",         # shape 13 ffn_in
    "8192x384x128:1:half",          # shape 1 Q/K/V (the small tile)
    "8192x128x128:3:residual",      # shape 1 out_proj / ffn_out
)
NORM_CASES = ("8192x1024", "65536x128")             # shapes 8 and 13
RESIDUAL_NORM_CASES = ("65536x128x128", "8192x32x32")  # shapes 13 and 7
# A GEMM tile whose largest relative error passes this computes something else (a correct
# tile stays near 1e-3: fp16 inputs of the one-product kernel, fp16 pairs otherwise).
WRONG_GEMM_ERROR = 1e-2


def _timed(run, repeats, label):
    """run itself (repeats 1) or a replayed graph of `repeats` runs, tried once and synced
    so that a launch that faults is named here rather than in the timing rounds."""
    timed = replayed(run, repeats, "cuda") if repeats > 1 else run
    try:
        timed()
        torch.cuda.synchronize()
    except Exception:
        print(f"{label}: failed on its first timed call", file=sys.stderr, flush=True)
        raise
    return timed


def _gemm_call(kernels, kind, m, n, k, products, tile, variant, gen):
    """(run, check) closures of one GEMM case on fresh operands."""
    a = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)
    bias = torch.randn(n, device="cuda", generator=gen)
    a_pair = split_fp16(a)
    w_pair = weight_pair(w)
    res = torch.randn(m, n, device="cuda", generator=gen)
    if kind == "half":
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        run = lambda: ops.linear_half(kernels, a_pair, w_pair, bias, out, tile,  # noqa: E731
                                      variant)
        got = lambda r: out[r].float()  # noqa: E731
        want = lambda r: a_pair[0][r].float() @ w_pair[0][:n, :k].float().t() + bias  # noqa: E731
    elif kind == "gelu":
        pair = (torch.empty(m, n, device="cuda", dtype=torch.float16),
                torch.empty(m, n, device="cuda", dtype=torch.float16))
        run = lambda: ops.linear_gelu(kernels, a_pair, w_pair, bias, pair, products,  # noqa
                                      tile, variant)
        got = lambda r: pair[0][r].float() + pair[1][r].float()  # noqa: E731
        want = lambda r: torch.nn.functional.gelu(a[r] @ w.t() + bias)  # noqa: E731
    else:
        out = torch.empty(m, n, device="cuda")
        run = lambda: ops.linear_residual(kernels, a_pair, w_pair, bias, res, None, out,  # noqa
                                          products, zero_sum=False, tile=tile,
                                          variant=variant)
        got = lambda r: out[r]  # noqa: E731
        want = lambda r: res[r] + a[r] @ w.t() + bias  # noqa: E731

    def check() -> float:
        rows = torch.unique(torch.cat([torch.arange(min(m, 2048)),
                                       torch.arange(max(m - 2048, 0), m)])).cuda()
        run()
        g, e = got(rows).double(), want(rows).double()
        return ((g - e).abs() / e.abs().clamp_min(1.0)).max().item()
    return run, check


def _checked_medians(calls, case, rounds, repeats):
    """(key, error, median ms per launch) of each (run, check) in calls that the build has:
    checked once, then timed in alternating rounds (graphs of `repeats` launches)."""
    runs, kept = [], []
    for key, (run, check) in calls.items():
        try:
            err = check()
        except Unsupported as exc:
            print(f"{case} {key}: not in this build ({exc})")
            continue
        runs.append(_timed(run, repeats, f"{case} {key}"))
        kept.append((key, err))
    medians = alternating_medians_ms(runs, "cuda", rounds=rounds)
    return [(key, err, ms / repeats) for (key, err), ms in zip(kept, medians)]


def _relative_error(got, want) -> float:
    """Largest |got - want| / max(|want|, 1) (inf where got is not finite)."""
    err = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1.0)
    return err.nan_to_num(nan=math.inf).max().item()


def sweep_norm(kernels, cases, rounds, repeats):
    """layer_norm_split at each rows x width case, for every rows per block and variant of
    the build: median ms per launch, GB/s (fp32 in, fp16 pair out), error."""
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for case in cases:
        m, n = (int(v) for v in case.split("x"))
        x = torch.randn(m, n, device="cuda", generator=gen) * 3 + 1
        w = torch.rand(n, device="cuda", generator=gen) + 0.5
        b = torch.randn(n, device="cuda", generator=gen)
        want = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double())
        width = ops.power_of_two_at_least(n)
        calls = {}
        for variant in ("",) + specs.NORM_VARIANTS:
            for bm in specs.sweep_norm_rows(width):
                pair = tuple(torch.empty(m, n, device="cuda", dtype=torch.float16)
                             for _ in range(2))
                run = (lambda p=pair, r=bm, v=variant:  # noqa: E731
                       ops.layer_norm_split(kernels, x, w, b, *p, rows=r, variant=v))
                check = (lambda p=pair, r=run:  # noqa: E731
                         (r(), _relative_error(p[0].float() + p[1].float(), want))[1])
                calls[(bm, variant)] = (run, check)
        for (bm, variant), err, ms in _checked_medians(calls, case, rounds, repeats):
            gbs = m * n * (4 + 4) / ms / 1e6
            rows_out.append({"case": case, "rows": bm, "variant": variant, "ms": ms,
                             "gb_per_s": gbs, "max_rel_error": err})
            print(f"norm {case:12s} rows {bm:3d} {variant or '-':5s}: {ms:8.4f} ms "
                  f"{gbs:7.0f} GB/s error {err:.2e}")
    return rows_out


def sweep_residual_norm(kernels, cases, rounds, repeats):
    """linear_residual_norm (three products, pair output) at each MxNxK case, for every
    rows per tile and variant of the build: median ms per launch and error."""
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for case in cases:
        m, n, k = (int(v) for v in case.split("x"))
        a = torch.randn(m, k, device="cuda", generator=gen)
        a_pair = split_fp16(a)
        w = torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)
        bias = torch.randn(n, device="cuda", generator=gen)
        res = torch.randn(m, n, device="cuda", generator=gen)
        norm = (torch.rand(n, device="cuda", generator=gen) + 0.5,
                torch.randn(n, device="cuda", generator=gen))
        rows = res.double() + a.double() @ w.double().t() + bias.double()
        want = torch.nn.functional.layer_norm(rows, (n,), norm[0].double(), norm[1].double())
        w_pair = weight_pair(w)
        calls = {}
        for tm, variant in specs.sweep_norm_gemm_choices():
            out = torch.empty(m, n, device="cuda")
            pair = tuple(torch.empty(m, n, device="cuda", dtype=torch.float16)
                         for _ in range(2))
            run = (lambda o=out, p=pair, t=(tm, specs.NORM_GEMM_TILE[1]), v=variant:  # noqa
                   ops.linear_residual_norm(kernels, a_pair, w_pair, bias, res, None, o, norm,
                                            products=3, zero_sum=False, pair=p, tile=t,
                                            variant=v))
            check = (lambda p=pair, r=run:  # noqa: E731
                     (r(), _relative_error(p[0].float() + p[1].float(), want))[1])
            calls[(tm, variant)] = (run, check)
        for (tm, variant), err, ms in _checked_medians(calls, case, rounds, repeats):
            rows_out.append({"case": case, "rows": tm, "variant": variant, "ms": ms,
                             "max_rel_error": err})
            print(f"residual_norm {case:16s} rows {tm:3d} {variant or '-':5s}: {ms:8.4f} ms "
                  f"error {err:.2e}")
    return rows_out


def sweep_gemm(kernels, cases, rounds, repeats):
    """Every GEMM tile of the build on each case: median ms per launch (each timed call
    replays a graph of `repeats` launches), TFLOP/s, max relative error."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in cases:
        size, products, kind = case.split(":")
        m, n, k = (int(v) for v in size.split("x"))
        products = int(products)
        kernel = {"half": "linear_half", "gelu": "linear_gelu"}.get(kind, "linear_residual")
        candidates = specs.sweep_gemm_choices(kernel)
        calls = {(tile, variant): _gemm_call(kernels, kind, m, n, k, products, tile, variant,
                                             gen) for tile, variant in candidates}
        for (tile, variant), err, ms in _checked_medians(calls, case, rounds, repeats):
            tflops = 2 * m * n * k * products / ms / 1e9
            rows.append({"case": case, "tile": list(tile), "variant": variant, "ms": ms,
                         "tflops": tflops, "max_rel_error": err})
            flag = "  WRONG" if not err < WRONG_GEMM_ERROR else ""
            print(f"{case:28s} tile {tile} {variant or '-':4s}: {ms:8.4f} ms "
                  f"{tflops:7.1f} TFLOP/s error {err:.2e}{flag}")
    return rows


def sweep_attention(kernels, batch, seq_len, heads, head_dim, causal, rounds, repeats):
    """Every attention tile of the build for this head dim: median ms per launch (a graph
    of `repeats` launches per timed call where repeats > 1), TFLOP/s, error."""
    d = heads * head_dim
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(batch * seq_len, 3 * d, device="cuda", generator=gen).half()
    view = qkv.view(batch, seq_len, 3 * heads, head_dim)
    hp = ops.power_of_two_at_least(head_dim)
    candidates = specs.sweep_attention_choices(hp)
    outs, runs, kept = [], [], []
    for tile, variant in candidates:
        ctx = tuple(torch.empty(batch * seq_len, d, device="cuda", dtype=torch.float16)
                    for _ in range(2))
        heads_view = [t.view(batch, seq_len, heads, head_dim) for t in ctx]
        run = (lambda hv=heads_view, t=tile, v=variant: ops.attention(
            kernels, view, hv, None, None, num_heads=heads, causal=causal, tile=t, variant=v))
        try:
            run()
        except Unsupported as exc:
            print(f"attention {tile} {variant}: not in this build ({exc})")
            continue
        runs.append(_timed(run, repeats, f"attention {tile} {variant}"))
        outs.append(ctx)
        kept.append((tile, variant))
    reference = None
    if seq_len <= 4096:
        everyone = torch.ones(batch, seq_len, dtype=torch.uint8, device="cuda")
        reference = packed_attention(qkv, everyone, batch=batch, seq_len=seq_len, heads=heads,
                                     causal=causal)[0].view(batch * seq_len, d)
    flops = 4 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    rows = []
    medians = alternating_medians_ms(runs, "cuda", rounds=rounds)
    for (tile, variant), ctx, ms in zip(kept, outs, medians):
        ms /= repeats
        got = ctx[0].float() + ctx[1].float()
        base = reference if reference is not None else outs[0][0].float() + outs[0][1].float()
        err = (got - base).abs().max().item()
        rows.append({"tile": list(tile), "variant": variant, "ms": ms,
                     "tflops": flops / ms / 1e9, "max_abs_error": err,
                     "against": "fp32" if reference is not None else f"tile {kept[0][0]}"})
        print(f"attention tile {tile} {variant or '-':7s}: {ms:9.3f} ms "
              f"{flops / ms / 1e9:7.1f} TFLOP/s error {err:.2e} ({rows[-1]['against']})")
    return rows


def sass_report(arch: str) -> dict[str, dict]:
    """Per kernel symbol of the build for arch: registers, stack, HGMMA, loads, spills."""
    from layerbench.backends.cutile import manifest

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass import kernels as sass_kernels

    found, why = manifest.load(arch)
    if found is None:
        raise SystemExit(f"cutile: {why}")
    folder = manifest.build_dir(arch)
    report = {}
    for cubin in sorted({e["cubin"] for e in found["entries"]}):
        report.update(sass_kernels(folder / cubin))
    for name, row in sorted(report.items()):
        print(f"{name:48s} regs {row['registers']:3d} stack {row['stack_bytes']:4d} "
              f"HGMMA {row['HGMMA']:4d} LDG.128 {row['load128']:4d} "
              f"LDG.U16 {row['load16']:3d} spills {row['spill_stores']}")
    return report


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["gemm", "attention", "norm", "residual-norm", "plans",
                                         "products", "sass"])
    parser.add_argument("--shapes", default="1,2,3,4,7,9,10,11,12,13,6",
                        help="plans: official shape numbers")
    parser.add_argument("--padding", type=float, default=0.0, help="plans: padding ratio")
    parser.add_argument("--plan", choices=["norms", "ffn", "lean", "pdl", "block"],
                        default="norms",
                        help="plans: the option compared on against off")
    parser.add_argument("--products", default="1,3", help="products: the two counts compared")
    parser.add_argument("--arch", default="sm_90", help="sass: the build's architecture")
    parser.add_argument("--cases", help="gemm: MxNxK:products:kind, norm: MxN, residual-norm:"
                        " MxNxK (comma-separated; default: the official shapes')")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="non-causal attention")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10,
                        help="kernel sweeps: launches per timed call (one CUDA graph)")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = sweep(args)
    if rows is None:
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def sweep(args):
    """The rows of the sweep args.what asks for (None, with why, where it cannot run)."""
    if args.what == "sass":
        return sass_report(args.arch)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    backend = CutileBackend("aot")
    why = backend.unavailable_reason(device)
    if why:
        print(f"cutile: {why}", file=sys.stderr)
        return None
    kernels = backend.kernels(device)
    if args.what == "plans":
        option = {"norms": "fuse_norms", "ffn": "fuse_ffn", "lean": "lean_pairs",
                  "pdl": "pdl", "block": "fuse_block"}[args.plan]
        return runner.compare_plans(
            args.shapes,
            lambda fuse, cfg, sd: CutileBackend("aot", **{option: fuse}).build(cfg, sd,
                                                                               device=device),
            padding=args.padding, rounds=args.rounds, device=device, label=option)
    if args.what == "products":
        return runner.compare_plans(
            args.shapes,
            lambda n, cfg, sd: CutileBackend("aot", linear_products=n).build(cfg, sd,
                                                                             device=device),
            plans=tuple(int(p) for p in args.products.split(",")), padding=args.padding,
            rounds=args.rounds, device=device, label="products")
    sweeps = {"gemm": (sweep_gemm, GEMM_CASES), "norm": (sweep_norm, NORM_CASES),
              "residual-norm": (sweep_residual_norm, RESIDUAL_NORM_CASES)}
    if args.what in sweeps:
        run, cases = sweeps[args.what]
        cases = args.cases.split(",") if args.cases else cases
        return run(kernels, cases, args.rounds, args.repeats)
    return sweep_attention(kernels, args.batch, args.seq_len, args.heads, args.head_dim,
                           not args.full, args.rounds, args.repeats)

if __name__ == "__main__":
    sys.exit(main())
