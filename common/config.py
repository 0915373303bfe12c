"""The configuration of one layer stack."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LayerConfig:
    """Sizes of a pre-norm Transformer stack and whether its attention is causal (docs/spec.md)."""

    batch_size: int
    seq_len: int
    d_model: int
    num_heads: int
    ffn_dim: int
    num_layers: int
    causal: bool = True

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LayerConfig.{name} must be a non-negative int, got {value!r}")
        # A string such as "False" would read as causal, None as full attention: bools only.
        if not isinstance(self.causal, bool):
            raise TypeError(f"LayerConfig.causal must be True or False, got {self.causal!r}")
        for name in ("seq_len", "d_model", "num_heads", "ffn_dim", "num_layers"):
            if getattr(self, name) == 0:
                raise ValueError(f"LayerConfig.{name} must be positive")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def tokens(self) -> int:
        """Number of token rows, batch_size * seq_len."""
        return self.batch_size * self.seq_len

    def with_batch(self, batch_size: int) -> "LayerConfig":
        """The same config with another batch size."""
        return LayerConfig(**{**asdict(self), "batch_size": batch_size})

    def as_dict(self) -> dict:
        """Plain-dict form, for JSON reports."""
        return asdict(self)
