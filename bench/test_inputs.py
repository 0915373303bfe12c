"""The inputs the benchmark times (no timing involved)."""
from __future__ import annotations

import torch

from layerbench.common.shapes import CI

from .conftest import ShapeState


def test_benchmark_pads_inputs_at_the_given_ratio():
    """ShapeState prepares an all-valid mask at padding 0 and invalid tail tokens at 0.25."""
    shape = CI[13]  # 2 sequences of 80 tokens
    plain = ShapeState(torch.device("cpu"), seed=3).enter(shape).prepared
    assert plain.mask.all()
    padded = ShapeState(torch.device("cpu"), seed=3, padding=0.25).enter(shape).prepared
    lengths = padded.mask.sum(dim=1)
    assert (lengths < shape.config.seq_len).any() and (lengths >= 60).all()
    for row, length in zip(padded.mask, lengths.tolist()):  # valid tokens form a prefix
        assert row[:length].all() and not row[length:].any()
