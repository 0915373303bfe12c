"""The SDPA stack: the layer that orchestrates chunks, masks and the per-block math."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch.nn import functional as F

from layerbench.common.graphs import GraphedForward
from layerbench.common.errors import Unsupported
from layerbench.common.interface import BuiltLayer
from layerbench.common.memory import sequences_per_chunk
from layerbench.common.params import StackParams, pack_params, param_bytes
from layerbench.common.precision import fp32_matmul

LN_EPS = 1e-5
# Compiled layers specialise on each input shape. Dynamo keeps its specialisations on the code
# object of stack_forward, which every compiled layer of the process shares (torch-compile's
# and torch-fp16's alike), so this bounds them all together, not each layer's.
COMPILE_CACHE_LIMIT = 256


def working_bytes_per_sequence(config, general_mask: bool) -> int:
    """fp32 bytes one sequence needs inside the stack (activations, plus an [S,S] mask if any)."""
    s, d, f = config.seq_len, config.d_model, config.ffn_dim
    # A general mask is a bool [S,S] per sequence, which SDPA turns into a float bias (4 bytes
    # an element) and, for its memory-efficient kernel, pads to a key length multiple of 16 (4
    # more): up to 9 bytes an element.
    return 4 * s * (14 * d + 3 * f) + (9 * s * s if general_mask else 0)


def mask_path(valid_token_mask: torch.Tensor | None, causal: bool) -> str:
    """How attention must treat the mask: "none" (every token valid), "rows" (suffix padding
    under causal attention: masking keys changes no valid row, so only rows are zeroed) or
    "keys" (invalid keys masked in attention, rows zeroed). One host sync when a mask is given.
    """
    if valid_token_mask is None:
        return "none"
    flags = [valid_token_mask.all()]
    if causal:
        # Valid tokens form a prefix of each sequence when no invalid token precedes a valid one.
        later_valid = valid_token_mask[:, 1:] & ~valid_token_mask[:, :-1]
        flags.append(~later_valid.any())
    # One device-to-host copy of both flags.
    every_valid, *prefix = torch.stack(flags).tolist()
    if every_valid:
        return "none"
    return "rows" if causal and prefix[0] else "keys"


def stack_forward(x: torch.Tensor, params: StackParams, num_heads: int, causal: bool,
                  attn_mask: torch.Tensor | None, row_mask: torch.Tensor | None,
                  half: torch.dtype | None = None) -> torch.Tensor:
    """The stack on fp32 rows x [B,S,D]; attn_mask None or bool [B,1,S,S] / [B,1,1,S]
    (True = attend; causality already folded in); half runs it under that autocast dtype
    (LayerNorm, softmax and the residual stream stay fp32); without half, a caller's autocast
    is switched off, so the products stay fp32 (TF32 on CUDA)."""
    autocast = (torch.autocast(device_type=x.device.type, dtype=half) if half is not None
                else torch.autocast(device_type=x.device.type, enabled=False))
    b, s, d = x.shape
    hd = d // num_heads
    with autocast:
        for p in params.layers:
            h = F.layer_norm(x, (d,), p.norm1_weight, p.norm1_bias, LN_EPS)
            qkv = F.linear(h, p.qkv_weight, p.qkv_bias).view(b, s, 3, num_heads, hd)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            if attn_mask is None:
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            a = F.linear(ctx.transpose(1, 2).reshape(b, s, d), p.out_weight, p.out_bias)
            if row_mask is not None:
                a = torch.where(row_mask, a, 0.0)
            x = x + a
            h = F.layer_norm(x, (d,), p.norm2_weight, p.norm2_bias, LN_EPS)
            x = x + F.linear(F.gelu(F.linear(h, p.ffn_in_weight, p.ffn_in_bias)),
                             p.ffn_out_weight, p.ffn_out_bias)
            if row_mask is not None:
                x = torch.where(row_mask, x, 0.0)
        x = F.layer_norm(x.float(), (d,), params.final_weight, params.final_bias, LN_EPS)
    if row_mask is not None:
        x = torch.where(row_mask, x, 0.0)
    return x


def attention_mask(valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool [B,1,S,S] (causal) or [B,1,1,S] mask: True where a query may attend to a key."""
    keys = valid[:, None, None, :]
    if not causal:
        return keys
    s = valid.shape[1]
    return torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()[None, None] & keys


