"""One case end to end: build a backend from the reference, run it, check it, time it.

The conformance suite, the benchmark suite and the compare command all go through here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .contract import ContractReport, compare
from .flops import throughput
from .inputs import make_inputs
from .interface import BuiltLayer
from .registry import get_backend
from .shapes import Shape
from .timing import alternating_medians_ms

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def poison_cached_memory(device: torch.device, nbytes: int) -> None:
    """Fill nbytes of the CUDA caching allocator with NaN and free them, so that output
    buffers a backend allocates next start as NaN and unwritten elements fail the contract."""
    if device.type != "cuda" or nbytes <= 0:
        return
    block = torch.full((nbytes // 4 + 1,), float("nan"), device=device)
    del block


@dataclass
class Prepared:
    """A case's reference model and inputs."""

    shape: Shape
    model: torch.nn.Module
    x: torch.Tensor
    mask: torch.Tensor | None
    padding: float
    seed: int


def prepare(shape: Shape, *, padding: float, dtype: torch.dtype, seed: int, device
            ) -> Prepared:
    """The reference (LayerNorm parameters randomised) and fresh inputs for one case."""
    from layerbench.reference import make_reference

    model = make_reference(shape.config, seed=seed, randomize_norms=True)
    input_seed = seed + 1 + int(round(padding * 1000))
    x, mask = make_inputs(shape.config, padding_ratio=padding, seed=input_seed, device=device,
                          dtype=dtype)
    return Prepared(shape, model, x, mask, padding, seed)


def build(backend_name: str, prepared: Prepared) -> BuiltLayer:
    """Build backend_name for the case from the reference's state_dict."""
    backend = get_backend(backend_name)
    return backend.build(prepared.shape.config, prepared.model.state_dict(),
                         device=prepared.x.device, dtype=prepared.x.dtype)


def check(layer: BuiltLayer, prepared: Prepared, reference=None
          ) -> tuple[ContractReport, tuple[torch.Tensor, list[int] | None]]:
    """Run layer on the case (memory poisoned first) and apply the official contract.

    reference is (output, batch indices) from a previous call, or None to compute it.
    """
    from layerbench.reference import exact_output

    if reference is None:
        gen = torch.Generator().manual_seed(prepared.seed)
        reference = exact_output(prepared.model, prepared.x, prepared.mask, generator=gen)
    ref, indices = reference
    device = prepared.x.device
    poison_cached_memory(device, 2 * prepared.x.numel() * prepared.x.element_size())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        out = layer(prepared.x, prepared.mask)
    if indices is not None:
        out = out[indices]
    report = compare(out, ref, "official")
    if device.type == "cuda":
        report.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    return report, reference


@dataclass
class Timing:
    """Median latency of a backend and of torch-baseline timed in alternating rounds."""

    median_ms: float
    baseline_ms: float | None
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """torch-baseline median over this median, or None where the baseline cannot run."""
        return None if self.baseline_ms is None else self.baseline_ms / self.median_ms


def forward_call(layer: BuiltLayer, prepared: Prepared, sync: bool = False):
    """A no-argument callable running one forward of layer on the case (then a device sync
    if asked, so that a host timer sees the finished forward)."""
    x, mask, device = prepared.x, prepared.mask, prepared.x.device

    def call():
        with torch.no_grad():
            layer(x, mask)
        if sync and device.type == "cuda":
            torch.cuda.synchronize(device)
    return call


def time_against_baseline(layer: BuiltLayer, prepared: Prepared, baseline: BuiltLayer | None,
                          *, rounds: int = 20, max_seconds: float = 20.0, warmup: int = 3
                          ) -> Timing:
    """Median ms of layer, and of baseline in alternating rounds when given, plus throughput."""
    device = prepared.x.device
    fns = [forward_call(layer, prepared)]
    if baseline is not None:
        fns.append(forward_call(baseline, prepared))
    medians = alternating_medians_ms(fns, device, rounds=rounds, max_seconds=max_seconds,
                                     warmup=warmup)
    extra = throughput(prepared.shape.config, medians[0], device)
    return Timing(medians[0], medians[1] if baseline is not None else None, extra)


def median_forward_ms(layer: BuiltLayer, prepared: Prepared, rounds: int = 3) -> float:
    """Median ms of a few forwards of layer on the case (for sizing longer measurements)."""
    return alternating_medians_ms([forward_call(layer, prepared)], prepared.x.device, warmup=0,
                                  rounds=rounds)[0]


def fmt_ms(value: float | None) -> str:
    """A latency for tables."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"
