"""Tile sweeps of the Triton stack and a per-kernel profile of any backend, on a GPU.

    python bench/tile_sweep.py profile --shapes 6,8 --backend wmma
    python bench/tile_sweep.py narrow --shapes 1,6,13
    python bench/tile_sweep.py wide --shapes 8
    python bench/tile_sweep.py attention --seq-len 100000 --heads 16 --head-dim 64
    python bench/tile_sweep.py launch --shapes 2,1,11

"narrow" and "wide" time the forward under each candidate tile configuration (same run,
alternating rounds; replayed from a CUDA graph per candidate where the input is small
enough) and report the largest difference from the default's output, so a configuration
that computes something else shows. "attention" times flash attention of
one long sequence. "launch" times the forward with programmatic dependent launch on and
off. "profile" lists GPU time per kernel for one forward of --backend (default triton).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace

import torch

from layerbench.backends.triton import attention, launch, linear, narrow_block
from layerbench.common import runner
from layerbench.common.cli import check_backends, check_padding, check_shapes, checked_or_exit
from layerbench.common.graphs import GraphedForward
from layerbench.common.registry import get_backend
from layerbench.common.shapes import resolve_shapes
from layerbench.common.timing import alternating_medians_ms

_T = narrow_block.NarrowTiles
NARROW = [_T(64, 64, 4, 3, 64, 0, True, 0), _T(64, 64, 4, 3, 64, 0, True, 64),
          _T(64, 64, 4, 3, 64, 0, True, 16), _T(64, 64, 4, 3, 64, 0, False, 0)]
WIDE = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 2), (256, 128, 64, 8, 2), (128, 128, 64, 4, 3),
        (128, 128, 32, 8, 4), (128, 256, 32, 8, 3)]
_A = attention.AttentionTiles
ATTENTION = [_A(128, 64, 4, 3), _A(128, 64, 4, 4), _A(128, 64, 8, 3), _A(64, 64, 4, 3),
             _A(256, 64, 8, 3)]


BATCH = None  # --batch: run the shapes with this batch size instead
PADDING = 0.25


def _layer(shape, seed=0, backend="triton"):
    if BATCH:
        shape = replace(shape, config=replace(shape.config, batch_size=BATCH))
    prepared = runner.prepare(shape, padding=PADDING, dtype=torch.float32, seed=seed,
                              device=torch.device("cuda"))
    layer = get_backend(backend).build(shape.config, prepared.model.state_dict(), device="cuda")
    return prepared, layer


def _time_candidates(candidates, run, expected, rounds, label=""):
    """(candidate, median ms, max |output - expected|) of each candidate the compiler accepts.

    run(candidate) computes the output under that candidate; all are timed in one set of
    alternating rounds.
    """
    fns, names, diffs = [], [], []
    for cand in candidates:
        try:
            out = run(cand)
            torch.cuda.synchronize()
        except Exception as exc:  # a configuration the compiler rejects
            print(f"{label}{cand}: {type(exc).__name__}: {exc}"[:300])
            continue
        diffs.append((out - expected).abs().max().item())
        names.append(cand)
        fns.append(lambda c=cand: run(c))
    times = alternating_medians_ms(fns, "cuda", rounds=rounds)
    return list(zip(names, times, diffs))


def sweep_layer(shapes, module, attr, candidates, rounds):
    """Time the forward (graph replay) with module.attr set to each candidate; result rows."""
    rows = []
    default = getattr(module, attr)
    for shape in resolve_shapes(shapes):
        prepared, layer = _layer(shape)

        def forward_under(cand):
            def forward(x, mask, out=None):
                setattr(module, attr, cand)
                return layer._forward(x, mask, out)
            return GraphedForward(forward)

        graphed = {}  # each candidate's forward replayed from its own CUDA graph

        def run(cand):
            if cand not in graphed:
                graphed[cand] = forward_under(cand)
            return graphed[cand](prepared.x, prepared.mask)

        with torch.no_grad():
            expected = layer._forward(prepared.x, prepared.mask).clone()
            timed = _time_candidates(candidates, run, expected, rounds,
                                     label=f"shape {shape.number} ")
        setattr(module, attr, default)
        for cand, ms, diff in timed:
            rows.append({"shape": shape.number, "config": cand, "ms": ms, "max_diff": diff})
            print(f"shape {shape.number:2d} {str(cand):26s} {ms:9.3f} ms  diff {diff:.1e}",
                  flush=True)
        del layer, prepared
        torch.cuda.empty_cache()
    return rows


def sweep_attention(seq_len, heads, head_dim, rounds, mask="all-valid"):
    """Time flash attention of one sequence under each candidate configuration.

    mask: "none" (no mask tensor), "all-valid" (a mask of all True, as the official inputs
    pass at padding 0), "prefix" (the first 3/4 of the tokens valid, as padding pads) or "hole" (one
    invalid key in the middle: not a prefix, so every block loads the mask).
    """
    d = heads * head_dim
    torch.manual_seed(0)
    qkv = torch.randn(seq_len, 3 * d, device="cuda", dtype=torch.float16)
    ctx = torch.empty(seq_len, d, device="cuda", dtype=torch.float32)
    valid = key_end = None
    if mask != "none":
        valid = torch.ones(1, seq_len, device="cuda", dtype=torch.uint8)
        if mask == "hole":
            valid[0, seq_len // 2] = 0
        if mask == "prefix":
            valid[0, seq_len * 3 // 4:] = 0
        key_end = attention.key_extent(valid, torch.empty(1, device="cuda", dtype=torch.int32))
    flops = 4 * heads * head_dim * seq_len * seq_len / 2
    def run(cand):
        return attention.flash_attention(qkv, ctx, valid, key_end, batch=1, seq_len=seq_len,
                                         num_heads=heads, precision="fp16", config=cand)

    expected = run(None).clone()  # the default configuration
    rows = []
    for cand, ms, diff in _time_candidates(ATTENTION, run, expected, rounds):
        rows.append({"config": cand, "mask": mask, "ms": ms, "tflops": flops / ms / 1e9,
                     "max_diff": diff})
        print(f"attention S={seq_len} H={heads} hd={head_dim} mask={mask} {str(cand):20s} "
              f"{ms:9.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s diff {diff:.1e}", flush=True)
    return rows


def profile(shapes, backend="triton"):
    """GPU milliseconds per kernel name for one eager forward of each shape (a layer without
    an eager _forward, a PyTorch peer's, runs its forward)."""
    rows = []
    for shape in resolve_shapes(shapes):
        prepared, layer = _layer(shape, backend=backend)
        eager = getattr(layer, "_forward", layer.forward)
        with torch.no_grad():
            for _ in range(2):
                eager(prepared.x, prepared.mask)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                eager(prepared.x, prepared.mask)
                torch.cuda.synchronize()
        totals = defaultdict(lambda: [0.0, 0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name][0] += event.device_time / 1e3
                totals[event.name][1] += 1
        for name, (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            rows.append({"backend": backend, "shape": shape.number, "kernel": name, "ms": ms,
                         "count": count})
            print(f"shape {shape.number:2d} {name[:60]:60s} {count:4d} x {ms:9.3f} ms", flush=True)
        del layer, prepared
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    """Run one study and write its rows as JSON to --out."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", choices=("profile", "narrow", "wide", "attention", "launch"))
    parser.add_argument("--shapes", default="6")
    parser.add_argument("--backend", default="triton", help="profile: the backend profiled")
    parser.add_argument("--seq-len", type=int, default=100_000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--padding", type=float, default=0.25)
    parser.add_argument("--mask", choices=("none", "all-valid", "prefix", "hole"),
                        default="all-valid", help="attention study: the key mask passed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device, and this machine has none")
    checked_or_exit(parser, "--shapes", check_shapes, args.shapes)
    checked_or_exit(parser, "--padding", check_padding, args.padding)
    checked_or_exit(parser, "--backend", check_backends, args.backend)
    global BATCH, PADDING
    BATCH, PADDING = args.batch, args.padding
    if args.study == "profile":
        rows = profile(args.shapes, args.backend)
    elif args.study == "narrow":
        rows = sweep_layer(args.shapes, narrow_block, "NARROW_TILES", NARROW, args.rounds)
    elif args.study == "launch":  # programmatic dependent launch on and off
        if not launch.AVAILABLE:
            print("this Triton cannot launch kernels as programmatic dependents", file=sys.stderr)
            return 2
        rows = sweep_layer(args.shapes, launch, "DEPENDENT_LAUNCH", [True, False], args.rounds)
    elif args.study == "wide":
        rows = sweep_layer(args.shapes, linear, "SPLIT_TILES", WIDE, args.rounds)
    else:
        rows = sweep_attention(args.seq_len, args.heads, args.head_dim, args.rounds,
                               args.mask)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
