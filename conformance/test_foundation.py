"""The pieces every backend relies on: shapes, contract, registry, reference and oracle."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import memory, registry, runner, selection
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import MemoryPlanError, Unsupported
from layerbench.common.inputs import make_inputs, prefix_lengths
from layerbench.common.interface import Backend, BuiltLayer, Capabilities
from layerbench.common.memory import GIB
from layerbench.common.shapes import CI, HEAD_DIM_SHAPES, OFFICIAL, resolve_shapes
from layerbench.reference import (make_reference, reference_forward, reference_plan,
                                  streaming_forward)

SPEC_TABLE = [(64, 128, 128, 4, 128, 4), (1, 128, 128, 4, 128, 4), (4, 128, 128, 4, 128, 4),
              (16, 128, 128, 4, 128, 4), (128, 128, 128, 4, 128, 4),
              (10000, 128, 128, 4, 128, 4), (64, 128, 32, 4, 32, 4),
              (64, 128, 1024, 4, 1024, 4), (64, 128, 128, 1, 128, 4),
              (64, 128, 128, 2, 128, 4), (64, 128, 128, 16, 128, 4), (64, 32, 128, 4, 128, 4),
              (64, 1024, 128, 4, 128, 4), (32, 100000, 1024, 16, 1024, 2)]


def test_official_shapes_match_the_spec():
    """The 14 official shapes are the table of docs/spec.md, all causal."""
    got = [(s.config.batch_size, s.config.seq_len, s.config.d_model, s.config.num_heads,
            s.config.ffn_dim, s.config.num_layers) for s in OFFICIAL.values()]
    assert got == SPEC_TABLE
    assert all(s.config.causal for s in OFFICIAL.values())


def test_ci_shapes_keep_head_dims():
    """Each CI variant has its official shape's head dim, d_model, ffn and layer count."""
    for n, shape in CI.items():
        a, b = shape.config, OFFICIAL[n].config
        assert (a.head_dim, a.d_model, a.ffn_dim, a.num_layers) == \
            (b.head_dim, b.d_model, b.ffn_dim, b.num_layers)
        assert a.tokens <= 256


def test_resolve_shapes():
    """Shape specs resolve by name and by number, and unknown ones are refused."""
    assert [s.number for s in resolve_shapes("1,8,ci3")] == [1, 8, 3]
    assert resolve_shapes("ci3")[0].kind == "ci"
    for bad in ("15", "hd50", "nc", "ncci15", "x1"):
        with pytest.raises(ValueError):
            resolve_shapes(bad)


def test_noncausal_shapes_are_named_apart():
    """'nc' names a shape's non-causal variant, with its own id and kind; groups expand."""
    nc1, ci3 = resolve_shapes("nc1,ncci3")
    assert not nc1.config.causal and nc1.id == "s01-base-noncausal"
    assert nc1.kind == "official-noncausal" and nc1.table == "official"
    assert nc1.config == LayerConfig(64, 128, 128, 4, 128, 4, causal=False)
    assert not ci3.config.causal and ci3.id == "ci03-batch4-noncausal"
    assert [(s.number, s.config.causal) for s in resolve_shapes("noncausal")] == \
        [(1, False), (8, False), (13, False)]
    ci_nc = resolve_shapes("ci-noncausal")
    assert len(ci_nc) == len(CI) and not any(s.config.causal for s in ci_nc)
    assert len({s.id for s in resolve_shapes("ci,ci-noncausal")}) == 2 * len(CI)
    assert resolve_shapes("1,1,official")[:1] == [OFFICIAL[1]]
    assert len(resolve_shapes("1,1,official")) == len(OFFICIAL)


def test_head_dim_shapes():
    """Head dims 24-192: 2 heads, d_model = ffn = 2 * head dim, 2 x 40 tokens, 2 blocks."""
    shapes = resolve_shapes("headdims")
    assert [s.config.head_dim for s in shapes] == [24, 48, 80, 96, 112, 160, 192]
    for s in shapes:
        c = s.config
        assert (c.batch_size, c.seq_len, c.num_heads, c.num_layers) == (2, 40, 2, 2)
        assert c.d_model == c.ffn_dim == 2 * c.head_dim and c.causal
    assert resolve_shapes("hd48")[0] is HEAD_DIM_SHAPES[48]
    assert HEAD_DIM_SHAPES[48].id == "hd48-d96h2"


class _Options:
    """A stand-in for pytest's config: getoption from a dict."""

    def __init__(self, **options):
        self.options = {f"--{k.replace('_', '-')}": v for k, v in options.items()}

    def getoption(self, name, default=None):
        return self.options.get(name, default)