class SdpaLayer(BuiltLayer):
    """Chooses the mask path once per call, then runs the stack chunk by chunk.

    compiled: torch.compile (default mode, one specialisation per input shape) and replay of
    one CUDA graph per (input buffers, mask path) through GraphedForward; half: the matmuls
    under that autocast dtype.
    """

    def __init__(self, backend, config, state_dict, device, dtype, compiled: bool,
                 half: torch.dtype | None = None):
        super().__init__(backend, config, device, dtype)
        self.params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        self.half = half
        self.step = stack_forward
        self.chunks: dict[tuple[int, int, str], int] = {}
        self.graphed: dict[str, GraphedForward] = {}
        if compiled:
            _raise_compile_cache_limit()
            # fullgraph: a graph break, or a full compile cache, raises instead of running
            # part or all of the stack eagerly under this backend's name.
            self.step = torch.compile(stack_forward, dynamic=False, fullgraph=True)
            self.graphed = {path: GraphedForward(partial(self._run, path))
                            for path in ("none", "rows", "keys")}

    def forward(self, x, valid_token_mask, out=None):
        """Choose the mask path, then run the stack (from a CUDA graph when compiled)."""
        path = mask_path(valid_token_mask, self.config.causal)
        b, s, _ = x.shape
        if (b, s, path) not in self.chunks:  # planned outside any graph capture
            per_seq = working_bytes_per_sequence(replace(self.config, batch_size=1, seq_len=s),
                                                 path == "keys")
            self.chunks[(b, s, path)] = sequences_per_chunk(per_seq, param_bytes(self.config),
                                                            b, self.device)
        if path not in self.graphed:
            return self._run(path, x, valid_token_mask, out)
        try:
            result = self.graphed[path](x, valid_token_mask, out)
        except _recompile_limit_errors() as exc:
            raise Unsupported(
                f"{self.backend.name}: torch.compile's cache for the stack is full "
                f"({_compile_cache_limits()}) and this input shape would run uncompiled") from exc
        # A replay returns the out tensor of the capture; the caller's is the same memory.
        return result if out is None else out

    def _run(self, path, x, valid_token_mask, out=None):
        """The stack chunk by chunk on one mask path, into out (or a new tensor)."""
        b, s, _ = x.shape
        chunk = self.chunks[(b, s, path)]
        with fp32_matmul("tf32"), torch.no_grad():
            if out is None and chunk >= b and x.dtype == torch.float32:
                # One chunk and no out buffer: the stack's own output is the result, uncopied.
                return self._chunk(path, x, valid_token_mask)
            out = torch.empty_like(x) if out is None else out
            for b0 in range(0, b, chunk):
                rows = slice(b0, b0 + chunk)
                out[rows] = self._chunk(path, x[rows],
                                        None if path == "none" else valid_token_mask[rows])
        return out

    def _chunk(self, path, x, valid):
        """The stack on one chunk of sequences, as a new fp32 tensor."""
        row_mask = attn_mask = None
        if path != "none":
            row_mask = valid[..., None]
            if path == "keys":
                attn_mask = attention_mask(valid, self.config.causal)
        return self.step(x.float(), self.params, self.config.num_heads, self.config.causal,
                         attn_mask, row_mask, self.half)


# Dynamo's per-code-object and total cache limits under their current and older names.
_LIMIT_NAMES = ("recompile_limit", "cache_size_limit",
                "accumulated_recompile_limit", "accumulated_cache_size_limit")


def _recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """What a fullgraph compile raises when a cache limit is reached (named by release)."""
    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(getattr(torch._dynamo.exc, name) for name in names
                 if hasattr(torch._dynamo.exc, name))


def _compile_cache_limits() -> str:
    """Dynamo's cache limits, named, for an error message."""
    config = torch._dynamo.config
    return ", ".join(f"{name} {getattr(config, name)}" for name in _LIMIT_NAMES
                     if hasattr(config, name))


def _raise_compile_cache_limit() -> None:
    """Let Dynamo keep COMPILE_CACHE_LIMIT specialisations of the stack instead of failing."""
    config = torch._dynamo.config
    for name in _LIMIT_NAMES:
        if hasattr(config, name) and getattr(config, name) < COMPILE_CACHE_LIMIT:
            setattr(config, name, COMPILE_CACHE_LIMIT)
