"""Calls off the suite's usual path, for every backend: masks whose valid tokens are not a
prefix (a sequence with none, valid tokens only at the end, a single one), batches and
lengths other than the build's, and inputs, masks and outputs that are contiguous views not
16 bytes from an allocation's start. Each must meet the contract against the streaming
oracle, with every invalid row exactly 0 and every output element written."""
from __future__ import annotations

import math

import pytest
import torch

from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.registry import get_backend
from layerbench.common.runner import admit
from layerbench.reference import make_reference, streaming_forward

# d_model 32 (head dim 8): the whole-block kernels of cupy and cutile and wmma's ffn_block
# run it; d_model 64, one head of 64, non-causal: the separate kernels.
CONFIGS = {"d32-h4": LayerConfig(2, 24, 32, 4, 32, 2),
           "d64-h1-full": LayerConfig(2, 40, 64, 1, 64, 1, causal=False)}


def _prefix(batch, seq_len, lengths):
    """A [batch, seq_len] mask whose sequence b has its first lengths[b] tokens valid."""
    return torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]


def _none_valid(batch, seq_len):
    """Sequence 0 without a valid token, the others padded at the end."""
    mask = _prefix(batch, seq_len, [seq_len - 3] * batch)
    mask[0] = False
    return mask


def _suffix_only(batch, seq_len):
    """Valid tokens only in the second half (the last token of the last sequence not)."""
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    mask[:, seq_len // 2:] = True
    mask[-1, -1] = False
    return mask


def _single(batch, seq_len):
    """One valid token a sequence, a third of the way in."""
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    mask[:, seq_len // 3] = True
    return mask


def _holes(batch, seq_len):
    """Padding at the end and tokens 3-5 invalid in every sequence."""
    mask = _prefix(batch, seq_len, [seq_len - 2 * b for b in range(batch)])
    mask[:, 3:6] = False
    return mask


def _offset(t: torch.Tensor, shift_bytes: int) -> torch.Tensor:
    """A contiguous copy of t starting shift_bytes past a fresh allocation's start."""
    raw = torch.empty(t.numel() * t.element_size() + shift_bytes, dtype=torch.uint8,
                      device=t.device)
    view = raw[shift_bytes:].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


COMPILED_PEERS = ("torch-compile", "torch-fp16")

# name -> (batch, seq_len of the call (None: the build's), mask maker (None: no mask),
# byte offset of x and out, byte offset of the mask)
CASES = {
    "no-valid-token": (None, None, _none_valid, 0, 0),
    "suffix-only": (None, None, _suffix_only, 0, 0),
    "single-token": (None, None, _single, 0, 0),
    "longer-call-holes": (3, 70, _holes, 0, 0),
    "one-token-call": (3, 1, None, 0, 0),
    "batch-1-call": (1, 13, _holes, 0, 0),
    "offset-views": (None, None, _holes, 4, 1),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_odd_call(backend_name, config_name, case, device, seed, allow_slow):
    """The call meets the contract, writes every element of a NaN-filled out buffer, and
    leaves each invalid row exactly 0; a layer built for one shape runs the other."""
    if backend_name in COMPILED_PEERS:
        pytest.skip(f"{backend_name} compiles torch-sdpa's stack once per input shape: its "
                    "call paths are torch-sdpa's, tested there")
    cfg = CONFIGS[config_name]
    batch, seq_len, make_mask, shift, mask_shift = CASES[case]
    batch = batch or cfg.batch_size
    seq_len = seq_len or cfg.seq_len
    try:
        admit(backend_name, cfg, torch.float32, device, allow_slow=allow_slow)
        model = make_reference(cfg, seed=seed)
        layer = get_backend(backend_name).build(cfg, model.state_dict(), device=device)
    except Unsupported as exc:
        pytest.skip(str(exc))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=gen)
    mask = None if make_mask is None else make_mask(batch, seq_len)
    if mask is not None:
        x = x.masked_fill(~mask[..., None], 0.0)
    expected = streaming_forward(model.state_dict(), cfg, x, mask)
    x = _offset(x.to(device), shift)
    if mask is not None:
        mask = _offset(mask.to(device), mask_shift)
    out = _offset(torch.full_like(x, math.nan), shift)
    try:
        with torch.no_grad():
            got = layer(x, mask, out=out)
    except Unsupported as exc:
        pytest.skip(str(exc))
    assert got is out
    report = compare(got, expected)
    assert report.passed, report.summary()
    if mask is not None:
        invalid = got[~mask]
        assert torch.equal(invalid, torch.zeros_like(invalid)), "an invalid row is not 0"
