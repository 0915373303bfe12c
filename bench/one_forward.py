"""Run a few eager forwards of one backend on one official shape, for ncu or compute-sanitizer.

    ncu --clock-control none -k regex:attention_ffn --launch-skip 4 --launch-count 1 \
        --section WarpStateStats python bench/one_forward.py --shape 2
    compute-sanitizer python bench/one_forward.py --shape ci1 --forwards 1
"""
from __future__ import annotations

import argparse
import sys

import torch

from layerbench.common import runner
from layerbench.common.cli import check_backends, check_padding, check_shapes, checked_or_exit
from layerbench.common.registry import get_backend


def main() -> int:
    """Build the layer, run --forwards eager forwards and wait for the GPU."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--shape", default="2")
    parser.add_argument("--forwards", type=int, default=2)
    parser.add_argument("--padding", type=float, default=0.25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device, and this machine has none")
    shape = checked_or_exit(parser, "--shape", check_shapes, args.shape)[0]
    checked_or_exit(parser, "--backend", check_backends, args.backend)
    checked_or_exit(parser, "--padding", check_padding, args.padding)
    prepared = runner.prepare(shape, padding=args.padding, dtype=torch.float32, seed=0,
                              device=torch.device("cuda"))
    layer = get_backend(args.backend).build(shape.config, prepared.model.state_dict(),
                                            device="cuda")
    forward = getattr(layer, "_forward", layer)  # eager: one launch per kernel, no graph
    with torch.no_grad():
        for _ in range(args.forwards):
            forward(prepared.x, prepared.mask)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