def test_default_selection_adds_noncausal_and_head_dims():
    """Conformance by default: CPU ci + non-causal ci + head dims; GPU official + non-causal
    1, 8, 13 + head dims. The benchmark's default stays the plain official / ci shapes."""
    cpu = {s.id for s in selection.conformance_shapes(_Options(device="cpu"))}
    assert {s.id for s in resolve_shapes("ci,ci-noncausal,headdims")} == cpu
    gpu = selection.conformance_shapes(_Options(device="cuda"))
    assert [s.id for s in gpu if not s.config.causal] == \
        ["s01-base-noncausal", "s08-dmodel1024-noncausal", "s13-seq1024-noncausal"]
    assert len(gpu) == len(OFFICIAL) + 3 + len(HEAD_DIM_SHAPES)
    assert selection.selected_shapes(_Options(device="cpu")) == list(CI.values())
    assert selection.conformance_shapes(_Options(device="cpu", shapes="2")) == [OFFICIAL[2]]


def test_a_shape_without_cases_says_why():
    """Shape 14 with only half dtypes and head-dim shapes without float32 give no case and a
    reason; otherwise their cases are the float32 ones (head dims: padding 0.25); the CI
    variants of the d_model-1024 shapes run one case and no determinism case."""
    half = _Options(dtype=["float16"])
    for shape in (OFFICIAL[14], HEAD_DIM_SHAPES[24]):
        cases, reason = selection.shape_cases(shape, half)
        assert cases == [] and "float32" in reason and shape.id in reason
    assert selection.shape_cases(OFFICIAL[14], _Options())[0] == \
        [("float32", 0.0), ("float32", 0.25)]
    assert selection.shape_cases(HEAD_DIM_SHAPES[24], _Options(padding=[0.0]))[0] == \
        [("float32", 0.25)]
    assert len(selection.shape_cases(OFFICIAL[1], _Options())[0]) == 4
    assert len(selection.shape_cases(CI[1], _Options())[0]) == 4
    for wide in (CI[8], CI[14]):  # d_model 1024 on a CPU: one case, no determinism case
        assert selection.shape_cases(wide, _Options())[0] == [("float32", 0.25)]
        assert wide.id in selection.determinism_reason(wide)
    assert selection.determinism_reason(OFFICIAL[14]) and not selection.determinism_reason(CI[13])
    assert not selection.determinism_reason(OFFICIAL[8])


def test_case_plan_counts_everything_the_case_allocates(monkeypatch):
    """On a 24 GB CPU, shape 14 is refused before allocating: its input, output and out=
    buffer alone (12.2 GiB each) exceed the memory, though one sequence's working set fits."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 * 10 ** 9)
    cfg = OFFICIAL[14].config
    plan = runner.case_plan("torch-sdpa", cfg, torch.float32, "cpu")
    for item in ("input x", "output", "out= buffer"):
        assert plan.items[item] == 4 * cfg.tokens * cfg.d_model
    assert any(k.startswith("torch-sdpa ") for k in plan.items)
    assert any(k.startswith("reference oracle") for k in plan.items)
    with pytest.raises(MemoryPlanError) as info:
        runner.admit("torch-sdpa", cfg, torch.float32, "cpu")
    message = str(info.value)
    assert "GiB" in message and "input x 12.21 GiB" in message and "out= buffer" in message
    runner.admit("torch-sdpa", CI[14].config, torch.float32, "cpu")


def test_reference_plan_follows_exact_output(monkeypatch):
    """The plan takes the whole-batch baseline where it fits, else the streaming oracle on
    two sequences, as exact_output does."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 24 * 10 ** 9)
    small = reference_plan(CI[1].config, torch.device("cpu"))
    assert "scores" in small.items and "baseline output" in small.items
    huge = reference_plan(OFFICIAL[14].config, torch.device("cpu"))
    assert huge.items["oracle output"] == 2 * 2 * 4 * 100_000 * 1024
    assert huge.total < 20 * GIB


