"""The 14 official shapes of docs/spec.md and their small CPU-sized variants for CI."""
from __future__ import annotations

from dataclasses import dataclass

from .config import LayerConfig


@dataclass(frozen=True)
class Shape:
    """One catalogued shape: its official number, a short name and its config."""

    number: int
    name: str
    config: LayerConfig
    kind: str = "official"  # "official" or "ci"

    @property
    def id(self) -> str:
        """A test id such as 's01-base' or 'ci01-base'."""
        prefix = "s" if self.kind == "official" else "ci"
        return f"{prefix}{self.number:02d}-{self.name}"


_OFFICIAL_ROWS = [
    # number, name, B, S, D, H, F, L
    (1, "base", 64, 128, 128, 4, 128, 4),
    (2, "batch1", 1, 128, 128, 4, 128, 4),
    (3, "batch4", 4, 128, 128, 4, 128, 4),
    (4, "batch16", 16, 128, 128, 4, 128, 4),
    (5, "batch128", 128, 128, 128, 4, 128, 4),
    (6, "batch10000", 10000, 128, 128, 4, 128, 4),
    (7, "dmodel32", 64, 128, 32, 4, 32, 4),
    (8, "dmodel1024", 64, 128, 1024, 4, 1024, 4),
    (9, "heads1", 64, 128, 128, 1, 128, 4),
    (10, "heads2", 64, 128, 128, 2, 128, 4),
    (11, "heads16", 64, 128, 128, 16, 128, 4),
    (12, "seq32", 64, 32, 128, 4, 128, 4),
    (13, "seq1024", 64, 1024, 128, 4, 128, 4),
    (14, "seq100000", 32, 100000, 1024, 16, 1024, 2),
]

OFFICIAL: dict[int, Shape] = {
    n: Shape(n, name, LayerConfig(b, s, d, h, f, l, True))
    for n, name, b, s, d, h, f, l in _OFFICIAL_ROWS
}

# Fewer tokens, same d_model / heads / ffn / layers (so the same head dims), sized for a CPU.
_CI_SEQ = {32: 32, 128: 48, 1024: 80, 100000: 100}


def _ci_variant(shape: Shape) -> Shape:
    cfg = shape.config
    batch = 1 if cfg.batch_size == 1 else 2
    small = LayerConfig(batch, _CI_SEQ[cfg.seq_len], cfg.d_model, cfg.num_heads,
                        cfg.ffn_dim, cfg.num_layers, cfg.causal)
    return Shape(shape.number, shape.name, small, kind="ci")


CI: dict[int, Shape] = {n: _ci_variant(s) for n, s in OFFICIAL.items()}


def resolve_shapes(spec: str) -> list[Shape]:
    """Turn 'official', 'ci', or a comma list such as '1,8,ci3' into shapes."""
    spec = spec.strip().lower()
    if spec in ("official", "all"):
        return list(OFFICIAL.values())
    if spec == "ci":
        return list(CI.values())
    shapes = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        table = CI if token.startswith("ci") else OFFICIAL
        number = token[2:] if token.startswith("ci") else token
        if not number.isdigit() or int(number) not in table:
            raise ValueError(
                f"unknown shape {token!r}: use 'official', 'ci', numbers 1-14 or ci1-ci14"
            )
        shapes.append(table[int(number)])
    if not shapes:
        raise ValueError("no shapes selected")
    return shapes
