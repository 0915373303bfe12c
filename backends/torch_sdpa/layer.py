"""The SDPA stack: the layer that orchestrates chunks, masks and the per-block math."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.nn import functional as F

from layerbench.common.inputs import prefix_lengths
from layerbench.common.interface import BuiltLayer
from layerbench.common.memory import sequences_per_chunk
from layerbench.common.params import StackParams, pack_params, param_bytes
from layerbench.common.precision import fp32_matmul

LN_EPS = 1e-5


def working_bytes_per_sequence(config, general_mask: bool) -> int:
    """fp32 bytes one sequence needs inside the stack (activations, plus an [S,S] mask if any)."""
    s, d, f = config.seq_len, config.d_model, config.ffn_dim
    return 4 * s * (14 * d + 3 * f) + (s * s if general_mask else 0)


def stack_forward(x: torch.Tensor, params: StackParams, num_heads: int,
                  attn_mask: torch.Tensor | None, row_mask: torch.Tensor | None) -> torch.Tensor:
    """The stack on fp32 rows x [B,S,D]; attn_mask is None (plain causal) or [B,1,S,S] bool."""
    b, s, d = x.shape
    hd = d // num_heads
    for p in params.layers:
        h = F.layer_norm(x, (d,), p.norm1_weight, p.norm1_bias, LN_EPS)
        qkv = F.linear(h, p.qkv_weight, p.qkv_bias).view(b, s, 3, num_heads, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if attn_mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
    x = F.layer_norm(x, (d,), params.final_weight, params.final_bias, LN_EPS)
    if row_mask is not None:
        x = torch.where(row_mask, x, 0.0)
    return x


class SdpaLayer(BuiltLayer):
    """Chooses the mask path once per call, then runs the stack chunk by chunk."""

    def __init__(self, backend, config, state_dict, device, dtype, compiled: bool):
        super().__init__(backend, config, device, dtype)
        self.params = pack_params(config, state_dict, device=device, dtype=torch.float32)
        self.compiled = compiled
        self.step = stack_forward
        if compiled:
            self.step = torch.compile(stack_forward, mode="reduce-overhead", dynamic=True)

    def _run(self, x, attn_mask, row_mask):
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
            return self.step(x, self.params, self.config.num_heads, attn_mask, row_mask).clone()
        return self.step(x, self.params, self.config.num_heads, attn_mask, row_mask)

    def forward(self, x, valid_token_mask, out=None):
        """Choose the mask path once, then run the stack chunk by chunk."""
        b, s, _ = x.shape
        general = False
        if valid_token_mask is not None:
            lengths = prefix_lengths(valid_token_mask)
            if lengths is None:
                general = True
            elif bool((lengths == s).all()):
                # Suffix padding: causal masking already hides every invalid key from every
                # valid query, so only the row zeroing remains (none at all if all are valid).
                valid_token_mask = None
        per_seq = working_bytes_per_sequence(replace(self.config, batch_size=1, seq_len=s),
                                             general)
        chunk = sequences_per_chunk(per_seq, param_bytes(self.config), b, self.device)
        out = torch.empty_like(x) if out is None else out
        with fp32_matmul("tf32"), torch.no_grad():
            for b0 in range(0, b, chunk):
                xs = x[b0:b0 + chunk].float()
                row_mask = attn_mask = None
                if valid_token_mask is not None:
                    valid = valid_token_mask[b0:b0 + chunk]
                    row_mask = valid[..., None]
                    if general:
                        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                        attn_mask = causal[None, None] & valid[:, None, None, :]
                out[b0:b0 + chunk] = self._run(xs, attn_mask, row_mask)
        return out
