"""torch-compile: torch.compile (mode reduce-overhead) of the torch-sdpa stack."""
from __future__ import annotations

from layerbench.backends.torch_sdpa import TorchSdpaBackend
from layerbench.common.interface import Capabilities


class TorchCompileBackend(TorchSdpaBackend):
    """The torch-sdpa stack compiled by Inductor with CUDA graphs (dynamic shapes)."""

    name = "torch-compile"
    summary = "torch.compile(mode='reduce-overhead', dynamic=True) of torch-sdpa"
    capabilities = Capabilities(
        devices=("cuda",),
        notes="fp16/bf16 inputs are computed in fp32 and cast back; first call compiles",
    )
    compiled = True
