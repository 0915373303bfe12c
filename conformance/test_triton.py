"""Triton-specific cases: the other precision modes (the default runs in test_conformance),
the batch streaming plan, non-causal stacks on every kernel plan and tile layout, head dims
that are not a power of two, and attention rows that see no valid key. They run only when
--backend selects triton."""
from __future__ import annotations

import pytest
import torch

from layerbench.common import runner
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.common.selection import skip_unless_selected
from layerbench.common.shapes import CI
from layerbench.reference import (make_reference, packed_attention, reference_forward,
                                  streaming_forward)

MODES = [("fp16x3", "tf32x3"), ("tf32x3", "fp16"), ("tf32x3", "tf32x3"), ("ieee", "fp16"),
         ("fp16", "fp16")]


@pytest.fixture(autouse=True)
def _only_when_triton_is_selected(pytestconfig):
    """Skip every test here unless --backend selects the triton backend."""
    skip_unless_selected(pytestconfig, "triton")


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


@pytest.mark.parametrize("blocks, qkv_products", [(4, 1), (5, 3), (12, 3)])
def test_deep_stacks_run_qkv_at_three_products(triton_backend_class, blocks, qkv_products):
    """By default Q/K/V takes one fp16 product, and three in stacks deeper than four blocks;
    a precision given by the caller holds at any depth."""
    from layerbench.backends.triton.layer import Precision

    cfg = LayerConfig(2, 16, 64, 2, 64, blocks)
    assert triton_backend_class().precision_for(cfg).qkv_products == qkv_products
    chosen = Precision("fp16x3", "fp16", qkv="fp16")
    assert triton_backend_class(chosen).precision_for(cfg) == chosen


def test_batch_chunks_respect_the_attention_grid(triton_backend_class, device):
    """A batch whose sequences x heads exceed the grid limit is streamed in smaller chunks."""
    from layerbench.common.cuda_host import MAX_GRID_Y
    from layerbench.common.config import LayerConfig
    from layerbench.reference import make_reference

    cfg = LayerConfig(100_000, 4, 128, 16, 32, 1)
    layer = triton_backend_class().build(cfg, make_reference(cfg).state_dict(), device=device)
    chunk = layer.chunks(cfg.batch_size, cfg.seq_len)
    assert 1 <= chunk and chunk * cfg.num_heads <= MAX_GRID_Y


def test_rows_per_program_when_attention_runs_apart(triton_backend_class, monkeypatch):
    """16 or 32 rows while the grid stays within one program per SM, else 64; a set
    apart_rows wins."""
    from layerbench.backends.triton import narrow_block

    monkeypatch.setattr(narrow_block, "multiprocessor_count", lambda device: 132)
    by_grid = narrow_block.NARROW_TILES._replace(apart_rows=0)
    monkeypatch.setattr(narrow_block, "block_config", lambda: by_grid)
    cuda = torch.device("cuda")
    chosen = {rows: narrow_block.rows_apart(rows, cuda) for rows in (128, 2048, 4096, 8192)}
    assert chosen == {128: 16, 2048: 16, 4096: 32, 8192: 64}
    set_rows = by_grid._replace(apart_rows=32)
    monkeypatch.setattr(narrow_block, "block_config", lambda: set_rows)
    assert narrow_block.rows_apart(128, cuda) == 32


