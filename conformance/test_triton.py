"""Triton-specific cases: the other precision modes (the default runs in test_conformance)
and the batch streaming plan."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import runner
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.shapes import CI
from layerbench.reference import reference_forward

MODES = [("fp16x3", "tf32x3"), ("tf32x3", "fp16"), ("tf32x3", "tf32x3"), ("ieee", "fp16"),
         ("fp16", "fp16")]


@pytest.fixture(scope="module")
def triton_backend_class():
    """The Triton backend class, or a skip if Triton cannot run here."""
    pytest.importorskip("triton")
    from layerbench.backends.triton import TritonBackend
    return TritonBackend


def _prepare(shape, device):
    """The case's model and inputs (padding 0.25, so the mask has invalid keys)."""
    return runner.prepare(shape, padding=0.25, dtype=torch.float32, seed=0, device=device)


def _assert_keeps_contract(layer, prepared, device, mask=None):
    """Run layer on the prepared inputs (with mask instead of theirs, if given) and assert its
    output keeps the contract against the reference."""
    mask = prepared.mask if mask is None else mask
    with torch.no_grad():
        out = layer(prepared.x, mask)
    expected = reference_forward(prepared.model.to(device), prepared.x, mask)
    report = compare(out, expected)
    assert report.passed, report.summary()


@pytest.mark.parametrize("linear,attention", MODES, ids=[f"{a}-{b}" for a, b in MODES])
def test_precision_mode_passes(triton_backend_class, linear, attention, device):
    """Each (linear, attention) precision pair computes the stack within the contract."""
    from layerbench.backends.triton.layer import Precision

    shape = CI[2]
    prepared = _prepare(shape, device)
    backend = triton_backend_class(Precision(linear, attention))
    try:
        layer = backend.build(shape.config, prepared.model.state_dict(), device=device)
    except Unsupported as exc:
        pytest.skip(str(exc))
    _assert_keeps_contract(layer, prepared, device)


@pytest.mark.parametrize("apart, apart_rows", [(False, 0), (True, 0), (True, 16)],
                         ids=["heads-in-one-program", "heads-apart", "heads-apart-16-rows"])
def test_narrow_plan_attention_layouts(triton_backend_class, apart, apart_rows, device,
                                       monkeypatch):
    """Attention inside attention_ffn, or apart with a program per (block, head) at the
    default or at 16 rows per program: all pass."""
    from layerbench.backends.triton import narrow_block
    from layerbench.backends.triton.layer import Precision, workspace

    tiles = narrow_block.block_config()._replace(heads_apart=apart, apart_rows=apart_rows)
    monkeypatch.setattr(narrow_block, "block_config", lambda: tiles)
    shape = CI[11]  # 16 heads of 8
    prepared = _prepare(shape, device)
    layer = triton_backend_class().build(shape.config, prepared.model.state_dict(),
                                         device=device)
    assert ("ctx_hi" in workspace(shape.config, Precision())) == apart
    _assert_keeps_contract(layer, prepared, device)


@pytest.mark.parametrize("number", [1, 8], ids=["narrow", "wide"])
def test_qkv_in_fp16_passes(triton_backend_class, number, device):
    """The Q/K/V projection in one fp16 product (the other linears fp16x3) keeps the contract."""
    from layerbench.backends.triton.layer import Precision, plan

    shape = CI[number]
    precision = Precision("fp16x3", "fp16", qkv="fp16")
    assert plan(shape.config, precision) == ("narrow" if number == 1 else "wide")
    prepared = _prepare(shape, device)
    layer = triton_backend_class(precision).build(shape.config, prepared.model.state_dict(),
                                                  device=device)
    _assert_keeps_contract(layer, prepared, device)


def test_batch_chunks_respect_the_attention_grid(triton_backend_class, device):
    """A batch whose sequences x heads exceed the grid limit is streamed in smaller chunks."""
    from layerbench.backends.triton.layer import MAX_GRID_Y
    from layerbench.common.config import LayerConfig
    from layerbench.reference import make_reference

    cfg = LayerConfig(100_000, 4, 128, 16, 32, 1)
    layer = triton_backend_class().build(cfg, make_reference(cfg).state_dict(), device=device)
    chunk = layer._sequences_per_chunk(cfg.batch_size, cfg.seq_len)
    assert 1 <= chunk and chunk * cfg.num_heads <= MAX_GRID_Y


@pytest.mark.parametrize("mask", ["prefix", "hole"])
def test_attention_in_two_halves_passes(triton_backend_class, mask, device, monkeypatch):
    """flash_attention with two pipelined query halves (16 rows each, 16-key blocks, so the
    pipelined loop runs several steps) keeps the contract, with a prefix and a holed mask."""
    from layerbench.backends.triton import attention

    tiles = attention.AttentionTiles(32, 16, 4, 1, True)
    monkeypatch.setattr(attention, "attention_config", lambda head_pad, precision: tiles)
    shape = CI[14]  # head dim 64, 100 tokens: up to 6 pipelined key steps per query block
    prepared = _prepare(shape, device)
    valid = prepared.mask.clone()
    if mask == "hole":  # not a prefix: every key block loads the mask
        valid[:, 5] = False
    layer = triton_backend_class().build(shape.config, prepared.model.state_dict(),
                                         device=device)
    _assert_keeps_contract(layer, prepared, device, valid)


def test_rows_per_program_when_attention_runs_apart(triton_backend_class, monkeypatch):
    """16 or 32 rows while the grid stays within one program per SM, else 64; a set
    apart_rows wins."""
    from layerbench.backends.triton import narrow_block

    monkeypatch.setattr(narrow_block, "_multiprocessors", lambda device: 132)
    by_grid = narrow_block.NARROW_TILES._replace(apart_rows=0)
    monkeypatch.setattr(narrow_block, "block_config", lambda: by_grid)
    cuda = torch.device("cuda")
    chosen = {rows: narrow_block.rows_apart(rows, cuda) for rows in (128, 2048, 4096, 8192)}
    assert chosen == {128: 16, 2048: 16, 4096: 32, 8192: 64}
    set_rows = by_grid._replace(apart_rows=32)
    monkeypatch.setattr(narrow_block, "block_config", lambda: set_rows)
    assert narrow_block.rows_apart(128, cuda) == 32
