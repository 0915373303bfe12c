"""Kernel-level sweeps of the wmma backend on a GPU: every GEMM tile and every attention kernel
on the same inputs, each output checked, and the whole layer under each linear precision.

    python bench/wmma_sweep.py gemm                      # the regimes of the official shapes
    python bench/wmma_sweep.py gemm --cases 8192x1024x1024:3:2
    python bench/wmma_sweep.py edges                     # odd sizes, every tile and epilogue
    python bench/wmma_sweep.py attention --batch 1 --seq-len 16384 --heads 16 --head-dim 64
    python bench/wmma_sweep.py precision --shapes 6,8 --products 2,3
    python bench/wmma_sweep.py plans --shapes 2,1,6,13
    python bench/wmma_sweep.py plans --plan ffn --shapes 1,2,5,13   # ffn_block on against off
    python bench/wmma_sweep.py peak                      # the device's wmma ceiling

"gemm" times each tile (alternating rounds, CUDA events, median) and reports TFLOP/s counting
every fp16 product. A GEMM case is MxNxK:products:epilogue (epilogues 0 half, 1 GELU pair,
2 residual update, 3 residual sum). "edges" runs every tile on sizes that are not multiples
of any tile, into NaN-filled outputs, against a float64 product of the same fp16 parts.
"attention" times each attention kernel and compares it with fp32 attention of one sequence.
"precision" builds the layer with each count of linear products and prints the contract's
worst error/allowed ratio and the median forward time; "plans" does the same for one layer
option on against off, timed in alternating rounds: --plan norms (the default) the LayerNorms
in the GEMM epilogues against separate norm kernels, ffn the ffn_block kernel on every call
against never, resident and narrow the resident-weight or the 64x128 stream tile against the
16-warp 128x128 one, stream-rule the default stream tile (tiles.long_stream_tile) against the
16-warp 128x128 one, norm-registers norm_split's row-in-registers kernel, pdl programmatic
dependent launches, persistent the persistent pipelined tile for K > 128. "peak"
times register-resident wmma products alone (no memory traffic) at several CTAs per SM and
warps per CTA: the ceiling the GEMM and attention kernels are measured against.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from layerbench.backends.wmma import WmmaBackend, build
from layerbench.backends.wmma import attention as wmma_attention
from layerbench.backends.wmma.linear import (GELU_PAIR, HALF, RESIDUAL_SUM, RESIDUAL_UPDATE,
                                             linear)
from layerbench.backends.wmma.tiles import GEMM_TILES
from layerbench.common import runner
from layerbench.common.cuda_host import split_fp16
from layerbench.common.shapes import resolve_shapes
from layerbench.common.timing import alternating_medians_ms

# (M, N, K, products, epilogue) of the linears of the official shapes.
GEMM_CASES = (
    "8192x3072x1024:1:0",     # shape 8 Q/K/V
    "8192x1024x1024:1:2",     # shape 8 out_proj (one product from d_model 512)
    "8192x1024x1024:1:1",     # shape 8 ffn_in
    "8192x1024x1024:1:0",     # the same GEMM with Q/K/V's fp16 epilogue: grid or epilogue?
    "8192x1024x1024:2:3",     # shape 8 ffn_out with two products
    "1280000x384x128:1:0",    # shape 6 Q/K/V
    "1280000x128x128:3:1",    # shape 6 ffn_in
    "1280000x128x128:3:3",    # shape 6 ffn_out
    "65536x384x128:1:0",      # shape 13 Q/K/V
    "65536x128x128:3:2",      # shape 13 out_proj with three products (before W18)
    "65536x128x128:2:1",      # shape 13 ffn_in (two products, W18)
    "8192x128x128:3:1",       # shape 1 ffn_in
    "128x128x128:3:3",        # shape 2 ffn_out
)
# The last: more 128x128 tiles (585) than a persistent grid has CTAs, so that they take
# several in turn.
EDGE_SIZES = ((1, 8, 8), (37, 24, 24), (1000, 200, 136), (4099, 392, 1032), (130, 1030, 256),
              (8300, 1030, 200))


def _parse_case(text: str) -> tuple[int, int, int, int, int]:
    size, products, epilogue = text.split(":")
    m, n, k = (int(v) for v in size.split("x"))
    return m, n, k, int(products), int(epilogue)


def gemm_operands(m, n, k, products, device, gen):
    """fp16 (hi, lo) activations [m, k] and weights [n, k] (lo None where products does not
    multiply it), bias, residual and a valid-row mask."""
    a = torch.randn(m, k, device=device, generator=gen)
    w = torch.randn(n, k, device=device, generator=gen) / math.sqrt(k)
    a_pair, w_pair = split_fp16(a), split_fp16(w)
    if products == 1:
        a_pair, w_pair = (a_pair[0], None), (w_pair[0], None)
    elif products == 2:
        w_pair = (w_pair[0], None)
    bias = torch.randn(n, device=device, generator=gen)
    residual = torch.randn(m, n, device=device, generator=gen)
    valid = (torch.rand(m, device=device, generator=gen) > 0.2).to(torch.uint8)
    return a_pair, w_pair, bias, residual, valid


def _expected(a_pair, w_pair, bias, residual, valid, epilogue):
    """The epilogue over the float64 product of the fp16 parts the kernel multiplies."""
    def full(pair):
        return pair[0].double() + (0 if pair[1] is None else pair[1].double())
    a, w = full(a_pair), full(w_pair)
    if a_pair[1] is not None and w_pair[1] is not None:  # fp16x3 drops lo * lo
        a_lo, w_lo = a_pair[1].double(), w_pair[1].double()
        v = a @ w.T - a_lo @ w_lo.T
    else:
        v = a @ w.T
    v = v + bias.double()
    keep = valid.bool()[:, None]
    if epilogue == HALF:
        return v
    if epilogue == GELU_PAIR:
        return torch.nn.functional.gelu(v)
    if epilogue == RESIDUAL_UPDATE:
        return residual.double() + torch.where(keep, v, 0)
    return torch.where(keep, residual.double() + v, 0)


def _runner(ext, tile, m, n, a_pair, w_pair, bias, residual, valid, epilogue):
    """(run, result): run() launches the tile into fresh NaN-filled outputs, result() reads them."""
    device = a_pair[0].device
    half_out = torch.full((m, n), math.nan, device=device, dtype=torch.float16)
    lo_out = torch.full((m, n), math.nan, device=device, dtype=torch.float16)
    f32_out = torch.full((m, n), math.nan, device=device)
    residual_epilogue = epilogue in (RESIDUAL_UPDATE, RESIDUAL_SUM)

    def run():
        linear(ext, a_pair, w_pair, bias, epilogue=epilogue, tile=tile,
               out=f32_out if residual_epilogue else None,
               out_pair=None if residual_epilogue else
               (half_out, lo_out if epilogue == GELU_PAIR else None),
               residual=residual if residual_epilogue else None,
               valid_rows=valid if residual_epilogue else None)

    def result():
        if residual_epilogue:
            return f32_out.double()
        if epilogue == GELU_PAIR:
            return half_out.double() + lo_out.double()
        return half_out.double()
    return run, result


def _max_error(got, expected, epilogue, k):
    """Largest |got - expected| / (scale), NaN counted as infinite; scale allows fp16 rounding
    of a HALF output and fp32 accumulation over k terms elsewhere."""
    fp32_sum = 2e-5 * max(1.0, math.sqrt(k / 256))
    scale = expected.abs().clamp_min(1.0) * (2e-3 if epilogue == HALF else fp32_sum)
    err = ((got - expected).abs() / scale).nan_to_num(nan=math.inf)
    return err.max().item()


def sweep_gemm(cases, rounds, tiles=None):
    """Time every tile on every case; print and return rows."""
    device = torch.device("cuda")
    ext = build.load(device)
    rows = []
    for text in cases:
        m, n, k, products, epilogue = _parse_case(text)
        gen = torch.Generator(device=device).manual_seed(m + n + k)
        ops = gemm_operands(m, n, k, products, device, gen)
        expected = _expected(*ops, epilogue) if m <= 70000 else None
        chosen = range(len(GEMM_TILES)) if tiles is None else tiles
        runs = {}
        for t in chosen:
            run, result = _runner(ext, t, m, n, *ops, epilogue)
            try:
                run()
            except RuntimeError as exc:  # e.g. a stream tile with K > 128
                print(f"{text:22s} tile {t:2d} {GEMM_TILES[t]}: refused: "
                      f"{str(exc).splitlines()[0]}", flush=True)
                continue
            runs[t] = run, result
        torch.cuda.synchronize()
        errors = {t: (_max_error(result(), expected, epilogue, k) if expected is not None
                      else math.nan) for t, (_, result) in runs.items()}
        medians = alternating_medians_ms([run for run, _ in runs.values()], device,
                                         rounds=rounds, max_seconds=5.0)
        flop = 2.0 * m * n * k * products
        for (tile, _), ms in zip(runs.items(), medians):
            row = {"case": text, "tile": tile, "tile_desc": str(GEMM_TILES[tile]), "ms": ms,
                   "tflops": flop / ms / 1e9, "error": errors[tile]}
            rows.append(row)
            print(f"{text:22s} tile {tile:2d} {str(GEMM_TILES[tile]):28s} {ms:9.4f} ms "
                  f"{row['tflops']:7.1f} TFLOP/s  err/allowed {errors[tile]:.2g}", flush=True)
        del runs, ops, expected
        torch.cuda.empty_cache()
    return rows


def check_edges():
    """Every tile, epilogue and product count on odd sizes; rows of failures (none = pass)."""
    device = torch.device("cuda")
    ext = build.load(device)
    rows = []
    for m, n, k in EDGE_SIZES:
        for products in (1, 2, 3):
            gen = torch.Generator(device=device).manual_seed(m * 7 + n + k + products)
            ops = gemm_operands(m, n, k, products, device, gen)
            for epilogue in (HALF, GELU_PAIR, RESIDUAL_UPDATE, RESIDUAL_SUM):
                expected = _expected(*ops, epilogue)
                for tile in range(len(GEMM_TILES)):
                    run, result = _runner(ext, tile, m, n, *ops, epilogue)
                    try:
                        run()
                        err = _max_error(result(), expected, epilogue, k)
                    except RuntimeError as exc:  # a combination the kernels refuse
                        print(f"{m}x{n}x{k} p{products} e{epilogue} tile {tile}: refused: "
                              f"{str(exc).splitlines()[0]}")
                        continue
                    ok = err <= 1.0
                    rows.append({"m": m, "n": n, "k": k, "products": products,
                                 "epilogue": epilogue, "tile": tile, "error": err, "ok": ok})
                    if not ok:
                        print(f"FAIL {m}x{n}x{k} products {products} epilogue {epilogue} "
                              f"tile {tile} {GEMM_TILES[tile]}: err/allowed {err:.3g}")
    failed = sum(not r["ok"] for r in rows)
    print(f"edges: {len(rows) - failed} of {len(rows)} combinations pass")
    return rows


def sweep_attention(batch, seq_len, heads, head_dim, causal, rounds):
    """Time every attention kernel on one input; check each against fp32 attention of the
    first sequence's first 8192 rows."""
    device = torch.device("cuda")
    ext = build.load(device)
    valid = torch.ones(batch, seq_len, dtype=torch.uint8, device=device)

    def kernel(name):
        return lambda qkv, ctx: wmma_attention.attention(
            ext, qkv, ctx, valid, batch=batch, seq_len=seq_len, num_heads=heads,
            causal=causal, block_n=None, kernel=name)
    return runner.compare_attention_kernels(
        {name: kernel(name) for name in wmma_attention.kernel_names(ext, device)},
        batch=batch, seq_len=seq_len, heads=heads, head_dim=head_dim, causal=causal,
        rounds=rounds, device=device)


