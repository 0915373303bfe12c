"""Whole-layer comparisons of the cupy backend on a GPU: two plans of one option built on the
same inputs, both checked against one reference and timed in alternating rounds.

    python bench/cupy_sweep.py plans --plan wgmma --shapes 8,13,6,1   # wgmma kernels on / off
    python bench/cupy_sweep.py products --shapes 13,6 --products 1,3  # out_proj and FFN
    python bench/cupy_sweep.py attention --batch 1 --seq-len 100000 --heads 16 --head-dim 64
        # the mma.sync attention kernel and every wgmma variant of the head dim on one input:
        # ms, TFLOP/s, error
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from layerbench.backends.cupy import CupyBackend, build, ops
from layerbench.common import runner


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
    if args.what == "plans":
        return runner.compare_plans(
            args.shapes,
            lambda on, cfg, sd: CupyBackend(**{args.plan: on}).build(cfg, sd, device=device),
            padding=args.padding, rounds=args.rounds, device=device, label=args.plan)
    return runner.compare_plans(
        args.shapes,
        lambda n, cfg, sd: CupyBackend(linear_products=n).build(cfg, sd, device=device),
        plans=tuple(int(p) for p in args.products.split(",")), padding=args.padding,
        rounds=args.rounds, device=device, label="products")


def sweep_attention(args, device) -> list[dict]:
    """The mma.sync attention kernel and, where the head dim has the wgmma kernel, each of its
    variants (build.ATTENTION_WGMMA, by name)."""
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
            choices[v.name] = kernel(True, v.name)
    return runner.compare_attention_kernels(
        choices, batch=args.batch, seq_len=args.seq_len, heads=args.heads,
        head_dim=args.head_dim, causal=not args.full, rounds=args.rounds, device=device,
        label="cupy attention")


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["plans", "products", "attention"])
    parser.add_argument("--shapes", default="1,2,7,8,13,6", help="official shape numbers")
    parser.add_argument("--plan", choices=["wgmma", "fuse_norms"], default="wgmma",
                        help="plans: the option compared on against off")
    parser.add_argument("--products", default="1,3", help="products: the two counts compared")
    parser.add_argument("--padding", type=float, default=0.0, help="padding ratio")
    parser.add_argument("--batch", type=int, default=1, help="attention: sequences")
    parser.add_argument("--seq-len", type=int, default=100000, help="attention: tokens each")
    parser.add_argument("--heads", type=int, default=16, help="attention: heads")
    parser.add_argument("--head-dim", type=int, default=64, help="attention: head dim")
    parser.add_argument("--full", action="store_true", help="attention: not causal")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = sweep(args)
    if rows is not None and args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 2 if rows is None else 0


if __name__ == "__main__":
    sys.exit(main())
