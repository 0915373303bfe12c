"""Run a few eager forwards of one backend on one shape (an official shape number, or any
shape --shapes names, such as ci1), for ncu or compute-sanitizer.

    ncu --clock-control none -k regex:attention_ffn --launch-skip 4 --launch-count 1 \
        --section WarpStateStats python bench/one_forward.py --shape 2
    compute-sanitizer python bench/one_forward.py --shape ci1 --forwards 1
    python bench/one_forward.py --backend cupy --option whole_block=True --shape 2
"""
from __future__ import annotations

import argparse
import sys

import torch

from layerbench.common import runner
from layerbench.common.cli import check_backends, check_padding, check_shapes, checked_or_exit
from layerbench.common.registry import get_backend


def option_value(text: str, parser: argparse.ArgumentParser) -> tuple[str, object]:
    """(name, value) of one --option NAME=VALUE: True, False, None, an int, or the text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        parser.error(f"--option takes NAME=VALUE, not {text!r}")
    words = {"True": True, "False": False, "None": None}
    if value in words:
        return name, words[value]
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main() -> int:
    """Build the layer, run --forwards eager forwards and wait for the GPU."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--shape", default="2")
    parser.add_argument("--forwards", type=int, default=2)
    parser.add_argument("--padding", type=float, default=0.25)
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a keyword of the backend's class (True, False, None, an int or "
                             "text), e.g. whole_block=True; repeatable")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device, and this machine has none")
    shape = checked_or_exit(parser, "--shape", check_shapes, args.shape)[0]
    checked_or_exit(parser, "--backend", check_backends, args.backend)
    checked_or_exit(parser, "--padding", check_padding, args.padding)
    prepared = runner.prepare(shape, padding=args.padding, dtype=torch.float32, seed=0,
                              device=torch.device("cuda"))
    backend = get_backend(args.backend)
    if args.option:
        backend = type(backend)(**dict(option_value(o, parser) for o in args.option))
    layer = backend.build(shape.config, prepared.model.state_dict(), device="cuda")
    forward = getattr(layer, "_forward", layer)  # eager: one launch per kernel, no graph
    with torch.no_grad():
        for _ in range(args.forwards):
            forward(prepared.x, prepared.mask)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
