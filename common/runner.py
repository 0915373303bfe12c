"""One case end to end: admit it, build a backend from the reference, run it, check it, time it.

The conformance suite, the benchmark suite and the compare command all go through here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .config import LayerConfig
from .contract import ContractReport, compare
from .errors import Unsupported
from .flops import forward_flops, throughput
from .graphs import MAX_GRAPH_ELEMENTS
from .inputs import make_inputs
from .interface import BuiltLayer
from .memory import MemoryPlan, check_fits
from .registry import get_backend
from .shapes import Shape
from .timing import alternating_medians_ms, replayed

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# On a CPU, a case whose estimated time exceeds CPU_CASE_SECONDS is skipped unless slow cases
# are allowed. The rate is a fast CPU's, so the estimate errs on the short side.
CPU_FLOPS_PER_SECOND = 50e9
CPU_CASE_SECONDS = 600.0

# The outputs check() holds: the allocating call's and the NaN-filled out= buffer.
CHECK_OUTPUTS = ("output", "out= buffer")


def poison_cached_memory(device: torch.device, nbytes: int) -> None:
    """Fill nbytes of the CUDA caching allocator with NaN and free them, so that output
    buffers a backend allocates next start as NaN and unwritten elements fail the contract."""
    if device.type != "cuda" or nbytes <= 0:
        return
    block = torch.full((nbytes // 4 + 1,), float("nan"), device=device)
    del block


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _backend_plan(backend, config: LayerConfig, dtype: torch.dtype) -> MemoryPlan:
    """The memory plan of a backend (a name, or the instance a layer was built by)."""
    backend = get_backend(backend) if isinstance(backend, str) else backend
    return backend.memory_plan(config, dtype) or MemoryPlan()


def case_plan(backend_name: str, config: LayerConfig, dtype: torch.dtype, device, *,
              outputs: tuple[str, ...] = CHECK_OUTPUTS, reference: bool = True) -> MemoryPlan:
    """Every byte a case allocates on device: the input and mask, each named output, the
    backend's working set and (if reference) the reference's output and working set."""
    from layerbench.reference import reference_plan

    rows = config.tokens * config.d_model * _element_size(dtype)
    plan = MemoryPlan({"input x": rows, "mask": config.tokens, **{name: rows for name in outputs}})
    plan = plan.plus(_backend_plan(backend_name, config, dtype), prefix=f"{backend_name} ")
    if reference:
        plan = plan.plus(reference_plan(config, torch.device(device), dtype,
                                     reserve_bytes=plan.total), prefix="reference ")
    return plan


def estimated_cpu_seconds(backend_name: str, config: LayerConfig, dtype: torch.dtype, *,
                          forwards: int = len(CHECK_OUTPUTS), reference: bool = True) -> float:
    """Seconds a case takes on a CPU at CPU_FLOPS_PER_SECOND: its forwards plus the reference
    (over the sequences the reference covers)."""
    from layerbench.reference import streams_reference
    from layerbench.reference.exact import ORACLE_SEQUENCES

    flops = forwards * forward_flops(config)
    if reference:
        reserve = case_plan(backend_name, config, dtype, "cpu", reference=False).total
        covered = config.batch_size
        if streams_reference(config, torch.device("cpu"), dtype, reserve):
            covered = min(ORACLE_SEQUENCES, config.batch_size)
        flops += forward_flops(config) * covered / max(1, config.batch_size)
    return flops / CPU_FLOPS_PER_SECOND


def admit(backend_name: str, config: LayerConfig, dtype: torch.dtype, device, *,
          outputs: tuple[str, ...] = CHECK_OUTPUTS, reference: bool = True,
          allow_slow: bool = False) -> MemoryPlan:
    """Raise Unsupported unless the case can run here, before anything is allocated.

    The backend must take it, everything the case allocates (case_plan) must fit the device
    (else MemoryPlanError naming the numbers) and, on a CPU, its estimated time must stay
    under CPU_CASE_SECONDS unless allow_slow. Returns the case's plan.
    """
    device = torch.device(device)
    get_backend(backend_name).check(config, device, dtype)
    plan = case_plan(backend_name, config, dtype, device, outputs=outputs, reference=reference)
    check_fits(plan, device, what=f"the {backend_name} case on {config}")
    if device.type == "cpu" and not allow_slow:
        seconds = estimated_cpu_seconds(backend_name, config, dtype, forwards=len(outputs),
                                        reference=reference)
        if seconds > CPU_CASE_SECONDS:
            raise Unsupported(
                f"the {backend_name} case on {config} would take about {seconds / 60:.0f} min "
                f"on a CPU (estimated at {CPU_FLOPS_PER_SECOND / 1e9:g} GFLOP/s), over the "
                f"{CPU_CASE_SECONDS / 60:g} min limit for CPU cases; allow slow cases to run it "
                "(pytest --allow-slow)")
    return plan


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


def prepare_general_mask(shape: Shape, *, seed: int, device,
                         dtype: torch.dtype = torch.float32) -> Prepared:
    """A case whose mask is not suffix padding: sequence 0 has its first 3 tokens invalid
    (leading padding) and sequence 1 tokens 5-8 (an interior hole); invalid rows of x are 0."""
    from layerbench.reference import make_reference

    cfg = shape.config
    if cfg.batch_size < 2 or cfg.seq_len < 10:
        raise ValueError(f"a general-mask case needs 2 sequences of 10 tokens, not {cfg}")
    model = make_reference(cfg, seed=seed, randomize_norms=True)
    x, mask = make_inputs(cfg, seed=seed, device=device, dtype=dtype)
    mask[0, :3] = False
    mask[1, 5:9] = False
    x[~mask] = 0
    return Prepared(shape, model, x, mask, float((~mask).float().mean()), seed)


def oracle_reference(prepared: Prepared) -> tuple[torch.Tensor, None]:
    """The streaming oracle's output for the whole batch, as check() takes a reference."""
    from layerbench.reference import streaming_forward

    return streaming_forward(prepared.model.state_dict(), prepared.shape.config, prepared.x,
                             prepared.mask), None


