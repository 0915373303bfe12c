"""The backend interface: what a backend declares, how it builds a layer, how a layer is called."""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from .config import LayerConfig
from .errors import Unsupported
from .memory import PARAMETERS, MemoryPlan, check_fits
from .validation import validate_inputs, validate_output


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run. None in a field means 'no limit'."""

    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: tuple[int, ...] | None = None
    padding: bool = True
    max_tokens: int | None = None
    notes: str = ""

    def describe(self) -> dict:
        """JSON-friendly description, for listings."""
        return {
            "devices": list(self.devices),
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "head_dims": "any" if self.head_dims is None else list(self.head_dims),
            "padding": self.padding,
            "max_tokens": self.max_tokens,
            "notes": self.notes,
        }


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _takes_built(check) -> bool:
    """Whether a backend's check method accepts built=."""
    params = inspect.signature(check).parameters.values()
    return any(p.name == "built" or p.kind is p.VAR_KEYWORD for p in params)


class Backend(ABC):
    """One implementation of the stack. Subclasses set name/summary/capabilities and _build."""

    name: str = ""
    summary: str = ""
    capabilities: Capabilities = Capabilities()

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why this backend cannot run at all on device (missing toolchain...), or None."""
        return None

    def memory_plan(self, config: LayerConfig, dtype: torch.dtype) -> MemoryPlan | None:
        """Device bytes a forward of config needs beyond its input and output, or None if unknown."""
        return None

    def check(self, config: LayerConfig, device: torch.device | str, dtype: torch.dtype, *,
              built: bool = False) -> None:
        """Raise Unsupported with a clear reason if this backend cannot run the case; built:
        for a call of a layer already built, whose weights (the plan's PARAMETERS) are on the
        device and need no room again."""
        device = torch.device(device)
        caps = self.capabilities
        if device.type not in caps.devices:
            raise Unsupported(f"{self.name} runs on {'/'.join(caps.devices)}, not {device.type}")
        reason = self.unavailable_reason(device)
        if reason:
            raise Unsupported(f"{self.name}: {reason}")
        if dtype not in caps.dtypes:
            raise Unsupported(f"{self.name} does not take {dtype} inputs")
        if caps.head_dims is not None and config.head_dim not in caps.head_dims:
            raise Unsupported(
                f"{self.name} supports head dims {list(caps.head_dims)}, not {config.head_dim}"
            )
        if caps.max_tokens is not None and config.tokens > caps.max_tokens:
            raise Unsupported(
                f"{self.name} handles at most {caps.max_tokens} tokens, not {config.tokens}"
            )
        plan = self.memory_plan(config, dtype)
        if plan is not None:
            check_fits(plan.without(PARAMETERS) if built else plan, device,
                       what=f"{self.name} on {config}")

    def build(self, config: LayerConfig, state_dict: Mapping[str, torch.Tensor], *,
              device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
              ) -> "BuiltLayer":
        """Check the case, then build a callable layer from a reference state_dict.

        device defaults to the current CUDA device when there is one, else the CPU.
        """
        device = default_device() if device is None else torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise Unsupported(f"{self.name}: needs a CUDA device, and this machine has none")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.check(config, device, dtype)
        return self._build(config, state_dict, device, dtype)

    @abstractmethod
    def _build(self, config: LayerConfig, state_dict: Mapping[str, torch.Tensor],
               device: torch.device, dtype: torch.dtype) -> "BuiltLayer":
        """Build the layer; the case has already been checked."""

    def describe(self) -> dict:
        """Name, summary and capabilities as a dict."""
        return {"name": self.name, "summary": self.summary, **self.capabilities.describe()}


class BuiltLayer(ABC):
    """A layer built by a backend, called like the baseline: layer(x, valid_token_mask) -> out.

    Layers are inference-only: they keep no autograd graph, and an input that requires a
    gradient (with gradients enabled) is refused. A layer built for one batch size and
    sequence length accepts inputs of any other batch size and length.
    """

    def __init__(self, backend: Backend, config: LayerConfig, device: torch.device,
                 dtype: torch.dtype):
        self.backend = backend
        self.config = config
        self.device = device
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Validate the inputs, then run the forward; an empty batch gives an empty output.

        With out (PyTorch's convention: a contiguous tensor of x's shape, dtype and device)
        the result is written into it and out is returned.
        """
        who = self.backend.name
        validate_inputs(x, valid_token_mask, config=self.config, device=self.device,
                        dtype=self.dtype, padding=self.backend.capabilities.padding, who=who)
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{who}: layers are inference-only and compute no gradient; "
                               "call under torch.no_grad() or pass x.detach()")
        if out is not None:
            validate_output(out, x, valid_token_mask, who=who)
        if x.shape[0] == 0:
            return torch.empty_like(x) if out is None else out
        if x.shape[0] != self.config.batch_size or x.shape[1] != self.config.seq_len:
            # Another batch or length: the backend's limits and memory plan apply to it too.
            other = replace(self.config, batch_size=x.shape[0], seq_len=x.shape[1])
            if _takes_built(self.backend.check):
                self.backend.check(other, self.device, self.dtype, built=True)
            else:  # an override without built= (older out-of-tree backends)
                self.backend.check(other, self.device, self.dtype)
        return self.forward(x, valid_token_mask, out)

    @abstractmethod
    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Compute the stack on validated inputs, into out when given (else a new tensor)."""