def _run_attention(qkv, valid, *, batch, seq_len, heads, causal, tiles=(32, 16, 4, 1)):
    """flash_attention's context [B, S, D] of qkv with key mask valid (uint8 [B, S]) in a
    NaN-filled buffer, so an element it never writes stays NaN."""
    from layerbench.backends.triton import attention

    d = qkv.shape[1] // 3
    key_end = attention.key_extent(valid, torch.empty(batch, dtype=torch.int32,
                                                      device=qkv.device))
    ctx = torch.full((batch * seq_len, d), float("nan"), device=qkv.device)
    attention.flash_attention(qkv, ctx, valid, key_end, batch=batch, seq_len=seq_len,
                              num_heads=heads, precision="fp16", config=tiles, causal=causal)
    return ctx.view(batch, seq_len, d)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_attention_skips_query_blocks_past_the_valid_prefix(triton_backend_class, causal,
                                                            device):
    """flash_attention matches fp32 attention on every query row of a valid prefix (and on the
    rows after it inside the same query block), and writes 0 for query blocks wholly past it
    (padding rows, whose context out_proj discards), causal or not."""
    batch, seq_len, heads, head_dim = 2, 100, 2, 64
    d = heads * head_dim
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(batch * seq_len, 3 * d, generator=gen).to(device, torch.float16)
    lengths = [40, seq_len]
    valid = torch.zeros(batch, seq_len, dtype=torch.uint8)
    for b, n in enumerate(lengths):
        valid[b, :n] = 1
    valid = valid.to(device)
    out = _run_attention(qkv, valid, batch=batch, seq_len=seq_len, heads=heads, causal=causal)
    expected, _ = packed_attention(qkv, valid, batch=batch, seq_len=seq_len, heads=heads,
                                       causal=causal)
    computed_end = [-(-n // 32) * 32 for n in lengths]  # through the end of the prefix's block
    for b, end in enumerate(computed_end):
        torch.testing.assert_close(out[b, :end], expected[b, :end], atol=2e-3, rtol=2e-2)
        assert torch.equal(out[b, end:], torch.zeros_like(out[b, end:]))


def _key_mask(kind: str, seq_len: int) -> torch.Tensor:
    """'general': sequence 0 has 3 leading invalid tokens and a hole, sequence 1 its first
    21 (a whole 16-key block) and a hole; 'empty-sequence': sequence 0 has no valid token,
    sequence 1 a prefix of 50."""
    mask = torch.ones(2, seq_len, dtype=torch.bool)
    if kind == "general":
        mask[0, :3] = False
        mask[0, 40:50] = False
        mask[1, :21] = False
        mask[1, 40:50] = False
    else:
        mask[0] = False
        mask[1, 50:] = False
    return mask


@pytest.mark.parametrize("mask_kind", ["general", "empty-sequence"])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_attention_rows_that_see_no_valid_key_are_zero(triton_backend_class, causal, head_dim,
                                                       mask_kind, device):
    """A query row whose keys are all masked (a leading invalid token when causal, every row of
    a sequence without valid tokens) gets exactly 0, never NaN; every element is written and
    finite, and valid rows match fp32 attention."""
    batch, seq_len, heads = 2, 70, 2
    d = heads * head_dim
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(batch * seq_len, 3 * d, generator=gen).to(device, torch.float16)
    mask = _key_mask(mask_kind, seq_len).to(device)
    valid = mask.view(torch.uint8)
    out = _run_attention(qkv, valid, batch=batch, seq_len=seq_len, heads=heads, causal=causal)
    expected, blind = packed_attention(qkv, valid, batch=batch, seq_len=seq_len,
                                           heads=heads, causal=causal)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum()} elements not finite"
    assert blind.any() == (causal or mask_kind == "empty-sequence")
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    torch.testing.assert_close(out[mask], expected[mask], atol=2e-3, rtol=2e-2)


def _stack_inputs(config: LayerConfig, mask_kind: str, device, seed: int = 0):
    """(x, mask) for config with 2 sequences: mask None ('none'), all valid, suffix padding
    (sequence 0 loses its last 11 tokens, sequence 1 keeps S // 4 + 1, so whole query blocks
    lie past its prefix), or 'general' (3 leading invalid tokens in sequence 0, an 8-token
    hole in the middle of sequence 1); invalid rows of x are 0."""
    x, mask = make_inputs(config, seed=seed + 1, device=device)
    s = config.seq_len
    if mask_kind == "none":
        return x, None
    if mask_kind == "suffix":
        lengths = torch.tensor([s - 11, s // 4 + 1], device=device)
        mask = torch.arange(s, device=device)[None, :] < lengths[:, None]
    elif mask_kind == "general":
        mask[0, :3] = False
        mask[1, s // 2 - 4:s // 2 + 4] = False
    x[~mask] = 0
    return x, mask


def _assert_matches_oracle(layer, model, x, mask):
    """Run layer and assert its output keeps the contract against the streaming fp32 oracle
    (where a row that sees no valid key has attention output 0)."""
    with torch.no_grad():
        out = layer(x, mask)
    expected = streaming_forward(model.state_dict(), layer.config, x, mask)
    report = compare(out, expected)
    assert report.passed, report.summary()


def _set_tiles(monkeypatch, *, apart: bool, small: bool):
    """Attention apart or in attention_ffn; small: 16-key blocks and 16 or 32 query rows per
    program (several key blocks per sequence, skipped query blocks), else the defaults."""
    from layerbench.backends.triton import attention, layer, narrow_block

    tiles = narrow_block.block_config()._replace(heads_apart=apart)
    if small:
        tiles = tiles._replace(block_m=32, block_n=16, apart_rows=16)
        monkeypatch.setattr(attention, "attention_config", lambda pad, precision: (32, 16, 4, 1))
    monkeypatch.setattr(narrow_block, "block_config", lambda: tiles)
    monkeypatch.setattr(layer, "block_config", lambda: tiles)


NARROW_CONFIG = LayerConfig(2, 48, 128, 4, 128, 2, causal=False)
WIDE_CONFIG = LayerConfig(2, 48, 256, 4, 512, 2, causal=False)
# plan id: (config, Precision arguments, attention apart, the plan() it runs)
PLANS = {
    "narrow": (NARROW_CONFIG, (), True, "narrow"),
    "narrow-heads-in-program": (NARROW_CONFIG, (), False, "narrow"),
    "wide": (WIDE_CONFIG, (), True, "wide"),
    "general": (NARROW_CONFIG, ("tf32x3", "tf32x3"), True, "general"),
}
MASK_KINDS = ["none", "all-valid", "suffix", "general"]


@pytest.mark.parametrize("small_tiles", [False, True], ids=["default-tiles", "16-key-tiles"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("plan_id", list(PLANS))
def test_noncausal_stack_keeps_contract(triton_backend_class, plan_id, mask_kind, small_tiles,
                                        device, monkeypatch):
    """A non-causal stack (causal=False) on every plan and attention layout, with no mask, an
    all-valid mask, suffix padding or a general mask, keeps the contract against the oracle."""
    from layerbench.backends.triton.layer import Precision, plan

    config, precision_args, apart, expected_plan = PLANS[plan_id]
    precision = Precision(*precision_args) if precision_args else None
    _set_tiles(monkeypatch, apart=apart, small=small_tiles)
    backend = triton_backend_class(precision) if precision else triton_backend_class()
    assert plan(config, backend.precision) == expected_plan
    model = make_reference(config, seed=3)
    layer = backend.build(config, model.state_dict(), device=device)
    x, mask = _stack_inputs(config, mask_kind, device)
    _assert_matches_oracle(layer, model, x, mask)


# head dim: (heads, d_model, ffn_dim); d_model and ffn_dim up to 128 run the narrow plan
HEAD_DIM_CONFIGS = {24: (4, 96, 128), 48: (4, 192, 192), 80: (1, 80, 128), 96: (2, 192, 128),
                    112: (1, 112, 112), 160: (2, 320, 256), 192: (1, 192, 256)}
# (head dim, variant): the default plan, attention inside attention_ffn, the general plan
HEAD_DIM_CASES = [(hd, "default") for hd in HEAD_DIM_CONFIGS] + [
    (24, "heads-in-program"), (112, "heads-in-program"), (96, "general")]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("head_dim,variant", HEAD_DIM_CASES,
                         ids=[f"hd{hd}-{v}" for hd, v in HEAD_DIM_CASES])
def test_head_dim_keeps_contract(triton_backend_class, head_dim, variant, causal, device,
                                 monkeypatch):
    """Head dims that are not a power of two run in a padded tile and keep the contract,
    causal or not, with a general mask (a leading invalid token and a hole)."""
    from layerbench.backends.triton.layer import Precision, plan
    from layerbench.backends.triton.narrow_block import fits

    heads, d_model, ffn_dim = HEAD_DIM_CONFIGS[head_dim]
    config = LayerConfig(2, 40, d_model, heads, ffn_dim, 2, causal=causal)
    assert config.head_dim == head_dim
    _set_tiles(monkeypatch, apart=variant != "heads-in-program", small=False)
    backend = (triton_backend_class(Precision("tf32x3", "tf32x3")) if variant == "general"
               else triton_backend_class())
    kind = plan(config, backend.precision)
    assert kind == ("general" if variant == "general"
                    else "narrow" if fits(d_model, ffn_dim) else "wide")
    model = make_reference(config, seed=4)
    layer = backend.build(config, model.state_dict(), device=device)
    x, mask = _stack_inputs(config, "general", device, seed=4)
    _assert_matches_oracle(layer, model, x, mask)


def test_head_dims_are_the_multiples_of_8_up_to_256(triton_backend_class, device):
    """Every head dim that is a multiple of 8 from 8 to 256 is accepted; others are refused
    with Unsupported naming the head dim."""
    backend = triton_backend_class()
    assert backend.capabilities.head_dims == tuple(range(8, 257, 8))
    for head_dim in (8, 24, 40, 56, 200, 256):
        backend.check(LayerConfig(1, 8, head_dim, 1, 32, 1), device, torch.float32)
    for head_dim in (4, 12, 20, 100, 264):
        with pytest.raises(Unsupported, match=f"not {head_dim}"):
            backend.check(LayerConfig(1, 8, head_dim, 1, 32, 1), device, torch.float32)


# (linear, attention, qkv): the general plan with Q/K/V in a mode other than the linears'
MIXED_QKV = [("fp16", "fp16", "fp16x3"), ("tf32", "fp16", "fp16x3"), ("fp16x3", "tf32", "ieee"),
             ("fp16", "tf32x3", "tf32")]


def _held_tensors(layer):
    """Every parameter and weight tensor a built Triton layer keeps."""
    from dataclasses import fields

    held = [getattr(p, f.name) for p in layer.params.layers for f in fields(p)]
    held = [t for t in held if t is not None]
    held += [layer.params.final_weight, layer.params.final_bias]
    for w in layer.weights:
        for stored in w.values():
            held += list(stored) if isinstance(stored, tuple) else [stored]
    return held


@pytest.mark.parametrize("linear,attention,qkv", MIXED_QKV,
                         ids=[f"{a}-{b}-qkv-{c}" for a, b, c in MIXED_QKV])
def test_qkv_in_its_own_mode_keeps_contract(triton_backend_class, linear, attention, qkv,
                                            device):
    """A Q/K/V mode other than the linears' stores the Q/K/V weight as that mode reads it (an
    fp16 pair for fp16x3, fp16 for fp16, else fp32) and keeps the contract (an fp16 Q/K/V
    weight read as a pair counted it twice; a pair read in fp32 modes lost its low part)."""
    from layerbench.backends.triton.layer import Precision, plan

    config = LayerConfig(2, 20, 64, 2, 64, 1)
    precision = Precision(linear, attention, qkv=qkv)
    assert plan(config, precision) == "general"
    model = make_reference(config, seed=6)
    layer = triton_backend_class(precision).build(config, model.state_dict(), device=device)
    stored = layer.weights[0]["qkv_weight"]
    if qkv == "fp16x3":
        assert isinstance(stored, tuple) and stored[0].dtype == torch.float16
    else:
        assert stored.dtype == (torch.float16 if qkv == "fp16" else torch.float32)
    x, mask = _stack_inputs(config, "general", device, seed=6)
    _assert_matches_oracle(layer, model, x, mask)


def test_precision_refuses_unknown_modes():
    """A mode no kernel implements (attention has no fp16x3 kernel) raises ValueError naming
    it when the Precision is made, not a compile error at the first call."""
    from layerbench.backends.triton.layer import Precision

    for kwargs, name in [({"linear": "bf16"}, "bf16"), ({"attention": "fp16x3"}, "fp16x3"),
                         ({"qkv": "int8"}, "int8")]:
        with pytest.raises(ValueError, match=name):
            Precision(**kwargs)


@pytest.mark.parametrize("precision_args", [(), ("fp16", "fp16"), ("tf32x3", "tf32x3"),
                                            ("fp16", "fp16", "fp16x3")],
                         ids=["default", "fp16", "tf32x3", "fp16-qkv-fp16x3"])
def test_weights_fit_the_memory_plan(triton_backend_class, precision_args, device):
    """The tensors a built layer keeps take no more than its memory plan's parameters item
    (the fp32 matrices are not kept beside their fp16 pairs)."""
    from layerbench.backends.triton.layer import Precision
    from layerbench.common.memory import PARAMETERS

    config = LayerConfig(1, 8, 64, 2, 96, 3)
    backend = (triton_backend_class(Precision(*precision_args)) if precision_args
               else triton_backend_class())
    layer = backend.build(config, make_reference(config, seed=1).state_dict(), device=device)
    storages = {t.data_ptr(): t.numel() * t.element_size() for t in _held_tensors(layer)}
    held = sum(storages.values())
    assert held <= backend.memory_plan(config, torch.float32).items[PARAMETERS]


def test_weight_past_fp16_range_is_refused(triton_backend_class, device):
    """A weight entry past fp16's range (stored as inf in an fp16 pair, so every output row
    became NaN) makes the build raise Unsupported naming the matrix; fp32 weights take it."""
    from layerbench.backends.triton.layer import Precision

    config = LayerConfig(1, 8, 32, 2, 32, 2)
    state = make_reference(config, seed=2).state_dict()
    state["layers.1.ffn_in.weight"][3, 5] = 7e4
    with pytest.raises(Unsupported, match="block 1's ffn_in_weight"):
        triton_backend_class().build(config, state, device=device)
    triton_backend_class(Precision("tf32x3", "tf32x3")).build(config, state, device=device)