def build(backend_name: str, prepared: Prepared) -> BuiltLayer:
    """Build backend_name for the case from the reference's state_dict."""
    backend = get_backend(backend_name)
    return backend.build(prepared.shape.config, prepared.model.state_dict(),
                         device=prepared.x.device, dtype=prepared.x.dtype)


def _badness(report: ContractReport) -> tuple:
    ratio = report.worst_ratio
    return (not report.passed, math.inf if math.isnan(ratio) else ratio, report.failed_elements)


def check(layer: BuiltLayer, prepared: Prepared, reference=None
          ) -> tuple[ContractReport, tuple[torch.Tensor, list[int] | None]]:
    """Run layer on the case and apply the official contract to every output.

    The first call allocates its output (on a GPU, the caching allocator is filled with NaN
    first); the second writes into a NaN-filled out= buffer the suite owns, so an element a
    backend never writes fails on every device; on a GPU a third call with the same buffers
    checks the CUDA-graph replay. Returns the worst report (its reason names the call) and
    the reference: (output, batch indices) from a previous call, or None to compute it.
    """
    from layerbench.reference import exact_output

    x, mask, device = prepared.x, prepared.mask, prepared.x.device
    if reference is None:
        cfg = replace(layer.config, batch_size=x.shape[0], seq_len=x.shape[1])
        reserve = len(CHECK_OUTPUTS) * x.numel() * x.element_size() \
            + _backend_plan(layer.backend, cfg, layer.dtype).total
        gen = torch.Generator().manual_seed(prepared.seed)
        reference = exact_output(prepared.model, x, mask, generator=gen, reserve_bytes=reserve)
    ref, indices = reference

    def verdict(out: torch.Tensor, call: str) -> ContractReport:
        report = compare(out if indices is None else out[indices], ref, "official")
        report.reason = "; ".join(filter(None, [call, report.reason]))
        return report

    poison_cached_memory(device, 2 * x.numel() * x.element_size())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        out = layer(x, mask)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    allocating = verdict(out, "layer(x, mask)")
    del out
    buffer = torch.full_like(x, float("nan"))
    with torch.no_grad():
        layer(x, mask, out=buffer)
    into = verdict(buffer, "layer(x, mask, out=NaN-filled buffer)")
    del buffer
    reports = [allocating, into]
    if device.type == "cuda" and x.numel() <= MAX_GRAPH_ELEMENTS:
        # The second call with the same buffers is the one a backend replays from a CUDA graph.
        with torch.no_grad():
            out = layer(x, mask)
        reports.append(verdict(out, "layer(x, mask) repeated"))
        del out
    report = max(reports, key=_badness)
    report.peak_memory_bytes = peak
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


