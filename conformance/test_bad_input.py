"""Bad input is refused the same way by every backend (the checks live in common/)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from layerbench.common.config import LayerConfig
from layerbench.common.errors import MemoryPlanError, Unsupported
from layerbench.common.inputs import make_inputs
from layerbench.common.registry import get_backend
from layerbench.common.shapes import CI
from layerbench.reference import make_reference, reference_forward

CFG = CI[3].config


@pytest.fixture
def built(backend_name, device, seed):
    """(layer, model, x, mask) for a small fp32 case, or a skip with the backend's reason."""
    model = make_reference(CFG, seed=seed)
    try:
        layer = get_backend(backend_name).build(CFG, model.state_dict(), device=device)
    except Unsupported as exc:
        pytest.skip(str(exc))
    x, mask = make_inputs(CFG, seed=seed, device=device, padding_ratio=0.25)
    return layer, model, x, mask


def _other_device(device):
    return torch.device("cpu") if device.type == "cuda" else torch.device("meta")


BAD_CASES = {
    "dtype": (lambda x, m, dev: (x.double(), m), TypeError, "dtype"),
    "device": (lambda x, m, dev: (x.to(_other_device(dev)), m), ValueError, "is on"),
    "rank": (lambda x, m, dev: (x[0], m), ValueError, "rank"),
    "d_model": (lambda x, m, dev: (x[..., :-1].contiguous(), m), ValueError, "d_model"),
    "mask_shape": (lambda x, m, dev: (x, m[:, :-1].contiguous()), ValueError, "mask has shape"),
    "mask_dtype": (lambda x, m, dev: (x, m.float()), TypeError, "bool"),
    "non_contiguous": (lambda x, m, dev: (x.transpose(0, 1).contiguous().transpose(0, 1), m),
                       ValueError, "contiguous"),
    "not_a_tensor": (lambda x, m, dev: (x.tolist(), m), TypeError, "torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused(built, case, device):
    """Each malformed call raises a TypeError/ValueError naming the problem."""
    layer, _, x, mask = built
    mutate, error, words = BAD_CASES[case]
    bad_x, bad_mask = mutate(x, mask, device)
    with pytest.raises(error, match=words):
        layer(bad_x, bad_mask)


def test_empty_batch(built):
    """A batch of zero sequences gives an empty output of the right shape and dtype."""
    layer, _, x, mask = built
    out = layer(x[:0], mask[:0])
    assert out.shape == (0, CFG.seq_len, CFG.d_model) and out.dtype == x.dtype


def test_nan_propagates_like_the_reference(built, device):
    """A NaN in one valid token poisons exactly the outputs it poisons in the reference."""
    layer, model, x, mask = built
    x = x.clone()
    x[0, 5, 3] = float("nan")
    mask = mask.clone()
    mask[0, :8] = True
    with torch.no_grad():
        out = layer(x, mask)
    expected = reference_forward(model.to(device), x, mask)
    model.to("cpu")
    got_bad = ~torch.isfinite(out).all(-1)
    want_bad = ~torch.isfinite(expected).all(-1)
    assert want_bad.any(), "the reference should have non-finite rows here"
    assert torch.equal(got_bad, want_bad), (
        f"non-finite rows differ: got {got_bad.nonzero().tolist()[:6]}, "
        f"reference {want_bad.nonzero().tolist()[:6]}")


def test_heads_must_divide_d_model():
    """A config with d_model % num_heads != 0 is refused before any backend sees it."""
    with pytest.raises(ValueError, match="divisible"):
        LayerConfig(2, 16, 130, 4, 64, 1)


def test_memory_plan_refuses_before_allocating(backend_name, device):
    """A case far larger than the device is refused by the memory plan, allocating nothing."""
    huge = LayerConfig(1, 20_000_000, 1024, 16, 4096, 1)
    backend = get_backend(backend_name)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    with pytest.raises(Unsupported) as info:
        backend.check(huge, device, torch.float32)
    if not isinstance(info.value, MemoryPlanError):
        pytest.skip(f"refused earlier: {info.value}")
    assert "GiB" in str(info.value)
    if before is not None:
        assert torch.cuda.memory_allocated(device) == before


def test_other_shape_is_checked_again(device, seed):
    """A call whose batch or length differs from the build meets the backend's limits again."""
    from layerbench.backends.torch_sdpa import TorchSdpaBackend
    from layerbench.common.interface import Capabilities

    class Limited(TorchSdpaBackend):
        name = "limited-sdpa"
        capabilities = Capabilities(devices=("cpu", "cuda"), max_tokens=2 * CFG.seq_len)

    model = make_reference(CFG, seed=seed)
    layer = Limited().build(CFG, model.state_dict(), device=device)
    x, mask = make_inputs(CFG, seed=seed, device=device)
    with torch.no_grad():
        layer(x[:1], mask[:1])  # fewer tokens: fine
        with pytest.raises(Unsupported, match="at most"):
            big = torch.zeros(3, CFG.seq_len, CFG.d_model, device=device)
            layer(big, None)


def test_a_built_layer_is_checked_without_its_weights(device, seed, monkeypatch):
    """A call of another batch or length is checked against the memory left beside the
    built layer's weights, which are not counted again; a new build counts them."""
    from layerbench.backends.torch_sdpa import TorchSdpaBackend
    from layerbench.common import interface
    from layerbench.common.memory import PARAMETERS, MemoryPlan

    class WeightsOnly(TorchSdpaBackend):
        name = "weights-only-sdpa"

        def memory_plan(self, config, dtype):
            return MemoryPlan({"one sequence": 1, PARAMETERS: 2 ** 60})

    backend = WeightsOnly()
    with pytest.raises(MemoryPlanError, match="parameters"):
        backend.build(CFG, make_reference(CFG, seed=seed).state_dict(), device=device)
    monkeypatch.setattr(interface, "check_fits", lambda plan, device, what: None)
    layer = backend.build(CFG, make_reference(CFG, seed=seed).state_dict(), device=device)
    monkeypatch.undo()
    x, mask = make_inputs(CFG, seed=seed, device=device)
    with torch.no_grad():
        got = layer(x[:1], mask[:1])  # another batch: checked again, the weights not counted
    assert got.shape == x[:1].shape
    with pytest.raises(MemoryPlanError, match="parameters"):
        backend.check(replace(CFG, batch_size=1), device, torch.float32)


def test_a_check_override_without_built_still_runs(device, seed):
    """An out-of-tree backend whose check override predates built= is called without it
    when a built layer meets another batch or length."""
    from layerbench.backends.torch_sdpa import TorchSdpaBackend

    class OldCheck(TorchSdpaBackend):
        name = "old-check-sdpa"
        seen = []

        def check(self, config, device, dtype):
            self.seen.append(config.batch_size)
            super().check(config, device, dtype)

    layer = OldCheck().build(CFG, make_reference(CFG, seed=seed).state_dict(), device=device)
    x, mask = make_inputs(CFG, seed=seed, device=device)
    with torch.no_grad():
        layer(x[:1], mask[:1])
    assert OldCheck.seen == [CFG.batch_size, 1]


def test_out_buffer_is_checked(device, seed):
    """out= must match x and must not be x itself."""
    model = make_reference(CFG, seed=seed)
    layer = get_backend("torch-sdpa").build(CFG, model.state_dict(), device=device)
    x, mask = make_inputs(CFG, seed=seed, device=device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="out must match"):
            layer(x, mask, out=torch.empty_like(x)[:, :-1])
        with pytest.raises(ValueError, match="not overlap x"):
            layer(x, mask, out=x)
        buffer = torch.zeros(2 * x.shape[0], *x.shape[1:], device=device)
        buffer[:x.shape[0]] = x
        with pytest.raises(ValueError, match="not overlap x"):  # a partial overlap
            layer(buffer[:x.shape[0]], mask, out=buffer[1:x.shape[0] + 1])
        with pytest.raises(ValueError, match="contiguous"):
            layer(x, mask, out=torch.empty_like(x).transpose(0, 1).contiguous().transpose(0, 1))


def _aliases(base, start, like):
    """A tensor shaped like `like` over base's memory from element start, held by a storage
    object of its own (as torch.from_dlpack or torch.from_numpy of one buffer make)."""
    return torch.from_dlpack(base[start:start + like.numel()]).view(like.shape)


def test_out_aliasing_x_through_another_storage_is_refused(built, device):
    """out over x's memory shifted by one row, held by another storage object, is refused:
    a kernel that writes out while it still reads x would give a wrong answer silently."""
    layer, _, x, mask = built
    base = torch.zeros(x.numel() + CFG.d_model, device=device)
    shared_x = _aliases(base, 0, x)
    shared_x.copy_(x)
    out = _aliases(base, CFG.d_model, x)
    assert out.untyped_storage().data_ptr() != shared_x.untyped_storage().data_ptr()
    with torch.no_grad(), pytest.raises(ValueError, match="not overlap x"):
        layer(shared_x, mask, out=out)


def test_out_overlapping_the_mask_is_refused(built, device):
    """out whose memory holds the mask is refused: the mask is read until the end."""
    layer, _, x, mask = built
    out = torch.empty_like(x)
    shared = out.view(-1).view(torch.uint8)[:mask.numel()].view(torch.bool).view(mask.shape)
    shared.copy_(mask)
    with torch.no_grad(), pytest.raises(ValueError, match="not overlap valid_token_mask"):
        layer(x, shared, out=out)


def test_sparse_tensors_are_refused(built):
    """A sparse x, mask or out raises TypeError naming the layout."""
    layer, _, x, mask = built
    with torch.no_grad():
        with pytest.raises(TypeError, match="dense"):
            layer(x.to_sparse(), mask)
        with pytest.raises(TypeError, match="dense"):
            layer(x, mask.to_sparse())
        with pytest.raises(TypeError, match="dense"):
            layer(x, mask, out=torch.zeros_like(x).to_sparse())


@pytest.mark.parametrize("causal", ["False", None, 0, 1.0])
def test_causal_must_be_a_bool(causal):
    """A causal flag that is not a bool is refused (the string "False" would read as causal)."""
    with pytest.raises(TypeError, match="causal"):
        LayerConfig(2, 16, 32, 2, 32, 1, causal)


def test_sizes_must_not_be_bools():
    """True is an int to Python, but not a size."""
    with pytest.raises(ValueError, match="batch_size"):
        LayerConfig(True, 16, 32, 2, 32, 1)
