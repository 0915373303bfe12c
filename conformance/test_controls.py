"""Negative controls: the suite's own checks reject every backend that is wrong on purpose.

Each control (conformance/controls.py) wraps the strict-fp32 reference with one defect and
runs through the contract check (padding 0.25), the general-mask check and the non-causal
check on small CI shapes. The honest wrapper must pass all three, so a failure here is the
defect's, not the wrapper's.
"""
from __future__ import annotations

import pytest
import torch

from layerbench.common import registry, runner
from layerbench.common.contract import compare
from layerbench.common.shapes import CI, noncausal

from controls import (CONTROLS, BiasedElementControl, CausalAlwaysControl, HonestControl,
                      KeysUnmaskedControl, MaskIgnoredControl, UnwrittenRowControl)

SHAPES = (1, 7)  # CI shapes: d_model 128 with head dim 32, d_model 32 with head dim 8
PADDING = 0.25


def _contract(name, number, device, seed):
    """The contract check of test_contract: a padded float32 case."""
    shape = CI[number]
    runner.admit(name, shape.config, torch.float32, device)
    prepared = runner.prepare(shape, padding=PADDING, dtype=torch.float32, seed=seed,
                              device=device)
    report, _ = runner.check(runner.build(name, prepared), prepared)
    return report, prepared


def _general_mask(name, number, device, seed):
    """The check of test_general_mask (causal): leading padding and a hole, against the oracle."""
    shape = CI[number]
    runner.admit(name, shape.config, torch.float32, device)
    prepared = runner.prepare_general_mask(shape, seed=seed, device=device)
    report, _ = runner.check(runner.build(name, prepared), prepared,
                             runner.oracle_reference(prepared))
    return report, prepared


def _noncausal(name, number, device, seed):
    """The contract check of a non-causal CI case."""
    shape = noncausal(CI[number])
    runner.admit(name, shape.config, torch.float32, device)
    prepared = runner.prepare(shape, padding=PADDING, dtype=torch.float32, seed=seed,
                              device=device)
    report, _ = runner.check(runner.build(name, prepared), prepared)
    return report, prepared


CHECKS = {"contract": _contract, "general mask": _general_mask, "non-causal": _noncausal}


def must_fail(control, check: str, prepared) -> bool:
    """Whether the suite's check must reject the control on these inputs."""
    if control is HonestControl:
        return False
    if control is CausalAlwaysControl:
        return check == "non-causal"
    if control is MaskIgnoredControl:  # the mask matters only where it has an invalid token
        return not bool(prepared.mask.all())
    if control is KeysUnmaskedControl:  # causal suffix padding hides invalid keys anyway
        return check == "general mask" or (check == "non-causal"
                                           and not bool(prepared.mask.all()))
    return True  # an unwritten row, ignored LayerNorm parameters, a biased element


@pytest.fixture(scope="module")
def registered():
    """Registers the controls for this module only (the registry is restored afterwards)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_extra", dict(registry._extra))
        patch.setattr(registry, "_cache", dict(registry._cache))
        for control in CONTROLS:
            registry.register(control, replace=True)
        yield


def test_controls_are_not_builtin():
    """The controls are registered by these tests only, never by default."""
    names = {c.name for c in CONTROLS}
    assert not names & set(registry.BUILTIN)


@pytest.mark.parametrize("number", SHAPES, ids=[CI[n].id for n in SHAPES])
@pytest.mark.parametrize("control", CONTROLS, ids=[c.name for c in CONTROLS])
def test_suite_rejects_control(registered, control, number, device, seed):
    """Every check that must catch the control fails it; the others pass it."""
    verdicts = {}
    for check, run in CHECKS.items():
        report, prepared = run(control.name, number, device, seed)
        verdicts[check] = report
        expected = must_fail(control, check, prepared)
        assert report.passed != expected, (
            f"{control.name} ({control.defect}) on {CI[number].id}, {check} check: expected "
            f"{'FAIL' if expected else 'PASS'}, got {report.summary()}")
    if control is BiasedElementControl:  # one element over its bound fails the case
        assert all(r.failed_elements == 1 for r in verdicts.values())
    if control is UnwrittenRowControl:  # the NaN-filled out= buffer keeps the row non-finite
        assert all(r.worst_ratio == float("inf") for r in verdicts.values())


class _ZeroedUnwrittenRow(UnwrittenRowControl):
    """Leaves row (0, 0) unwritten and allocates zeros: only the out= buffer can catch it where
    that row's reference is 0 (an invalid token)."""

    name = "control-zeroed-unwritten-row"

    def rows_written(self, x):
        """Every row but (0, 0)."""
        rows = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        rows[0, 0] = False
        return rows

    def allocate(self, x):
        """A zero-filled output."""
        return torch.zeros_like(x)


def test_out_buffer_catches_what_allocation_hides(registered, device, seed):
    """An unwritten row whose allocated output happens to be right still fails the check,
    through the NaN-filled out= buffer (on a CPU no memory is poisoned)."""
    registry.register(_ZeroedUnwrittenRow, replace=True)
    prepared = runner.prepare_general_mask(CI[1], seed=seed, device=device)
    assert not prepared.mask[0, 0]
    layer = runner.build(_ZeroedUnwrittenRow.name, prepared)
    with torch.no_grad():
        allocated = layer(prepared.x, prepared.mask)
    reference = runner.oracle_reference(prepared)
    assert compare(allocated, reference[0]).passed
    report, _ = runner.check(layer, prepared, reference)
    assert not report.passed and "out=" in report.reason
    assert report.failed_elements == CI[1].config.d_model
