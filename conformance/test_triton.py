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


def test_attention_skips_query_blocks_past_the_valid_prefix(triton_backend_class, device):
    """flash_attention matches fp32 attention on every query row of a valid prefix (and on the
    rows after it inside the same query block), and writes 0 for query blocks wholly past it
    (padding rows, whose context out_proj discards)."""
    from layerbench.backends.triton import attention

    batch, seq_len, heads, head_dim = 2, 100, 2, 64
    d = heads * head_dim
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(batch * seq_len, 3 * d, generator=gen).to(device, torch.float16)
    lengths = [40, seq_len]
    valid = torch.zeros(batch, seq_len, dtype=torch.uint8)
    for b, n in enumerate(lengths):
        valid[b, :n] = 1
    valid = valid.to(device)
    key_end = attention.key_extent(valid, torch.empty(batch, dtype=torch.int32, device=device))
    ctx = torch.full((batch * seq_len, d), float("nan"), device=device)
    attention.flash_attention(qkv, ctx, valid, key_end, batch=batch, seq_len=seq_len,
                              num_heads=heads, precision="fp16", config=(32, 16, 4, 1))

    q, k, v = (t.float().view(batch, seq_len, heads, head_dim).transpose(1, 2)
               for t in qkv.split(d, dim=1))
    scores = q @ k.transpose(-1, -2) * head_dim ** -0.5
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    visible = visible & (valid != 0)[:, None, None, :]
    expected = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v)
    expected = expected.transpose(1, 2).reshape(batch, seq_len, d)
    out = ctx.view(batch, seq_len, d)
    computed_end = [-(-n // 32) * 32 for n in lengths]  # through the end of the prefix's block
    for b, end in enumerate(computed_end):
        torch.testing.assert_close(out[b, :end], expected[b, :end], atol=2e-3, rtol=2e-2)
        assert torch.equal(out[b, end:], torch.zeros_like(out[b, end:]))