def compare_plans(shapes, build_plan, plans=(True, False), *, padding: float = 0.0,
                  rounds: int = 20, device="cuda", label: str = "plan") -> list[dict]:
    """Two or more plans of one backend per shape: build_plan(plan, config, state_dict) builds
    each; all are checked against one reference and timed in alternating rounds. One row per
    shape: median ms and error/allowed of each, in the order of plans."""
    from .shapes import resolve_shapes

    rows = []
    for shape in resolve_shapes(shapes):
        prepared = prepare(shape, padding=padding, dtype=torch.float32, seed=1234,
                           device=device)
        reference, layers, ratios = None, [], []
        for plan in plans:
            layer = build_plan(plan, shape.config, prepared.model.state_dict())
            report, reference = check(layer, prepared, reference)
            layers.append(layer)
            ratios.append(report.worst_ratio)
        medians = alternating_medians_ms([forward_call(layer, prepared) for layer in layers],
                                         prepared.x.device, rounds=rounds, max_seconds=20.0)
        row = {"shape": shape.number, "plans": list(plans), "median_ms": medians,
               "worst_ratio": ratios}
        rows.append(row)
        print(f"shape {shape.number:2d} {label} {plans[0]}: {medians[0]:8.3f} ms "
              f"(error/allowed {ratios[0]:.3f})" +
              "".join(f"  {plan}: {ms:8.3f} ms ({ratio:.3f})"
                      for plan, ms, ratio in zip(plans[1:], medians[1:], ratios[1:])),
              flush=True)
        del layers, prepared, reference
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def compare_attention_kernels(kernels: dict, *, batch: int, seq_len: int, heads: int,
                              head_dim: int, causal: bool, rounds: int = 10,
                              checked_tokens: int = 8192, device="cuda",
                              label: str = "attention", repeats: int = 1) -> list[dict]:
    """Attention kernels on one packed Q/K/V input ([batch * seq_len, 3 * heads * head_dim]
    fp16): kernels maps a name to run(qkv, ctx_pair), which writes the context as an fp16
    (hi, lo) pair. Each is checked against fp32 attention of the first sequence's first
    checked_tokens rows and timed in alternating rounds: one launch a round, or (repeats > 1,
    CUDA) a CUDA graph of repeats launches, which leaves out the host's time between them.
    One row per kernel: median ms a launch, TFLOP/s, largest absolute error."""
    from layerbench.reference import packed_attention

    device = torch.device(device)
    d = heads * head_dim
    gen = torch.Generator(device=device).manual_seed(seq_len + head_dim)
    qkv = torch.randn(batch * seq_len, 3 * d, device=device, generator=gen).half()
    outputs, runs = {}, []
    for name, run in kernels.items():
        ctx = tuple(torch.full((batch * seq_len, d), math.nan, device=device,
                               dtype=torch.float16) for _ in range(2))
        outputs[name] = ctx
        runs.append(lambda run=run, ctx=ctx: run(qkv, ctx))
    for run in runs:
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    checked = min(seq_len, checked_tokens)
    everyone = torch.ones(1, checked, dtype=torch.uint8, device=device)
    expected = packed_attention(qkv[:checked].contiguous(), everyone, batch=1, seq_len=checked,
                                heads=heads, causal=causal)[0].reshape(checked, d)
    if repeats > 1 and device.type == "cuda":
        runs = [replayed(run, repeats, device) for run in runs]
    else:
        repeats = 1
    medians = [ms / repeats for ms in
               alternating_medians_ms(runs, device, rounds=rounds, max_seconds=20.0)]
    flop = 4.0 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    rows = []
    for (name, (hi, lo)), ms in zip(outputs.items(), medians):
        got = hi[:checked].float() + lo[:checked].float()
        err = (got - expected).abs().nan_to_num(nan=math.inf).max().item()
        rows.append({"kernel": name, "ms": ms, "tflops": flop / ms / 1e9, "max_abs": err})
        print(f"{label} B={batch} S={seq_len} H={heads} hd={head_dim} causal={causal} "
              f"{name:28s} {ms:9.3f} ms {flop / ms / 1e9:6.1f} TFLOP/s max abs {err:.1e}",
              flush=True)
    return rows
