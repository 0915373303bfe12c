"""PyTorch stand-ins for kernel families, shared by the tests that run a CUDA backend's
launch sequence on CPU: fp16 pairs, split products, residual epilogues, LayerNorm."""
from __future__ import annotations

import torch


def _pair(y: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Store fp32 y as the fp16 pair (hi, lo)."""
    hi.copy_(y.half())
    lo.copy_((y - hi.float()).half())


def _norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[1],), w, b, eps=1e-5)


def _products(a_hi, a_lo, w_hi, w_lo, n: int, products: int) -> torch.Tensor:
    """A @ W^T over the first n rows of W and the columns of A, by PRODUCTS fp16 products:
    1 a_hi w_hi; 2 adds a_lo w_hi (w_lo not read); 3 adds a_hi w_lo too."""
    k = a_hi.shape[1]
    wh, wl = w_hi[:n, :k].float(), w_lo[:n, :k].float()
    acc = a_hi.float() @ wh.t()
    if products >= 2:
        acc += a_lo.float() @ wh.t()
    if products >= 3:
        acc += a_hi.float() @ wl.t()
    return acc


def _residual(acc, res, valid, has_mask: int, zero_sum: int) -> torch.Tensor:
    if not has_mask:
        return res + acc
    keep = valid[: res.shape[0]].bool()[:, None]
    return torch.where(keep, res + acc, 0.0) if zero_sum else res + torch.where(keep, acc, 0.0)


def _norm_rows(y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, hi: torch.Tensor,
               lo: torch.Tensor | None) -> None:
    """LayerNorm of y's rows as the fp16 pair (hi, lo), or as hi alone where lo is None."""
    normed = _norm(y, w, b)
    if lo is None:
        hi.copy_(normed.half())
    else:
        _pair(normed, hi, lo)
