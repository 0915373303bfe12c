"""The cutile layer's launch sequence without a GPU: every kernel is replaced by a PyTorch
stand-in that computes what its docstring promises (fp16 pairs, products, epilogues, masks),
and every launch still goes through the launcher's argument checks. The layer built on these
must keep the contract on CPU, so the orchestration (workspace, chunks, staging, fused
norms and FFN, masks, argument order and aliasing) is checked without the kernels."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from layerbench.backends.cutile import CutileBackend, launch, specs
from layerbench.backends.cutile.layer import CutileLayer, linear_products_for
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.reference import make_reference, reference_forward

from standins import _norm, _pair, _products, _residual


def _rows_and_norm(y, valid, out, norm_w, norm_b, norm_hi, norm_lo, norm_out, has_mask, final):
    normed = _norm(y, norm_w, norm_b)
    if final:
        if has_mask:
            normed = torch.where(valid[: y.shape[0]].bool()[:, None], normed, 0.0)
        norm_out.copy_(normed)
    else:
        out.copy_(y)
        _pair(normed, norm_hi, norm_lo)


DEFAULT_BUILD = {specs.symbol(n, c) for n, c in specs.specialisations()}
SWEEP_BUILD = {specs.symbol(n, c) for n, c in specs.specialisations(sweep=True)}


class TorchKernels:
    """Stand-ins for the exported kernels, called through the launcher's argument packing."""

    mode = "torch"

    def __init__(self, build=DEFAULT_BUILD):
        self.build = build
        self.calls: list[str] = []
        self.programmatic: list[bool] = []

    def has(self, name, constants) -> bool:
        """Whether the build this stands in for has the specialisation (None: every one,
        as under the JIT)."""
        return self.build is None or specs.symbol(name, constants) in self.build

    def launch(self, name, constants, grid, args, programmatic=False):
        """Check that the build has this specialisation and the arguments as the
        real launch does, then compute the kernel's result (a variant's is its function's)."""
        self.programmatic.append(programmatic)
        assert self.has(name, constants), (name, constants)
        launch.pack(name, args)
        self.calls.append(name)
        getattr(self, specs.KERNELS[name].function or name)(constants, *args)

    def layer_norm_split(self, c, x, w, b, hi, lo):
        _pair(_norm(x, w, b), hi, lo)

    def layer_norm_half(self, c, x, w, b, out):
        out.copy_(_norm(x, w, b).half())

    def layer_norm_out(self, c, x, w, b, valid, out, has_mask):
        y = _norm(x, w, b)
        out.copy_(torch.where(valid.bool()[:, None], y, 0.0) if has_mask else y)

    def linear_half(self, c, a_hi, a_lo, w_hi, w_lo, bias, out):
        n = out.shape[1]
        out.copy_((_products(a_hi, a_lo, w_hi, w_lo, n, c["PRODUCTS"]) + bias[:n]).half())

    def linear_gelu(self, c, a_hi, a_lo, w_hi, w_lo, bias, hi, lo):
        n = hi.shape[1]
        acc = _products(a_hi, a_lo, w_hi, w_lo, n, c["PRODUCTS"]) + bias[:n]
        _pair(torch.nn.functional.gelu(acc), hi, lo)

    def linear_gelu_half(self, c, a_hi, a_lo, w_hi, w_lo, bias, out):
        n = out.shape[1]
        acc = _products(a_hi, a_lo, w_hi, w_lo, n, c["PRODUCTS"]) + bias[:n]
        out.copy_(torch.nn.functional.gelu(acc).half())

    def linear_residual(self, c, a_hi, a_lo, w_hi, w_lo, bias, res, valid, out, has_mask,
                        zero_sum):
        n = out.shape[1]
        acc = _products(a_hi, a_lo, w_hi, w_lo, n, c["PRODUCTS"]) + bias[:n]
        out.copy_(_residual(acc, res, valid, has_mask, zero_sum))

    def linear_residual_norm(self, c, a_hi, a_lo, w_hi, w_lo, bias, res, valid, out, norm_w,
                             norm_b, norm_hi, norm_lo, norm_out, has_mask, zero_sum, final):
        n = out.shape[1]
        assert n <= c["TN"], "one tile holds whole rows"
        acc = _products(a_hi, a_lo, w_hi, w_lo, n, c["PRODUCTS"]) + bias[:n]
        y = _residual(acc, res, valid, has_mask, zero_sum)
        _rows_and_norm(y, valid, out, norm_w, norm_b, norm_hi, norm_lo, norm_out, has_mask,
                       final)

    def ffn_residual_norm(self, c, a_hi, a_lo, w1_hi, w1_lo, b1, w2_hi, w2_lo, b2, res, valid,
                          out, norm_w, norm_b, norm_hi, norm_lo, norm_out, has_mask, final):
        n, f = out.shape[1], w1_hi.shape[0]
        assert n <= c["TN"], "one tile holds whole rows"
        hidden = torch.nn.functional.gelu(
            _products(a_hi, a_lo, w1_hi, w1_lo, f, c["PRODUCTS"]) + b1[:f])
        h_hi = hidden.half()
        h_lo = (hidden - h_hi.float()).half()
        acc = _products(h_hi, h_lo, w2_hi, w2_lo, n, c["PRODUCTS"]) + b2[:n]
        y = _residual(acc, res, valid, has_mask, 1)
        _rows_and_norm(y, valid, out, norm_w, norm_b, norm_hi, norm_lo, norm_out, has_mask,
                       final)

    def flash_attention(self, c, qkv, ctx_hi, ctx_lo, valid, key_info, scale, heads, causal,
                        has_mask):
        b, s, _, hd = qkv.shape
        q, k, v = (qkv[:, :, i * heads:(i + 1) * heads].float().transpose(1, 2)
                   for i in range(3))
        scores = (q @ k.transpose(-1, -2)) * scale
        visible = torch.ones(b, 1, s, s, dtype=torch.bool)
        if causal:
            visible = visible & torch.ones(s, s, dtype=torch.bool).tril()
        if has_mask:
            visible = visible & valid.bool()[:, None, None, :]
        p = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
        _pair((p @ v).transpose(1, 2), ctx_hi, ctx_lo)


    def block_narrow(self, c, x, out, valid, wqkv_hi, wqkv_lo, bqkv, wo_hi, wo_lo, bo, n1_w,
                     n1_b, n2_w, n2_b, w1_hi, w1_lo, b1, w2_hi, w2_lo, b2, nf_w, nf_b, scale,
                     heads, causal, has_mask, final):
        b, s, d = x.shape
        p = c["PRODUCTS"]
        rows = x.reshape(-1, d)
        h = _norm(rows, n1_w, n1_b).half()
        qkv = (_products(h, h, wqkv_hi, wqkv_lo, 3 * d, 1) + bqkv).half()
        ctx = [torch.empty(b * s, d, dtype=torch.float16) for _ in range(2)]
        self.flash_attention(c, qkv.view(b, s, 3 * heads, d // heads),
                             *[t.view(b, s, heads, d // heads) for t in ctx], valid, None,
                             scale, heads, causal, has_mask)
        keep = (valid.reshape(-1).bool()[:, None] if has_mask
                else torch.ones(b * s, 1, dtype=torch.bool))
        y = rows + torch.where(keep, _products(*ctx, wo_hi, wo_lo, d, p) + bo, 0.0)
        h2 = [torch.empty(b * s, d, dtype=torch.float16) for _ in range(2)]
        _pair(_norm(y, n2_w, n2_b), *h2)
        f = b1.shape[0]
        hidden = [torch.empty(b * s, f, dtype=torch.float16) for _ in range(2)]
        _pair(torch.nn.functional.gelu(_products(*h2, w1_hi, w1_lo, f, p) + b1), *hidden)
        z = torch.where(keep, y + _products(*hidden, w2_hi, w2_lo, d, p) + b2, 0.0)
        if final:
            z = torch.where(keep, _norm(z, nf_w, nf_b), 0.0)
        out.copy_(z.view(b, s, d))


class CpuCutile(CutileBackend):
    """The cutile backend's checks and plans, allowed on CPU for the stand-in kernels."""

    capabilities = replace(CutileBackend.capabilities, devices=("cuda", "cpu"))

    def unavailable_reason(self, device):
        """Nothing is missing: the stand-ins need no build."""
        return None


def _stand_in_layer(cfg, model, fuse_norms, fuse_ffn, products=None, lean_pairs=False,
                    pdl=False, fuse_block=False):
    """The cutile layer for cfg on CPU, its kernels replaced by TorchKernels (standing in
    for the default build, or with fuse_block for every specialisation, as the JIT)."""
    backend = CpuCutile(fuse_norms=fuse_norms, fuse_ffn=fuse_ffn, linear_products=products,
                        lean_pairs=lean_pairs, pdl=pdl, fuse_block=fuse_block)
    kernels = TorchKernels(None if fuse_block else DEFAULT_BUILD)
    layer = CutileLayer(backend, cfg, model.state_dict(), torch.device("cpu"), torch.float32,
                        kernels, products or linear_products_for(cfg.d_model), fuse_norms,
                        fuse_ffn, lean_pairs=lean_pairs, pdl=pdl, fuse_block=fuse_block)
    return layer, kernels


PLANS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("fuse_norms, fuse_ffn", PLANS, ids=["separate", "norms", "ffn"])
@pytest.mark.parametrize("cfg", [LayerConfig(3, 24, 32, 4, 36, 2), LayerConfig(2, 17, 64, 2, 64, 1),
                                 LayerConfig(2, 16, 256, 4, 96, 2),
                                 LayerConfig(2, 12, 512, 4, 64, 1)],
                         ids=["d32-f36", "one-layer", "d256", "d512-one-product"])
@pytest.mark.parametrize("padding", [0.0, 0.4])
@pytest.mark.parametrize("lean_pairs", [False, True], ids=["pairs", "lean"])
def test_launch_sequence_computes_the_layer(cutile_selected, cfg, fuse_norms, fuse_ffn,
                                            padding, lean_pairs, monkeypatch):
    """The stand-in kernels, launched as the layer plans them, give the reference's output
    within the contract; the fused plans launch fewer kernels where rows fit one tile; with
    lean_pairs, no GEMM that reads a low half is given one left unwritten."""
    model = make_reference(cfg, seed=5)
    x, mask = make_inputs(cfg, padding_ratio=padding, seed=6)
    expected = reference_forward(model, x, mask)
    layer, kernels = _stand_in_layer(cfg, model, fuse_norms, fuse_ffn, lean_pairs=lean_pairs)
    empty = torch.empty  # the workspace starts as NaN: reading an unwritten element shows

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    with torch.no_grad():
        got = layer(x, mask)
    report = compare(got, expected)
    assert report.passed, report.summary()
    per_block = 7 if cfg.d_model > 128 or not fuse_norms else (4 if fuse_ffn else 5)
    assert layer.fuse_ffn == (fuse_ffn and cfg.d_model <= 128)
    # the first block's norm1 and the final norm: one more launch in every plan
    assert len(kernels.calls) == per_block * cfg.num_layers + 1, kernels.calls


@pytest.mark.parametrize("build, cfg, whole", [
    ("default", LayerConfig(2, 128, 32, 4, 32, 2), True),  # official shape 7's sizes
    ("default", LayerConfig(2, 32, 32, 4, 32, 2), False),  # 32 rows: a --sweep size only
    ("default", LayerConfig(2, 128, 64, 4, 64, 1), False),  # in no build
    ("sweep", LayerConfig(2, 32, 32, 4, 32, 2), True),
    ("sweep", LayerConfig(2, 100, 32, 4, 32, 2), True),  # padded to 128 rows
    ("sweep", LayerConfig(2, 64, 32, 4, 32, 1), False),  # 64 rows: not in the build
], ids=["default", "default-32", "default-d64", "sweep-32", "sweep-100", "sweep-64"])
def test_whole_block_follows_the_build(cutile_selected, build, cfg, whole):
    """With fuse_block, the layer runs the whole-block kernel where the build has it for the
    call's length and the separate kernels where it does not, and keeps the contract."""
    model = make_reference(cfg, seed=11)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=12)
    layer, _ = _stand_in_layer(cfg, model, True, False, fuse_block=True)
    kernels = TorchKernels(DEFAULT_BUILD if build == "default" else SWEEP_BUILD)
    layer.kernels = kernels
    with torch.no_grad():
        assert compare(layer(x, mask), reference_forward(model, x, mask)).passed
    blocks = [c for c in kernels.calls if c.startswith("block_narrow")]
    assert bool(blocks) == whole
    assert blocks == kernels.calls or not whole


def test_whole_block_is_refused_where_the_build_lacks_it(cutile_selected, monkeypatch):
    """fuse_block with a build that lacks the kernel for the config's own length is refused
    at build, with the reason."""
    cfg = LayerConfig(2, 128, 64, 4, 64, 1)
    backend = CpuCutile(fuse_block=True)
    monkeypatch.setattr(backend, "kernels", lambda device: TorchKernels(DEFAULT_BUILD))
    with pytest.raises(Unsupported, match="whole-block"):
        backend.build(cfg, make_reference(cfg, seed=1).state_dict(), device="cpu")


@pytest.mark.parametrize("d_model, blocks, products", [(128, 4, 3), (512, 4, 1), (512, 5, 3),
                                                     (1024, 12, 3)])
def test_default_products_follow_width_and_depth(cutile_selected, monkeypatch, d_model, blocks,
                                                 products):
    """out_proj and the FFN run one fp16 product from d_model 512 and three below, and three
    in stacks deeper than four blocks; a fixed linear_products holds at any depth."""
    cfg = LayerConfig(2, 16, d_model, 4, 64, blocks)
    sd = make_reference(cfg, seed=1).state_dict()
    for backend, want in ((CpuCutile(), products), (CpuCutile(linear_products=1), 1)):
        monkeypatch.setattr(backend, "kernels", lambda device: TorchKernels(DEFAULT_BUILD))
        assert backend.build(cfg, sd, device="cpu").products == want


def test_default_options_follow_the_device_and_the_build(cutile_selected, monkeypatch):
    """By default a build without the whole-block kernel for the config runs the separate
    kernels instead of refusing, and PDL is off where the device lacks it (here the CPU)."""
    cfg = LayerConfig(2, 128, 64, 4, 64, 1)
    backend = CpuCutile()
    monkeypatch.setattr(backend, "kernels", lambda device: TorchKernels(DEFAULT_BUILD))
    layer = backend.build(cfg, make_reference(cfg, seed=1).state_dict(), device="cpu")
    assert layer.fuse_block and not layer.pdl and not layer._whole_blocks(cfg.seq_len)
    backend.pdl = True
    with pytest.raises(Unsupported, match="pdl needs sm_90"):
        backend.build(cfg, make_reference(cfg, seed=1).state_dict(), device="cpu")


@pytest.mark.parametrize("fuse_norms, fuse_ffn", PLANS, ids=["separate", "norms", "ffn"])
@pytest.mark.parametrize("pdl", [False, True], ids=["stream", "pdl"])
@pytest.mark.parametrize("fuse_block", [False, True], ids=["kernels", "block"])
@pytest.mark.parametrize("num_layers", [3, 1])
def test_chunks_staging_and_output_buffers(cutile_selected, fuse_norms, fuse_ffn, pdl,
                                           fuse_block, num_layers, monkeypatch):
    """One sequence per chunk, a misaligned input (staged), a misaligned output view and out=:
    every call still matches the reference; with pdl every kernel is launched
    programmatically, without it none; with fuse_block, one whole-block kernel per block."""
    cfg = LayerConfig(3, 20, 32, 2, 40, num_layers)
    model = make_reference(cfg, seed=7)
    x, mask = make_inputs(cfg, padding_ratio=0.3, seed=8)
    expected = reference_forward(model, x, mask)
    layer, kernels = _stand_in_layer(cfg, model, fuse_norms, fuse_ffn, pdl=pdl,
                                     fuse_block=fuse_block)
    monkeypatch.setattr(layer, "chunks", lambda b, s: 1)
    with torch.no_grad():
        assert compare(layer(x, mask), expected).passed
        # 4 bytes off 16: read and written through the staging rows
        x_buffer, out_buffer = torch.zeros(x.numel() + 1), torch.full((x.numel() + 1,), math.nan)
        x_off, out_off = x_buffer[1:].view_as(x), out_buffer[1:].view_as(x)
        x_off.copy_(x)
        assert layer(x_off, mask, out=out_off) is out_off
        assert compare(out_off, expected).passed
        # another batch and length than the layer was built for
        other = LayerConfig(5, 31, cfg.d_model, cfg.num_heads, cfg.ffn_dim, cfg.num_layers)
        x5, mask5 = make_inputs(other, padding_ratio=0.3, seed=9)
        assert compare(layer(x5, mask5), reference_forward(model, x5, mask5)).passed
    assert set(kernels.programmatic) == {pdl}
    if fuse_block:  # one launch per block and chunk: 3 + 3 + 5 one-sequence chunks
        assert len(kernels.calls) == num_layers * 11
        assert all(c.startswith("block_narrow") for c in kernels.calls)
    else:
        assert not any(c.startswith("block_narrow") for c in kernels.calls)


@pytest.mark.parametrize("d_model, blocks, refused", [(512, 24, False), (512, 25, True),
                                                      (1024, 32, True), (128, 64, False)])
def test_deep_wide_stacks_are_refused(cutile_selected, d_model, blocks, refused):
    """Past 24 blocks at d_model 512 and above the one-product Q/K/V cannot keep the
    contract: refused, naming the depth; narrower or shallower stacks build."""
    cfg = LayerConfig(2, 16, d_model, 4, 64, blocks)
    if refused:
        with pytest.raises(Unsupported, match=f"{blocks} blocks"):
            CpuCutile().check(cfg, "cpu", torch.float32)
    else:
        CpuCutile().check(cfg, "cpu", torch.float32)


def test_residual_shadow_only_where_whole_blocks_run(cutile_selected):
    """The residual's shadow half (the whole-block kernel reads one half and writes the
    other) is planned and allocated only for lengths the whole-block kernel runs: not for
    rows too wide for it, nor for a call longer than it takes."""
    fits, wide = LayerConfig(2, 128, 32, 4, 32, 1), LayerConfig(2, 128, 256, 4, 96, 1)
    for cfg, shadow in ((fits, True), (wide, False)):
        plans = [CpuCutile(fuse_block=b).memory_plan(cfg, torch.float32).total
                 for b in (None, False)]
        assert (plans[0] > plans[1]) == shadow, cfg
    model = make_reference(fits, seed=13)
    layer, kernels = _stand_in_layer(fits, model, True, False, fuse_block=True)
    per_token = 4 * fits.d_model  # the shadow: one fp32 row per token
    per_sequence = layer.chunks.per_sequence_bytes
    assert per_sequence(128) / 128 - per_sequence(200) / 200 == per_token
    x, mask = make_inputs(replace(fits, seq_len=200), padding_ratio=0.25, seed=14)
    with torch.no_grad():
        got = layer(x, mask)
    assert compare(got, reference_forward(model, x, mask)).passed
    assert not any(c.startswith("block_narrow") for c in kernels.calls)
