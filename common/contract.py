"""The tolerance contract of docs/spec.md: |u - r| <= atol  OR  |u - r| <= rtol * |r|, per element."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PRESETS = {"official": (0.002, 0.02), "strict": (0.001, 0.01)}


@dataclass
class ContractReport:
    """The verdict of one comparison and where it was worst."""

    passed: bool
    failed_elements: int
    total_elements: int
    max_abs_error: float
    max_rel_error: float
    # The largest per-element ratio error / allowed (min over the two bounds); <= 1 passes.
    worst_ratio: float
    worst_index: tuple[int, ...] | None
    worst_value: float | None
    worst_reference: float | None
    atol: float
    rtol: float
    reason: str = ""
    peak_memory_bytes: int | None = None  # of the forward that produced the output, if known

    def summary(self) -> str:
        """One paragraph naming the counts, the errors and the worst element."""
        head = "PASS" if self.passed else "FAIL"
        text = (f"{head}: {self.failed_elements}/{self.total_elements} elements failed "
                f"(atol={self.atol}, rtol={self.rtol}); max abs err {self.max_abs_error:.3g}, "
                f"max rel err {self.max_rel_error:.3g}, worst error/allowed "
                f"{self.worst_ratio:.3g}")
        if self.worst_index is not None:
            text += (f"; worst at index {list(self.worst_index)}: got {self.worst_value!r}, "
                     f"reference {self.worst_reference!r}")
        if self.reason:
            text += f" [{self.reason}]"
        return text

    def as_dict(self) -> dict:
        """JSON-friendly form."""
        d = asdict(self)
        d["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        return d


def tolerance(preset: str | tuple[float, float]) -> tuple[float, float]:
    """(atol, rtol) for a preset name or a pair."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise KeyError(f"unknown tolerance preset {preset!r}; have {list(PRESETS)}")
        return PRESETS[preset]
    return float(preset[0]), float(preset[1])


def compare(output: torch.Tensor, reference: torch.Tensor,
            preset: str | tuple[float, float] = "official") -> ContractReport:
    """Apply the contract to output against reference; non-finite outputs always fail."""
    atol, rtol = tolerance(preset)
    total = reference.numel()
    if tuple(output.shape) != tuple(reference.shape):
        return ContractReport(False, total, total, float("inf"), float("inf"), float("inf"),
                              None, None, None, atol, rtol,
                              reason=f"shape {tuple(output.shape)} != {tuple(reference.shape)}")
    u = output.detach().to(device=reference.device, dtype=torch.float64)
    r = reference.detach().to(torch.float64)
    err = (u - r).abs()
    allowed = torch.maximum(torch.full_like(r, atol), rtol * r.abs())
    ok = (err <= atol) | (err <= rtol * r.abs())
    ok &= torch.isfinite(u)
    # Reference elements that are NaN (baseline's all-masked rows) are compared by position:
    # the output must be non-finite there too.
    ref_nan = ~torch.isfinite(r)
    ok = torch.where(ref_nan, ~torch.isfinite(u), ok)
    ratio = torch.where(torch.isfinite(u), err / allowed, torch.full_like(err, float("inf")))
    ratio = torch.where(ref_nan & ok, torch.zeros_like(ratio), ratio)
    failed = int((~ok).sum())
    finite_err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    finite_err = torch.where(ref_nan, torch.zeros_like(finite_err), finite_err)
    rel = torch.where(r != 0, finite_err / r.abs(), torch.where(finite_err == 0,
                      torch.zeros_like(err), torch.full_like(err, float("inf"))))
    if total == 0:
        return ContractReport(True, 0, 0, 0.0, 0.0, 0.0, None, None, None, atol, rtol)
    flat = int(torch.argmax(ratio).item())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
    return ContractReport(
        passed=failed == 0,
        failed_elements=failed,
        total_elements=total,
        max_abs_error=float(finite_err.max()),
        max_rel_error=float(rel.max()),
        worst_ratio=float(ratio.max()),
        worst_index=index,
        worst_value=float(u.reshape(-1)[flat]),
        worst_reference=float(r.reshape(-1)[flat]),
        atol=atol,
        rtol=rtol,
    )
