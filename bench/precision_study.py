"""Where the error comes from: the Triton stack under each matmul precision, per shape.

For every (linear precision, attention precision) pair this prints the contract's worst
error/allowed ratio, the max abs error and the median latency, so the precision can be
spent where it matters. Run on a GPU:

    python bench/precision_study.py --shapes 1,6,8,13 --out results.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from layerbench.backends.triton import TritonBackend
from layerbench.backends.triton.layer import Precision
from layerbench.common import runner
from layerbench.common.shapes import resolve_shapes


def main() -> int:
    """Run the study and print a table (JSON rows to --out if given)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="1,6,8,13")
    parser.add_argument("--linear", default="fp16,tf32,tf32x3")
    parser.add_argument("--attention", default="fp16,tf32,tf32x3")
    parser.add_argument("--qkv", default="same",
                        help="Q/K/V projection modes; 'same' follows --linear")
    parser.add_argument("--padding", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rounds", type=int, default=10, help="0: errors only, no timing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for shape in resolve_shapes(args.shapes):
        prepared = runner.prepare(shape, padding=args.padding, dtype=torch.float32,
                                  seed=args.seed, device=device)
        reference = None
        for lin, att, qkv in itertools.product(args.linear.split(","),
                                               args.attention.split(","), args.qkv.split(",")):
            backend = TritonBackend(Precision(lin, att, None if qkv == "same" else qkv))
            layer = backend.build(shape.config, prepared.model.state_dict(), device=device)
            report, reference = runner.check(layer, prepared, reference)
            ms = (runner.median_forward_ms(layer, prepared, rounds=args.rounds)
                  if args.rounds else float("nan"))  # --rounds 0: errors only
            row = {"shape": shape.number, "linear": lin, "attention": att, "qkv": qkv,
                   "worst_ratio": report.worst_ratio, "max_abs_error": report.max_abs_error,
                   "failed": report.failed_elements, "median_ms": ms}
            rows.append(row)
            print(f"shape {shape.number:2d} linear {lin:6s} attention {att:6s} qkv {qkv:6s} "
                  f"error/allowed {report.worst_ratio:6.3f} max abs {report.max_abs_error:.2e} "
                  f"failed {report.failed_elements:6d} median {ms:8.3f} ms", flush=True)
            del layer
        del prepared
        torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
