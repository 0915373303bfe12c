"""Every backend on the caller's CUDA stream and on its tensors' device (GPU only): a layer
called on a side stream whose input lands only after a long sleep on that stream, and a
layer on a second device called while the first is current. A kernel launched on any other
stream, or on the current device instead of its tensors', would read the input before it
is written (NaN) or fail."""
from __future__ import annotations

import math

import pytest
import torch

from layerbench.common.config import LayerConfig
from layerbench.common.contract import compare
from layerbench.common.errors import Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.common.registry import get_backend
from layerbench.reference import make_reference, reference_forward

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                    reason="needs two CUDA devices")

# d_model 32 at shape 7's length: cupy's and cutile's whole-block kernels and wmma's
# ffn_block run it; d_model 128: the separate kernels.
CONFIGS = {"d32": LayerConfig(2, 128, 32, 4, 32, 2), "d128": LayerConfig(2, 40, 128, 4, 128, 2)}
COMPILED_PEERS = ("torch-compile", "torch-fp16")
# Options beside the defaults whose launch paths differ: cupy launching through CuPy rather
# than programmatically, cutile without its whole-block kernel.
OPTIONS = {"cupy": [{}, {"pdl": False}], "cutile": [{}, {"fuse_block": False}]}


def _layer(backend_name: str, options: dict, cfg: LayerConfig, model, device: str):
    """The backend built with options on device, or a skip with its reason."""
    if backend_name in COMPILED_PEERS:
        pytest.skip(f"{backend_name}'s call path is torch-sdpa's, tested there")
    backend = type(get_backend(backend_name))(**options)
    try:
        return backend.build(cfg, model.state_dict(), device=device)
    except Unsupported as exc:
        pytest.skip(str(exc))


def _option_sets(backend_name: str) -> list[dict]:
    """The option sets a backend runs these tests with."""
    return OPTIONS.get(backend_name, [{}])


@needs_gpu
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_runs_on_a_pending_stream(backend_name, config_name, seed):
    """Eager, captured and replayed on a side stream whose input is written after a long
    sleep there, into a NaN-filled out=: every output meets the contract."""
    cfg = CONFIGS[config_name]
    model = make_reference(cfg, seed=seed)
    x, valid = make_inputs(cfg, padding_ratio=0.25, seed=seed + 1, device="cuda")
    expected = reference_forward(model.cuda(), x, valid)
    for options in _option_sets(backend_name):
        layer = _layer(backend_name, options, cfg, model, "cuda")
        side = torch.cuda.Stream()
        staged, out = torch.full_like(x, math.nan), torch.full_like(x, math.nan)
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for turn in range(4):  # eager, eager, captured, replayed
                staged.fill_(math.nan)
                out.fill_(math.nan)
                torch.cuda._sleep(50_000_000)  # tens of milliseconds before the input lands
                staged.copy_(x)
                layer(staged, valid, out=out)
                got = out.clone()
                side.synchronize()
                report = compare(got, expected)
                assert report.passed, f"{options}, turn {turn}: {report.summary()}"
        torch.cuda.current_stream().wait_stream(side)


@needs_two_gpus
def test_runs_on_a_device_that_is_not_current(backend_name, seed):
    """A layer on cuda:1 called while cuda:0 is current and a side stream with pending work
    is current on cuda:1: eager, captured and replayed outputs meet the contract, also after
    the input changes, and cuda:0 stays current."""
    cfg = CONFIGS["d128"]
    model = make_reference(cfg, seed=seed)
    x, valid = make_inputs(cfg, padding_ratio=0.25, seed=seed + 1, device="cuda:1")
    for options in _option_sets(backend_name):
        with torch.cuda.device(0):
            layer = _layer(backend_name, options, cfg, model, "cuda:1")
        side = torch.cuda.Stream(device="cuda:1")
        side.wait_stream(torch.cuda.current_stream("cuda:1"))
        # The stream first (entering it makes its device current), then cuda:0 current.
        staged = torch.empty_like(x)  # one buffer: the third call captures, the fourth replays
        with torch.no_grad(), torch.cuda.stream(side), torch.cuda.device(0):
            for turn in range(4):  # eager, eager, captured, replayed after a change
                staged.fill_(math.nan)  # on cuda:1's current stream: side
                with torch.cuda.device(1):
                    torch.cuda._sleep(50_000_000)  # on side, before the input lands
                staged.copy_(x if turn < 3 else -x)
                assert torch.cuda.current_device() == 0
                assert torch.cuda.current_stream(1) == side
                got = layer(staged, valid)
                side.synchronize()
                want = reference_forward(model.to("cuda:1"), staged, valid)
                report = compare(got, want)
                assert report.passed, f"{options}, turn {turn}: {report.summary()}"
