"""How the error of split-fp16 products grows with the number of blocks, on the CPU.

A float64 model of the roundings of the split-fp16 stacks (wmma's, and the one-product Q/K/V
of cupy's and cutile's): Q/K/V from fp16 rows and weights, stored in fp16; the attention
probabilities rounded to fp16 before P V; out_proj and the FFN at one product (activations
and weights rounded to fp16), two (weights rounded) or three (neither); sums and everything
else exact. Each output is checked against the strict fp32 reference by the contract, and
the worst error/allowed over the seeds is printed per (blocks, products):

    python bench/depth_study.py --config 8,128,512,8,2048 --layers 4,8,12,16 --products 1,2,3

--zero-rows-valid takes the padded rows, which are zeros, as valid tokens (an input whose
residual stream holds only the blocks' outputs, magnifying every rounding in the final norm):

    python bench/depth_study.py --config 2,48,1024,4,1024 --layers 4 --products 0,1,2 \
        --seeds 4 --zero-rows-valid
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.inputs import make_inputs
from layerbench.reference import make_reference, reference_forward
from layerbench.reference.model import LN_EPS

EXACT = 0  # products: no rounding at all (the model's own check against the reference)


def _half(t: torch.Tensor, on: bool) -> torch.Tensor:
    """t rounded to fp16 where on."""
    return t.half().double() if on else t


def _norm(x: torch.Tensor, sd: dict, name: str) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"],
                                          sd[f"{name}.bias"], LN_EPS)


def _linear(a: torch.Tensor, sd: dict, name: str, products: int) -> torch.Tensor:
    """a W^T + b with the operands rounded as `products` fp16 products round them."""
    w = _half(sd[f"{name}.weight"], products in (1, 2))
    return _half(a, products == 1) @ w.T + sd[f"{name}.bias"]


# Roundings a study may leave out (--exact), to see what each costs.
ROUNDINGS = ("qkv-operands", "qkv-output", "probabilities")


@torch.no_grad()
def emulated_forward(model, x: torch.Tensor, valid: torch.Tensor, products: int,
                     exact: tuple[str, ...] = ()) -> torch.Tensor:
    """The stack's output in float64 with the split-fp16 roundings (none for EXACT; those in
    exact, a subset of ROUNDINGS, left out)."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    rounded = products != EXACT
    qkv_products = 3 if not rounded or "qkv-operands" in exact else 1
    b, s, d = x.shape
    heads, hd = cfg.num_heads, d // cfg.num_heads
    hidden = ~valid[:, None, None, :]
    if cfg.causal:
        hidden = hidden | torch.ones(s, s, dtype=torch.bool).triu(1)
    keep = valid[..., None]
    x = x.double()
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        rows = _norm(x, sd, f"{p}.norm1")
        q, k, v = (_half(_linear(rows, sd, f"{p}.attention.{n}_proj", qkv_products),
                         rounded and "qkv-output" not in exact).view(b, s, heads, hd)
                   .transpose(1, 2) for n in "qkv")
        scores = (q @ k.transpose(-1, -2) * hd ** -0.5).masked_fill(hidden, -math.inf)
        top = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # rows with no visible key
        weights = torch.exp(scores - top)
        total = weights.sum(-1, keepdim=True)
        ctx = torch.nan_to_num(
            (_half(weights, rounded and "probabilities" not in exact) @ v) / total)
        ctx = ctx.transpose(1, 2).reshape(b, s, d)
        x = x + _linear(ctx, sd, f"{p}.attention.out_proj", products) * keep
        h = _norm(x, sd, f"{p}.norm2")
        h = torch.nn.functional.gelu(_linear(h, sd, f"{p}.ffn_in", products))
        x = (x + _linear(h, sd, f"{p}.ffn_out", products)) * keep
    return _norm(x, sd, "final_norm") * keep


def study(config: LayerConfig, layers: list[int], products: list[int], seeds: int,
          padding: float, exact: tuple[str, ...] = (), zero_rows_valid: bool = False,
          first_seed: int = 0) -> list[dict]:
    """Rows of (blocks, products, worst error/allowed over the seeds, failed seeds), the
    roundings in exact left out; with zero_rows_valid the padded (zero) rows count as valid."""
    rows = []
    for blocks in layers:
        cfg = LayerConfig(config.batch_size, config.seq_len, config.d_model, config.num_heads,
                          config.ffn_dim, blocks, config.causal)
        cases = []
        for seed in range(first_seed, first_seed + seeds):
            model = make_reference(cfg, seed=seed)
            x, mask = make_inputs(cfg, padding_ratio=padding, seed=seed + 1)
            if zero_rows_valid:
                mask = torch.ones_like(mask)
            cases.append((model, x, mask, reference_forward(model, x, mask)))
        for n in products:
            reports = [compare(emulated_forward(model, x, mask, n, exact).float(), expected)
                       for model, x, mask, expected in cases]
            row = {"blocks": blocks, "products": n,
                   "worst_ratio": max(r.worst_ratio for r in reports),
                   "failed_seeds": sum(not r.passed for r in reports)}
            rows.append(row)
            print(f"blocks {blocks:3d} products {n} error/allowed {row['worst_ratio']:.3f} "
                  f"failed {row['failed_seeds']} of {seeds}", flush=True)
    return rows


def main() -> int:
    """Print the table (JSON rows to --out if given)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="8,128,512,8,2048",
                        help="batch,seq_len,d_model,heads,ffn_dim")
    parser.add_argument("--layers", default="4,8,12,16")
    parser.add_argument("--products", default="1,2,3", help="0: no rounding (model check)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--zero-rows-valid", action="store_true",
                        help="take the padded rows (all zeros) as valid tokens")
    parser.add_argument("--padding", type=float, default=0.25)
    parser.add_argument("--exact", default="",
                        help=f"roundings left out, comma-separated: {', '.join(ROUNDINGS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    exact = tuple(name for name in args.exact.split(",") if name)
    unknown = set(exact) - set(ROUNDINGS)
    if unknown:
        parser.error(f"unknown roundings {sorted(unknown)}; have {', '.join(ROUNDINGS)}")
    b, s, d, h, f = (int(v) for v in args.config.split(","))
    rows = study(LayerConfig(b, s, d, h, f, 1), [int(v) for v in args.layers.split(",")],
                 [int(v) for v in args.products.split(",")], args.seeds, args.padding, exact,
                 args.zero_rows_valid, args.first_seed)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
