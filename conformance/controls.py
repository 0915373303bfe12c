"""Negative controls: backends that are wrong on purpose, each with one defect.

They wrap the strict-fp32 reference stack (reference/model.py), so without a defect they
pass every check; conformance/test_controls.py registers them for its own tests only and
asserts that the suite rejects each one.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from layerbench.common.contract import PRESETS
from layerbench.common.interface import Backend, BuiltLayer, Capabilities
from layerbench.common.params import check_state_dict
from layerbench.reference.model import BaselineStack, reference_forward

# The biased control moves one element by this multiple of what the official contract allows.
BIAS_OVER_ALLOWANCE = 1.5


class HonestControl(Backend):
    """The strict-fp32 reference stack as a backend, no defect (the controls' baseline)."""

    name = "control-honest"
    summary = "negative-control wrapper of the reference stack, no defect"
    defect = "none"
    capabilities = Capabilities(devices=("cpu", "cuda"),
                                notes="a negative control; registered by its tests only")

    def model_config(self, config):
        """The config the wrapped reference model is built with."""
        return config

    def adjust(self, model: BaselineStack) -> None:
        """Change the loaded reference model (in place)."""

    def mask_for(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask the reference model is run with."""
        return mask

    def finish(self, result: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Change the fp32 result before it is stored."""
        return result

    def rows_written(self, x: torch.Tensor) -> torch.Tensor | None:
        """Bool [B, S] of the output rows stored, or None for all."""
        return None

    def allocate(self, x: torch.Tensor) -> torch.Tensor:
        """The output tensor of a call without out=."""
        return torch.empty_like(x)

    def _build(self, config, state_dict, device, dtype):
        check_state_dict(config, state_dict)
        model = BaselineStack(self.model_config(config))
        model.load_state_dict(state_dict, strict=True)
        self.adjust(model)
        return ControlLayer(self, config, device, dtype, model.to(device).eval())


class ControlLayer(BuiltLayer):
    """Runs the reference in strict fp32 with its backend's defect; stores into out or a tensor
    the backend allocates (torch.empty)."""

    def __init__(self, backend, config, device, dtype, model):
        super().__init__(backend, config, device, dtype)
        self.model = model

    def forward(self, x, valid_token_mask, out=None):
        """The reference's output, changed by the defect, written row by row."""
        backend = self.backend
        result = reference_forward(self.model, x.float(), backend.mask_for(valid_token_mask),
                                   precision="ieee")
        result = backend.finish(result, valid_token_mask).to(x.dtype)
        out = backend.allocate(x) if out is None else out
        rows = backend.rows_written(x)
        if rows is None:
            out.copy_(result)
        else:
            out[rows] = result[rows]
        return out


class UnwrittenRowControl(HonestControl):
    """Never writes one output row (the last sequence's first token)."""

    name = "control-unwritten-row"
    defect = "leaves one output row unwritten"

    def rows_written(self, x):
        """Every row but (B-1, 0)."""
        rows = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        rows[-1, 0] = False
        return rows


class LayerNormIgnoredControl(HonestControl):
    """Uses LayerNorm weight 1 and bias 0 instead of the given parameters."""

    name = "control-layernorm-ignored"
    defect = "ignores the LayerNorm parameters"

    def adjust(self, model):
        """Reset every LayerNorm to weight 1, bias 0."""
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()


class MaskIgnoredControl(HonestControl):
    """Treats every token as valid."""

    name = "control-mask-ignored"
    defect = "ignores the mask"

    def mask_for(self, mask):
        """No mask."""
        return None


class KeysUnmaskedControl(HonestControl):
    """Zeroes the invalid rows but lets every query attend to invalid keys."""

    name = "control-keys-unmasked"
    defect = "does not mask invalid keys in attention"

    def mask_for(self, mask):
        """No mask inside the stack."""
        return None

    def finish(self, result, mask):
        """result with the invalid rows zeroed, as the row zeroing alone would leave them."""
        return result if mask is None else result * mask[..., None].to(result.dtype)


class BiasedElementControl(HonestControl):
    """Moves output element [0, 0, 0] by BIAS_OVER_ALLOWANCE times its official allowance."""

    name = "control-biased-element"
    defect = "adds a small bias to one element"

    def finish(self, result, mask):
        """result with element [0, 0, 0] moved up by 1.5 * max(atol, rtol * |value|)."""
        atol, rtol = PRESETS["official"]
        result = result.clone()
        value = result[0, 0, 0]
        result[0, 0, 0] = value + BIAS_OVER_ALLOWANCE * torch.clamp(rtol * value.abs(), min=atol)
        return result


class CausalAlwaysControl(HonestControl):
    """Computes causal attention whatever the config says."""

    name = "control-causal-always"
    defect = "computes causal attention for a non-causal config"

    def model_config(self, config):
        """The config with causal=True."""
        return replace(config, causal=True)


DEFECTIVE = (UnwrittenRowControl, LayerNormIgnoredControl, MaskIgnoredControl,
             KeysUnmaskedControl, BiasedElementControl, CausalAlwaysControl)
CONTROLS = (HonestControl,) + DEFECTIVE
