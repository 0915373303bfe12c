"""The pieces every backend relies on: shapes, contract, registry, reference and oracle."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import registry
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.inputs import make_inputs, prefix_lengths
from layerbench.common.interface import Backend, BuiltLayer, Capabilities
from layerbench.common.shapes import CI, OFFICIAL, resolve_shapes
from layerbench.reference import make_reference, reference_forward, streaming_forward

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
    with pytest.raises(ValueError):
        resolve_shapes("15")


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
