"""The streaming oracle: the baseline's function in strict fp32, query block by query block.

It never forms an [S, S] tensor, so it gives the true output of chosen sequences of any
shape, shape 14 included. A query row whose keys are all masked gets attention output 0
(the project's definition; the baseline gives NaN there).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch.nn import functional as F

from layerbench.common.config import LayerConfig
from layerbench.common.memory import MemoryPlan
from layerbench.common.params import param_bytes
from layerbench.common.precision import fp32_matmul

from .model import LN_EPS


def packed_attention(qkv: torch.Tensor, valid: torch.Tensor | None, *, batch: int,
                     seq_len: int, heads: int, causal: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, blind) of one attention step in fp32, for kernel tests: qkv [B*S, 3D] packed
    as the backends store it, valid a [B, S] key mask (nonzero = valid) or None; context
    [B, S, D] with 0 on rows that see no valid key, blind bool [B, S, D] marking those rows."""
    d = qkv.shape[1] // 3
    head_dim = d // heads
    q, k, v = (t.float().view(batch, seq_len, heads, head_dim).transpose(1, 2)
               for t in qkv.split(d, dim=1))
    scores = q @ k.transpose(-1, -2) * head_dim ** -0.5
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool, device=qkv.device)
    visible = (visible.tril() if causal else visible)[None, None]  # [1, 1, S, S]
    if valid is not None:
        visible = visible & (valid != 0)[:, None, None, :]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    context = (probs @ v).transpose(1, 2).reshape(batch, seq_len, d)
    blind = (~visible.any(-1)).transpose(1, 2)  # [B, S, 1]: the mask is the same per head
    return context, blind.expand(batch, seq_len, d)


def _param(sd: Mapping[str, torch.Tensor], name: str, device) -> torch.Tensor:
    return sd[name].detach().to(device=device, dtype=torch.float32)


def default_query_block(config: LayerConfig, seq_len: int) -> int:
    """Query rows per block: one [H, Q, S] fp32 score block near 2 GiB (at least 16 rows)."""
    return max(16, min(seq_len, (2 << 30) // max(1, 4 * config.num_heads * seq_len)))


def oracle_plan(config: LayerConfig, sequences: int) -> MemoryPlan:
    """Device bytes streaming_forward needs for `sequences` sequences of config (one at a time)."""
    s, d, f, h = config.seq_len, config.d_model, config.ffn_dim, config.num_heads
    block = default_query_block(config, s)
    return MemoryPlan({
        # The scores, their masked copy and the softmax of one query block.
        "oracle score block": 3 * 4 * h * block * s,
        "oracle activations (one sequence)": 4 * s * (12 * d + 3 * f),
        # The outputs of the chosen sequences, and their stacked copy.
        "oracle output": 2 * 4 * sequences * s * d,
        "oracle parameters": param_bytes(config),
    })


def _attention_one(q, k, v, valid_keys, causal: bool, query_block: int) -> torch.Tensor:
    """ctx [S, D] for one sequence; q, k, v are [H, S, hd]."""
    heads, s, hd = q.shape
    scale = hd ** -0.5
    out = torch.empty(s, heads * hd, device=q.device, dtype=torch.float32)
    for i0 in range(0, s, query_block):
        i1 = min(s, i0 + query_block)
        kend = i1 if causal else s
        scores = torch.matmul(q[:, i0:i1], k[:, :kend].transpose(-1, -2)) * scale
        allowed = torch.ones(i1 - i0, kend, dtype=torch.bool, device=q.device)
        if causal:
            rows = torch.arange(i0, i1, device=q.device)[:, None]
            allowed &= torch.arange(kend, device=q.device)[None, :] <= rows
        if valid_keys is not None:
            allowed &= valid_keys[None, :kend]
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        p = torch.where(allowed.any(-1)[None, :, None], p, torch.zeros((), device=q.device))
        del scores
        ctx = torch.matmul(p, v[:, :kend])  # [H, Q, hd]
        out[i0:i1] = ctx.transpose(0, 1).reshape(i1 - i0, heads * hd)
    return out


@torch.no_grad()
def streaming_forward(state_dict: Mapping[str, torch.Tensor], config: LayerConfig,
                      x: torch.Tensor, valid_token_mask: torch.Tensor | None = None,
                      batch_indices: Sequence[int] | None = None, device=None,
                      query_block: int | None = None) -> torch.Tensor:
    """Strict-fp32 output [len(batch_indices), S, D] of the chosen sequences (default: all)."""
    device = torch.device(device) if device is not None else x.device
    if batch_indices is None:
        batch_indices = range(x.shape[0])
    s, d, heads = x.shape[1], config.d_model, config.num_heads
    if query_block is None:
        query_block = default_query_block(config, s)
    outs = []
    with fp32_matmul("ieee"):
        for b in batch_indices:
            h_x = x[b].to(device=device, dtype=torch.float32)
            valid = None if valid_token_mask is None else valid_token_mask[b].to(device)
            for i in range(config.num_layers):
                p = f"layers.{i}."

                def lin(t, name):
                    return F.linear(t, _param(state_dict, p + name + ".weight", device),
                                    _param(state_dict, p + name + ".bias", device))

                def ln(t, name):
                    return F.layer_norm(t, (d,), _param(state_dict, p + name + ".weight", device),
                                        _param(state_dict, p + name + ".bias", device), LN_EPS)

                h = ln(h_x, "norm1")
                q, k, v = (lin(h, f"attention.{n}").view(s, heads, -1).transpose(0, 1)
                           for n in ("q_proj", "k_proj", "v_proj"))
                ctx = _attention_one(q, k, v, valid, config.causal, query_block)
                del q, k, v, h
                a = lin(ctx, "attention.out_proj")
                if valid is not None:
                    a = a.masked_fill(~valid[:, None], 0.0)
                h_x = h_x + a
                h_x = h_x + lin(F.gelu(lin(ln(h_x, "norm2"), "ffn_in")), "ffn_out")
                if valid is not None:
                    h_x = h_x.masked_fill(~valid[:, None], 0.0)
            out = F.layer_norm(h_x, (d,), _param(state_dict, "final_norm.weight", device),
                               _param(state_dict, "final_norm.bias", device), LN_EPS)
            if valid is not None:
                out = out.masked_fill(~valid[:, None], 0.0)
            outs.append(out)
    return torch.stack(outs) if outs else x.new_empty((0, s, d), dtype=torch.float32)
