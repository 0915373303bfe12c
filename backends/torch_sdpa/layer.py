"""The SDPA stack: the layer that orchestrates chunks, masks and the per-block math."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial

import torch
from torch.nn import functional as F

from layerbench.common.graphs import GraphedForward
from layerbench.common.inputs import prefix_lengths
from layerbench.common.interface import BuiltLayer
from layerbench.common.memory import sequences_per_chunk
from layerbench.common.params import StackParams, pack_params, param_bytes
from layerbench.common.precision import fp32_matmul

LN_EPS = 1e-5
# Compiled layers specialise on each input shape; room for many layers and shapes per process.
COMPILE_CACHE_LIMIT = 256


def working_bytes_per_sequence(config, general_mask: bool) -> int:
    """fp32 bytes one sequence needs inside the stack (activations, plus an [S,S] mask if any)."""
    s, d, f = config.seq_len, config.d_model, config.ffn_dim
    return 4 * s * (14 * d + 3 * f) + (s * s if general_mask else 0)


def mask_path(valid_token_mask: torch.Tensor | None, causal: bool) -> str:
    """How attention must treat the mask: "none" (every token valid), "rows" (suffix padding
    under causal attention: masking keys changes no valid row, so only rows are zeroed) or
    "keys" (invalid keys masked in attention, rows zeroed). One host sync when a mask is given.
    """
    if valid_token_mask is None:
        return "none"
    lengths = prefix_lengths(valid_token_mask)
    if lengths is not None and bool((lengths == valid_token_mask.shape[1]).all()):
        return "none"
    return "rows" if (causal and lengths is not None) else "keys"


def stack_forward(x: torch.Tensor, params: StackParams, num_heads: int, causal: bool,
                  attn_mask: torch.Tensor | None, row_mask: torch.Tensor | None,
                  half: torch.dtype | None = None) -> torch.Tensor:
    """The stack on fp32 rows x [B,S,D]; attn_mask None or bool [B,1,S,S] / [B,1,1,S]
    (True = attend; causality already folded in); half runs it under that autocast dtype
    (LayerNorm, softmax and the residual stream stay fp32)."""
    autocast = (torch.autocast(device_type=x.device.type, dtype=half) if half is not None
                else contextlib.nullcontext())
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
            self.step = torch.compile(stack_forward, dynamic=False)
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
        if path in self.graphed:
            return self.graphed[path](x, valid_token_mask, out)
        return self._run(path, x, valid_token_mask, out)

    def _run(self, path, x, valid_token_mask, out=None):
        """The stack chunk by chunk on one mask path, into out (or a new tensor)."""
        b, s, _ = x.shape
        chunk = self.chunks[(b, s, path)]
        out = torch.empty_like(x) if out is None else out
        with fp32_matmul("tf32"), torch.no_grad():
            for b0 in range(0, b, chunk):
                xs = x[b0:b0 + chunk].float()
                row_mask = attn_mask = None
                if path != "none":
                    valid = valid_token_mask[b0:b0 + chunk]
                    row_mask = valid[..., None]
                    if path == "keys":
                        attn_mask = attention_mask(valid, self.config.causal)
                out[b0:b0 + chunk] = self.step(xs, self.params, self.config.num_heads,
                                               self.config.causal, attn_mask, row_mask,
                                               self.half)
        return out


def _raise_compile_cache_limit() -> None:
    """Let Dynamo keep a specialisation per layer and input shape instead of falling back."""
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if getattr(config, name, COMPILE_CACHE_LIMIT) < COMPILE_CACHE_LIMIT:
            setattr(config, name, COMPILE_CACHE_LIMIT)
