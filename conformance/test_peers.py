"""The PyTorch peers off the suite's usual path: the host-side mask decision of torch-sdpa and
its compiled variants, attention rows whose keys are all masked, a caller's autocast, the
compiled stack traced whole (with a full compile cache refused rather than run eagerly), and
on a GPU the CUDA graphs of the compiled peers across mask paths and buffers."""
from __future__ import annotations

import math
import types

import pytest
import torch
from torch.nn import functional as F

from layerbench.backends.torch_compile import TorchCompileBackend
from layerbench.backends.torch_fp16 import TorchFp16Backend
from layerbench.backends.torch_sdpa import layer as sdpa_layer
from layerbench.backends.torch_sdpa.layer import SdpaLayer, mask_path
from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.common.registry import get_backend
from layerbench.reference import make_reference, streaming_forward

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CAUSAL = LayerConfig(2, 20, 32, 4, 48, 2)
FULL = LayerConfig(2, 20, 32, 1, 40, 2, causal=False)


def _mask(kind: str, batch: int = 2, seq_len: int = 20) -> torch.Tensor:
    """A [batch, seq_len] mask of the named kind."""
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    if kind == "suffix":
        mask[-1, seq_len - 5:] = False
    elif kind == "no-valid":  # sequence 0 without a valid token, the last padded at the end
        mask[0] = False
        mask[-1, seq_len - 4:] = False
    elif kind == "leading":  # the first tokens invalid: their queries see no valid key
        mask[:, :3] = False
    elif kind == "holes":
        mask[:, 3:6] = False
        mask[-1, seq_len - 2:] = False
    elif kind == "single":
        mask[:] = False
        mask[:, seq_len // 3] = True
    elif kind != "all":
        raise ValueError(kind)
    return mask


@pytest.mark.parametrize("kind, causal, expected", [
    ("all", True, "none"), ("all", False, "none"),
    ("suffix", True, "rows"), ("suffix", False, "keys"),
    ("no-valid", True, "rows"), ("no-valid", False, "keys"),
    ("leading", True, "keys"), ("holes", True, "keys"), ("single", True, "keys"),
])
def test_mask_path_decision(kind, causal, expected):
    """Key masking is elided only where it changes no valid row: causal suffix padding."""
    assert mask_path(_mask(kind), causal) == expected


def test_mask_path_decision_edges():
    """No mask, one token a sequence, and a single sequence without a valid token."""
    assert mask_path(None, True) == "none"
    assert mask_path(torch.ones(3, 1, dtype=torch.bool), False) == "none"
    assert mask_path(torch.tensor([[True], [False]]), True) == "rows"
    assert mask_path(torch.tensor([[True], [False]]), False) == "keys"
    assert mask_path(torch.zeros(1, 7, dtype=torch.bool), True) == "rows"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["all", "suffix", "holes"])
def test_mask_path_reads_the_device_once(monkeypatch, kind, causal):
    """The per-call mask decision, timed with every peer's forward, costs one host read."""
    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            reads.append(1)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    mask_path(_mask(kind), causal)
    assert len(reads) == 1, f"{len(reads)} device-to-host reads for one mask decision"


