"""torch-compile: the torch-sdpa stack compiled for each input shape, replayed as a CUDA graph."""
from __future__ import annotations

from layerbench.backends.torch_sdpa import TorchSdpaBackend
from layerbench.common.interface import Capabilities


class TorchCompileBackend(TorchSdpaBackend):
    """torch.compile (default mode, static shapes) of torch-sdpa, one CUDA graph per input."""

    name = "torch-compile"
    summary = ("torch.compile (static shapes) of torch-sdpa, TF32 matmuls, "
               "replayed from one CUDA graph per input")
    capabilities = Capabilities(
        devices=("cuda",),
        notes="fp16/bf16 inputs are computed in fp32 and cast back; the first call of each "
              "input shape compiles; one host sync per call when a mask is given",
    )
    compiled = True
