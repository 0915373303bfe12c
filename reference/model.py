"""The baseline stack exactly as docs/spec.md describes it (it forms the full [B,H,S,S] scores)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerbench.common.config import LayerConfig
from layerbench.common.precision import fp32_matmul

LN_EPS = 1e-5


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v/out projections."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor, valid: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """Attention of normalised rows h, invalid rows of the result set to 0."""
        b, s, d = h.shape
        hd = d // self.num_heads

        def split(t):
            return t.view(b, s, self.num_heads, hd).transpose(1, 2)

        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        scores = (q @ k.transpose(-1, -2)) * hd ** -0.5
        if causal:
            future = torch.ones(s, s, dtype=torch.bool, device=h.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        if valid is not None:
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(h.dtype)
        ctx = (p @ v).transpose(1, 2).reshape(b, s, d)
        a = self.out_proj(ctx)
        if valid is not None:
            a = a.masked_fill(~valid[..., None], 0.0)
        return a


class Block(nn.Module):
    """One pre-norm block: x + attention(norm1 x), then x + ffn(norm2 x)."""

    def __init__(self, cfg: LayerConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.attention = Attention(cfg.d_model, cfg.num_heads)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.ffn_in = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.ffn_out = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.causal = cfg.causal

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Apply the block to x."""
        x = x + self.attention(self.norm1(x), valid, self.causal)
        x = x + self.ffn_out(F.gelu(self.ffn_in(self.norm2(x))))
        if valid is not None:
            x = x.masked_fill(~valid[..., None], 0.0)
        return x


class BaselineStack(nn.Module):
    """The reference stack; its state_dict names are the project's parameter names."""

    def __init__(self, cfg: LayerConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)

    def forward(self, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The stack's output [B, S, D] in x's dtype."""
        for layer in self.layers:
            x = layer(x, valid_token_mask)
        x = self.final_norm(x)
        if valid_token_mask is not None:
            x = x.masked_fill(~valid_token_mask[..., None], 0.0)
        return x


def make_reference(cfg: LayerConfig, seed: int = 0, randomize_norms: bool = True
                   ) -> BaselineStack:
    """A fp32 CPU baseline with seeded default init; LayerNorm parameters randomised if asked."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = BaselineStack(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    if randomize_norms:
        gen = torch.Generator().manual_seed(seed + 7919)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.copy_(1.0 + 0.5 * (torch.rand(p.shape, generator=gen) * 2 - 1))
                elif "norm" in name and name.endswith("bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


@torch.no_grad()
def reference_forward(model: BaselineStack, x: torch.Tensor, valid_token_mask=None,
                      precision: str = "ieee") -> torch.Tensor:
    """Run the baseline with fp32 matmuls 'ieee' (strict, the oracle) or 'tf32' (torch-baseline)."""
    with fp32_matmul(precision):
        return model(x, valid_token_mask)
