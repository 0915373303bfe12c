"""torch-fp16: the torch-compile stack with its matmuls under fp16 autocast."""
from __future__ import annotations

import torch

from layerbench.backends.torch_sdpa import TorchSdpaBackend
from layerbench.common.interface import Capabilities


class TorchFp16Backend(TorchSdpaBackend):
    """torch-compile's stack under torch.autocast(float16): fp16 matmul operands and attention,
    fp32 accumulation, LayerNorm, softmax statistics and residual stream in fp32."""

    name = "torch-fp16"
    summary = ("torch.compile (static shapes) of torch-sdpa under fp16 autocast, "
               "replayed from one CUDA graph per input")
    capabilities = Capabilities(
        devices=("cuda",),
        notes="a peer that may miss the contract: fp16 operands leave little margin",
    )
    compiled = True
    half = torch.float16