def test_slow_cpu_cases_are_skipped_unless_allowed(monkeypatch):
    """A case that fits but is estimated over the CPU time limit is refused with the estimate,
    unless slow cases are allowed; CI shapes are far below the limit."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 50)
    cfg = OFFICIAL[14].config
    seconds = runner.estimated_cpu_seconds("torch-sdpa", cfg, torch.float32)
    assert seconds > runner.CPU_CASE_SECONDS
    with pytest.raises(Unsupported, match="allow-slow") as info:
        runner.admit("torch-sdpa", cfg, torch.float32, "cpu")
    assert not isinstance(info.value, MemoryPlanError) and "GFLOP/s" in str(info.value)
    runner.admit("torch-sdpa", cfg, torch.float32, "cpu", allow_slow=True)
    assert runner.estimated_cpu_seconds("torch-baseline", CI[8].config, torch.float32) < 1
    assert runner.estimated_cpu_seconds("torch-baseline", OFFICIAL[13].config,
                                        torch.float32) < runner.CPU_CASE_SECONDS


def test_contract_is_an_or_of_the_two_bounds():
    """|u-r| <= atol OR |u-r| <= rtol|r|: each bound alone admits, neither fails."""
    ref = torch.tensor([1.0, 100.0, 0.0])
    assert compare(ref + torch.tensor([0.0019, 1.9, 0.0019]), ref).passed
    report = compare(ref + torch.tensor([0.0, 2.1, 0.0021]), ref)
    assert not report.passed and report.failed_elements == 2
    # Worst by error/allowed: 0.0021/0.002 > 2.1/2.0.
    assert report.worst_index == (2,) and report.worst_reference == 0.0


def test_contract_fails_non_finite_and_shape_mismatch():
    """A NaN or Inf output fails; a shape mismatch fails every element."""
    ref = torch.zeros(4)
    assert compare(torch.tensor([0.0, float("nan"), 0.0, 0.0]), ref).failed_elements == 1
    assert compare(torch.tensor([0.0, 0.0, float("inf"), 0.0]), ref).failed_elements == 1
    bad = compare(torch.zeros(5), ref)
    assert not bad.passed and "shape" in bad.reason


def test_contract_presets():
    """'strict' is tighter than 'official'."""
    ref = torch.ones(1)
    assert compare(ref + 0.015, ref, "official").passed
    assert not compare(ref + 0.015, ref, "strict").passed


@pytest.mark.parametrize("number", [1, 7, 9, 11, 13, 14])
@pytest.mark.parametrize("padding", [0.0, 0.25])
def test_oracle_matches_baseline(number, padding):
    """The streaming oracle and the strict baseline agree to fp32 rounding."""
    cfg = CI[number].config
    model = make_reference(cfg, seed=number)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=number + 100)
    full = reference_forward(model, x, mask)
    streamed = streaming_forward(model.state_dict(), cfg, x, mask, query_block=16)
    assert (full - streamed).abs().max() < 2e-5
    last = streaming_forward(model.state_dict(), cfg, x, mask, batch_indices=[cfg.batch_size - 1])
    assert torch.allclose(last[0], full[-1], atol=2e-5, rtol=0)


def test_state_dict_names_are_the_spec_names():
    """Parameter names follow docs/spec.md so one state_dict loads anywhere (strict)."""
    cfg = LayerConfig(1, 8, 16, 2, 32, 2)
    names = set(make_reference(cfg).state_dict())
    assert "layers.1.attention.out_proj.bias" in names and "final_norm.weight" in names
    assert len(names) == 2 * 16 + 2


def test_layernorm_parameters_are_randomised():
    """The conformance reference does not keep LayerNorm at weight 1, bias 0."""
    sd = make_reference(CI[1].config, seed=3).state_dict()
    assert not torch.all(sd["layers.0.norm1.weight"] == 1)
    assert not torch.all(sd["final_norm.bias"] == 0)


def test_generator_pads_at_the_end():
    """Harness-like inputs: suffix padding within the ratio, zero rows at invalid positions."""
    cfg = LayerConfig(64, 40, 8, 2, 8, 1)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=1)
    lengths = prefix_lengths(mask)
    assert lengths is not None and lengths.min() >= 30 and lengths.max() <= 40
    assert (x[~mask] == 0).all()
    _, all_true = make_inputs(cfg, seed=1)
    assert all_true.all()


class _ToyBackend(Backend):
    name = "toy-identity"
    summary = "returns its input (for registry tests)"
    capabilities = Capabilities(devices=("cpu",), dtypes=(torch.float32,), head_dims=(4,))

    def _build(self, config, state_dict, device, dtype):
        backend = self

        class Layer(BuiltLayer):
            def forward(self, x, valid_token_mask):
                return x.clone()

        return Layer(backend, config, device, dtype)


def test_registry_lists_gets_and_registers(monkeypatch):
    """Built-ins are listed with capabilities; a run-time backend registers and is checked."""
    monkeypatch.setattr(registry, "_cache", dict(registry._cache))
    monkeypatch.setattr(registry, "_extra", {})
    listing = {row["name"]: row for row in registry.list_backends()}
    assert {"torch-baseline", "torch-sdpa", "torch-compile"} <= set(listing)
    assert "dtypes" in listing["torch-sdpa"]
    with pytest.raises(KeyError, match="no backend named"):
        registry.get_backend("no-such-backend")
    toy = registry.register(_ToyBackend, replace=True)
    assert registry.get_backend("toy-identity") is toy
    cfg = LayerConfig(1, 4, 16, 2, 8, 1)
    with pytest.raises(registry.Unsupported, match="head dims"):
        toy.build(cfg, make_reference(cfg).state_dict(), device="cpu")


def test_entry_point_backends_are_found(monkeypatch):
    """A backend published under the 'layerbench.backends' entry-point group is loadable."""

    class FakeEntryPoint:
        name = "toy-identity"

        def load(self):
            return _ToyBackend

    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEntryPoint()])
    monkeypatch.setattr(registry, "_cache", {})
    monkeypatch.setattr(registry, "_extra", {})
    assert "toy-identity" in registry.backend_names()
    assert registry.get_backend("toy-identity").name == "toy-identity"


def test_background_jobs_hand_over_results_and_errors():
    """A job started in the background gives its result (or raises its error) to the first
    caller that asks for its key, once; a key never started runs the work in the caller; a
    scratch folder is new and empty."""
    import threading

    import background

    release = threading.Event()
    background.start("test-result", lambda: release.wait(5) and 42)
    background.start("test-result", lambda: 0)  # already started: not replaced
    release.set()
    assert background.result("test-result", lambda: -1) == 42
    assert background.result("test-result", lambda: -1) == -1  # handed over once

    def fail():
        raise RuntimeError("compile failed")

    background.start("test-error", fail)
    with pytest.raises(RuntimeError, match="compile failed"):
        background.result("test-error", lambda: None)
    folder = background.scratch("layerbench-test-")
    assert folder.is_dir() and not any(folder.iterdir())


def test_a_workspace_that_does_not_fit_releases_the_cache_then_halves_the_chunk(monkeypatch):
    """allocate_workspace, where the planned workspace does not fit: cached blocks are
    released once, then the chunk halves until it fits and the plan keeps that chunk, which
    run_in_chunks then runs over every sequence once; one sequence that does not fit raises
    the device's error."""
    from layerbench.common import cuda_host

    cuda = torch.device("cuda")
    plan = cuda_host.ChunkPlan(cuda, lambda s: 1, 0)
    plan.chunks[(10, 4)] = 16
    real_empty, released, fits_rows = torch.empty, [], [12]

    def empty(rows, cols, device=None, dtype=None):
        if rows > fits_rows[0]:
            raise torch.OutOfMemoryError("out of memory")
        return real_empty(rows, cols, dtype=dtype)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    space = {"w": (3, torch.float32)}
    work = cuda_host.allocate_workspace(plan, 10, 4, space, cuda)
    assert released == [True] and plan(10, 4) == 2 and work["w"].shape == (8, 3)

    x = torch.arange(10 * 4 * 2, dtype=torch.float32).view(10, 4, 2)
    out, seen = torch.zeros_like(x), []

    def run(b0, b1, x2, out2, work):
        assert work["w"].shape == ((b1 - b0) * 4, 3)
        seen.append((b0, b1))
        out2.copy_(x2 + 1)

    cuda_host.run_in_chunks(x, out, plan, space, run)
    assert seen == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)] and torch.equal(out, x + 1)
    fits_rows[0] = 3
    with pytest.raises(torch.OutOfMemoryError):
        cuda_host.allocate_workspace(plan, 10, 4, space, cuda)
    assert plan(10, 4) == 1


def test_packed_parameters_are_fresh_copies():
    """pack_params copies every tensor, also one already in the wanted dtype and device that
    is a view at an odd offset of a larger buffer: the result is 16-byte aligned and shares
    no memory with the caller's tensors, so a later change to the model leaves it alone."""
    from layerbench.common.params import pack_params

    cfg = LayerConfig(1, 8, 16, 2, 24, 1)
    sd = make_reference(cfg, seed=5).state_dict()
    flat = torch.cat([torch.zeros(1)] + [t.detach().reshape(-1) for t in sd.values()])
    views, offset = {}, 1
    for key, t in sd.items():
        views[key] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    params = pack_params(cfg, views, device="cpu")
    tensors = [params.final_weight, params.final_bias] + [
        t for layer in params.layers for t in vars(layer).values()]
    for t in tensors:
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
        assert t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    before = params.layers[0].norm1_weight.clone()
    views["layers.0.norm1.weight"].add_(1.0)
    assert torch.equal(params.layers[0].norm1_weight, before)
