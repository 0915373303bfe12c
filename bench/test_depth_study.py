"""bench/depth_study.py's model: without rounding it is the reference; with it, it errs."""
from __future__ import annotations

import pytest

from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.inputs import make_inputs
from layerbench.reference import make_reference, reference_forward

from bench import depth_study


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_model_without_rounding_is_the_reference(causal):
    """EXACT follows the strict reference to fp32 rounding (masks, causality, invalid rows);
    one fp16 product errs by far more, and three by less than one."""
    cfg = LayerConfig(3, 24, 64, 4, 96, 3, causal)
    model = make_reference(cfg, seed=2)
    x, mask = make_inputs(cfg, padding_ratio=0.4, seed=3)
    expected = reference_forward(model, x, mask)
    ratios = {n: compare(depth_study.emulated_forward(model, x, mask, n).float(),
                         expected).worst_ratio for n in (depth_study.EXACT, 1, 3)}
    assert ratios[depth_study.EXACT] < 1e-2
    assert ratios[1] > ratios[3] > ratios[depth_study.EXACT]
    assert ratios[1] > 0.05


def test_study_rows():
    """One row per (blocks, products), with the worst ratio over the seeds."""
    rows = depth_study.study(LayerConfig(2, 8, 32, 2, 32, 1), [1, 2], [1, 3], 2, 0.25)
    assert [(r["blocks"], r["products"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(0 < r["worst_ratio"] < 1 and r["failed_seeds"] == 0 for r in rows)


def test_zero_rows_taken_as_valid_err_more():
    """With the padded (zero) rows taken as valid, one product errs more than on the same
    inputs with those rows masked: the final norm magnifies the roundings of their small
    residual stream."""
    cfg = LayerConfig(2, 32, 256, 2, 256, 1)
    masked = depth_study.study(cfg, [2], [1], 1, 0.4, first_seed=3)
    valid = depth_study.study(cfg, [2], [1], 1, 0.4, zero_rows_valid=True, first_seed=3)
    assert valid[0]["worst_ratio"] > 1.3 * masked[0]["worst_ratio"]