PEAK_ITERS = 4096  # rounds of the peak kernel's loop (each: mma_peak_chains() products)
PEAK_CONFIGS = ((1, 128), (2, 128), (4, 128), (1, 256), (2, 256), (4, 256), (8, 256))


def peak(rounds):
    """TFLOP/s of the register-resident wmma kernel per (CTAs per SM, threads per CTA)."""
    device = torch.device("cuda")
    ext = build.load(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    flop_per_warp = PEAK_ITERS * ext.mma_peak_chains() * 2 * 16 * 16 * 16
    runs, rows = [], []
    for per_sm, threads in PEAK_CONFIGS:
        blocks = sms * per_sm
        out = torch.empty(blocks * threads, device=device)
        runs.append(lambda out=out, b=blocks, t=threads: ext.mma_peak(out, b, t, PEAK_ITERS))
    medians = alternating_medians_ms(runs, device, rounds=rounds, max_seconds=10.0)
    for (per_sm, threads), ms in zip(PEAK_CONFIGS, medians):
        warps = sms * per_sm * threads // 32
        row = {"ctas_per_sm": per_sm, "threads": threads, "warps_per_sm": per_sm * threads // 32,
               "ms": ms, "tflops": warps * flop_per_warp / ms / 1e9}
        rows.append(row)
        print(f"peak {per_sm} CTAs/SM x {threads:4d} threads ({row['warps_per_sm']:2d} warps/SM) "
              f"{ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)
    return rows


def precision(shapes, products_list, rounds, padding):
    """Worst error/allowed and median ms of the layer under each count of linear products."""
    device = torch.device("cuda")
    rows = []
    for shape in resolve_shapes(shapes):
        prepared = runner.prepare(shape, padding=padding, dtype=torch.float32, seed=1234,
                                  device=device)
        reference = None
        for products in products_list:
            layer = WmmaBackend(linear_products=products).build(
                shape.config, prepared.model.state_dict(), device=device)
            report, reference = runner.check(layer, prepared, reference)
            ms = runner.median_forward_ms(layer, prepared, rounds=rounds)
            rows.append({"shape": shape.number, "products": products,
                         "worst_ratio": report.worst_ratio, "failed": report.failed_elements,
                         "median_ms": ms})
            print(f"shape {shape.number:2d} linear products {products} error/allowed "
                  f"{report.worst_ratio:6.3f} failed {report.failed_elements:6d} "
                  f"median {ms:8.3f} ms", flush=True)
            del layer
        del prepared, reference
        torch.cuda.empty_cache()
    return rows


# plan -> (WmmaBackend option, its value "on", its value "off")
PLAN_OPTIONS = {"norms": ("fuse_norms", True, False), "ffn": ("fuse_ffn", True, False),
                "resident": ("stream_tile", "stream 128x128 8w resident", "stream 128x128 16w"),
                "narrow": ("stream_tile", "stream 64x128 8w", "stream 128x128 16w"),
                "stream-rule": ("stream_tile", None, "stream 128x128 16w"),
                "norm-registers": ("norm_in_registers", True, False),
                "pdl": ("pdl", True, False),
                "persistent": ("persistent_gemm", True, False)}


def plans(shapes, rounds, padding, plan="norms"):
    """The layer with one plan option on against off (norms: LayerNorms in the GEMM
    epilogues; ffn: the ffn_block kernel; resident / narrow: the resident-weight or the
    64x128 stream tile in place of the 16-warp 128x128 one; stream-rule: the default stream
    tile (tiles.long_stream_tile) against the 16-warp 128x128 one; norm-registers: norm_split's
    row-in-registers kernel; pdl: programmatic dependent launches; persistent: the persistent
    pipelined tile for K > 128): median ms of each
    (alternating rounds) and both error/allowed ratios."""
    device = torch.device("cuda")
    option, on_value, off_value = PLAN_OPTIONS[plan]
    fixed = {"fuse_ffn": False} if plan == "norms" else {}  # norms: the separate GEMMs
    return runner.compare_plans(
        shapes, lambda on, cfg, sd: WmmaBackend(**{option: on_value if on else off_value},
                                                **fixed).build(cfg, sd, device=device),
        padding=padding, rounds=rounds, device=device,
        label=option if isinstance(on_value, bool) else plan)


def main() -> int:
    """Run one study; JSON rows to --out."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=("gemm", "edges", "attention", "precision", "plans",
                                          "peak"))
    parser.add_argument("--cases", default=",".join(GEMM_CASES), help="gemm: MxNxK:products:"
                        "epilogue, comma-separated")
    parser.add_argument("--tiles", default=None, help="gemm: tile indices (default all)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--full", action="store_true", help="attention: non-causal")
    parser.add_argument("--shapes", default="6,8")
    parser.add_argument("--products", default="2,3")
    parser.add_argument("--plan", choices=sorted(PLAN_OPTIONS), default="norms",
                        help="plans: the option compared on against off")
    parser.add_argument("--padding", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device, and this machine has none")
    if args.study == "gemm":
        tiles = None if args.tiles is None else [int(t) for t in args.tiles.split(",")]
        rows = sweep_gemm(args.cases.split(","), args.rounds, tiles)
    elif args.study == "edges":
        rows = check_edges()
    elif args.study == "attention":
        rows = sweep_attention(args.batch, args.seq_len, args.heads, args.head_dim,
                               not args.full, args.rounds)
    elif args.study == "plans":
        rows = plans(args.shapes, args.rounds, args.padding, args.plan)
    elif args.study == "peak":
        rows = peak(args.rounds)
    else:
        rows = precision(args.shapes, [int(p) for p in args.products.split(",")], args.rounds,
                         args.padding)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    failed = args.study == "edges" and any(not r["ok"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
