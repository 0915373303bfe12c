"""Whole-layer comparisons of the cupy backend on a GPU: two plans of one option built on the
same inputs, both checked against one reference and timed in alternating rounds.

    python bench/cupy_sweep.py plans --plan wgmma --shapes 8,13,6,1   # wgmma kernels on / off
    python bench/cupy_sweep.py products --shapes 13,6 --products 1,3  # out_proj and FFN
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from layerbench.backends.cupy import CupyBackend
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


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["plans", "products"])
    parser.add_argument("--shapes", default="1,2,7,8,13,6", help="official shape numbers")
    parser.add_argument("--plan", choices=["wgmma"], default="wgmma",
                        help="plans: the option compared on against off")
    parser.add_argument("--products", default="1,3", help="products: the two counts compared")
    parser.add_argument("--padding", type=float, default=0.0, help="padding ratio")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = sweep(args)
    if rows is not None and args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 2 if rows is None else 0


if __name__ == "__main__":
    sys.exit(main())