def _nan_sdpa(q, k, v, attn_mask=None, is_causal=False, **kwargs):
    """Plain attention whose rows with every key masked come out NaN (as a fused kernel's may)."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if is_causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("cfg", [CAUSAL, FULL], ids=["causal", "full"])
@pytest.mark.parametrize("kind", ["no-valid", "leading", "single"])
def test_all_masked_rows_do_not_leak(monkeypatch, cfg, kind):
    """With an SDPA that gives NaN where a query sees no valid key, the output still meets
    the contract and every invalid row is exactly 0: the NaN rows are replaced, not scaled."""
    functional = types.SimpleNamespace(**{n: getattr(F, n) for n in dir(F)
                                          if not n.startswith("__")})
    functional.scaled_dot_product_attention = _nan_sdpa
    monkeypatch.setattr(sdpa_layer, "F", functional)
    model = make_reference(cfg, seed=5)
    layer = get_backend("torch-sdpa").build(cfg, model.state_dict(), device="cpu")
    mask = _mask(kind)
    x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(6))
    x = x.masked_fill(~mask[..., None], 0.0)
    got = layer(x, mask, out=torch.full_like(x, math.nan))
    report = compare(got, streaming_forward(model.state_dict(), cfg, x, mask))
    assert report.passed, report.summary()
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))


@pytest.mark.parametrize("name", ["torch-sdpa", "torch-baseline"])
def test_caller_autocast_is_ignored(name):
    """A caller's bfloat16 autocast does not turn the fp32 peers' products into bf16 ones."""
    cfg = LayerConfig(2, 48, 128, 4, 128, 4)
    model = make_reference(cfg, seed=3)
    x, mask = make_inputs(cfg, padding_ratio=0.25, seed=4)
    layer = get_backend(name).build(cfg, model.state_dict(), device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        got = layer(x, mask)
    report = compare(got, streaming_forward(model.state_dict(), cfg, x, mask))
    assert report.passed, report.summary()


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile with Dynamo's eager backend (traced, not code-generated), fresh caches."""
    real = torch.compile

    def compile_eager(fn, **kwargs):
        return real(fn, backend="eager", **kwargs)
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", compile_eager)
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("half", [None, torch.float16], ids=["compile", "fp16"])
@pytest.mark.parametrize("cfg", [CAUSAL, FULL], ids=["causal", "full"])
def test_compiled_stack_on_each_mask_path(eager_compile, cfg, half):
    """The compiled peers' stack, traced as one graph, meets the contract on every mask path
    (here on the CPU, where no CUDA graph is captured), for the build's and another shape."""
    model = make_reference(cfg, seed=7)
    backend = TorchFp16Backend() if half else TorchCompileBackend()
    layer = SdpaLayer(backend, cfg, model.state_dict(), torch.device("cpu"), torch.float32,
                      compiled=True, half=half)
    gen = torch.Generator().manual_seed(8)
    for batch, seq_len, kind in [(2, 20, "all"), (2, 20, "suffix"), (2, 20, "no-valid"),
                                 (2, 20, "holes"), (3, 9, "leading")]:
        mask = _mask(kind, batch, seq_len)
        x = torch.randn(batch, seq_len, cfg.d_model, generator=gen)
        x = x.masked_fill(~mask[..., None], 0.0)
        # forward, not __call__: the compiled peers declare CUDA only, which __call__ checks
        # for a shape other than the build's.
        got = layer.forward(x, mask, torch.full_like(x, math.nan))
        report = compare(got, streaming_forward(model.state_dict(), cfg, x, mask))
        assert report.passed, f"{kind} {batch}x{seq_len}: {report.summary()}"
        assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))


def test_full_compile_cache_is_refused(eager_compile, monkeypatch):
    """An input shape that finds Dynamo's cache full raises Unsupported instead of running
    the stack uncompiled under the compiled peer's name."""
    cfg = CAUSAL
    model = make_reference(cfg, seed=9)
    layer = SdpaLayer(TorchCompileBackend(), cfg, model.state_dict(), torch.device("cpu"),
                      torch.float32, compiled=True)
    for name in ("recompile_limit", "accumulated_recompile_limit", "cache_size_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            monkeypatch.setattr(torch._dynamo.config, name, 1)
    layer.forward(torch.randn(2, 20, cfg.d_model), None)
    with pytest.raises(Unsupported, match="cache"):
        layer.forward(torch.randn(3, 20, cfg.d_model), None)


# GPU: the CUDA graphs of the compiled peers (and torch-sdpa's eager path beside them).
GRAPH_PEERS = ["torch-sdpa", "torch-compile", "torch-fp16"]


@needs_gpu
@pytest.mark.parametrize("name", GRAPH_PEERS)
@pytest.mark.parametrize("cfg", [CAUSAL, FULL], ids=["causal", "full"])
def test_one_buffer_set_across_mask_paths(name, cfg):
    """The same x, mask and out buffers called with masks that switch the mask path (each
    three times: eager, captured, replayed) and back: every output meets the contract, the
    caller's out is returned, and earlier outputs are not overwritten by later calls."""
    model = make_reference(cfg, seed=11)
    layer = get_backend(name).build(cfg, model.state_dict(), device="cuda")
    gen = torch.Generator().manual_seed(12)
    x = torch.empty(2, cfg.seq_len, cfg.d_model, device="cuda")
    mask = torch.empty(2, cfg.seq_len, dtype=torch.bool, device="cuda")
    out = torch.empty_like(x)
    kept = []
    for kind in ["suffix", "holes", "all", "no-valid", "suffix", "leading"]:
        host_mask = _mask(kind, 2, cfg.seq_len)
        host_x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=gen)
        host_x = host_x.masked_fill(~host_mask[..., None], 0.0)
        expected = streaming_forward(model.state_dict(), cfg, host_x, host_mask)
        x.copy_(host_x)
        mask.copy_(host_mask)
        for turn in range(3):
            out.fill_(math.nan)
            with torch.no_grad():
                got = layer(x, mask, out=out)
                fresh = layer(x, mask)
            assert got is out, f"{kind}, turn {turn}: out= is not the tensor returned"
            for result, call in ((out, "out="), (fresh, "allocating")):
                report = compare(result.cpu(), expected)
                assert report.passed, f"{kind}, turn {turn}, {call}: {report.summary()}"
            kept.append((fresh, fresh.clone()))
    for index, (result, copy) in enumerate(kept):
        assert torch.equal(result, copy), f"output {index} was overwritten by a later call"
