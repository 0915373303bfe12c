"""The 14 official shapes of docs/spec.md, their CPU-sized CI variants, their non-causal
variants, and small configs covering more head dims."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import LayerConfig

NONCAUSAL = "-noncausal"  # suffix of a non-causal variant's kind and id
_PREFIX = {"official": "s", "ci": "ci", "headdim": "hd"}


@dataclass(frozen=True)
class Shape:
    """One catalogued shape: its number, a short name, its config and its table.

    kind is 'official', 'ci' or 'headdim', with '-noncausal' appended for a non-causal
    variant (so results files never mix it with the causal shape of the same number).
    """

    number: int
    name: str
    config: LayerConfig
    kind: str = "official"

    @property
    def table(self) -> str:
        """The table the shape comes from: 'official', 'ci' or 'headdim'."""
        return self.kind.removesuffix(NONCAUSAL)

    @property
    def huge(self) -> bool:
        """Whether this is a huge official shape (14): float32 cases only, no determinism."""
        return self.table == "official" and self.number in HUGE_SHAPES

    @property
    def id(self) -> str:
        """A test id such as 's01-base', 'ci01-base', 's08-dmodel1024-noncausal' or 'hd24-d48h2'."""
        suffix = "" if self.config.causal else NONCAUSAL
        return f"{_PREFIX[self.table]}{self.number:02d}-{self.name}{suffix}"


def noncausal(shape: Shape) -> Shape:
    """The same shape with full (non-causal) attention."""
    if not shape.config.causal:
        return shape
    return Shape(shape.number, shape.name, replace(shape.config, causal=False),
                 shape.kind + NONCAUSAL)


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

# Official shapes that run float32 cases only and no determinism case.
HUGE_SHAPES = frozenset({14})

# Official shapes whose non-causal variants the GPU conformance run includes by default.
NONCAUSAL_OFFICIAL = (1, 8, 13)

# Fewer tokens, same d_model / heads / ffn / layers (so the same head dims), sized for a CPU.
_CI_SEQ = {32: 32, 128: 48, 1024: 80, 100000: 100}


def _ci_variant(shape: Shape) -> Shape:
    cfg = shape.config
    batch = 1 if cfg.batch_size == 1 else 2
    small = LayerConfig(batch, _CI_SEQ[cfg.seq_len], cfg.d_model, cfg.num_heads,
                        cfg.ffn_dim, cfg.num_layers, cfg.causal)
    return Shape(shape.number, shape.name, small, kind="ci")


CI: dict[int, Shape] = {n: _ci_variant(s) for n, s in OFFICIAL.items()}

# Head dims users run that the official shapes lack: 2 heads, d_model = ffn = 2 * head dim,
# 2 sequences of 40 tokens, 2 blocks. Numbered by head dim.
HEAD_DIMS = (24, 48, 80, 96, 112, 160, 192)
HEAD_DIM_SHAPES: dict[int, Shape] = {
    hd: Shape(hd, f"d{2 * hd}h2", LayerConfig(2, 40, 2 * hd, 2, 2 * hd, 2, True), kind="headdim")
    for hd in HEAD_DIMS
}

# Names that stand for several shapes.
GROUPS: dict[str, tuple[Shape, ...]] = {
    "official": tuple(OFFICIAL.values()),
    "all": tuple(OFFICIAL.values()),
    "ci": tuple(CI.values()),
    "noncausal": tuple(noncausal(OFFICIAL[n]) for n in NONCAUSAL_OFFICIAL),
    "ci-noncausal": tuple(noncausal(s) for s in CI.values()),
    "headdims": tuple(HEAD_DIM_SHAPES.values()),
}

SPEC_HELP = ("'official', 'ci', 'noncausal' (official 1, 8, 13 non-causal), 'ci-noncausal', "
             "'headdims', or a comma list of those and of single shapes: N (official, 1-14), "
             "ciN (CI variant), hdN (head dim N: " + ", ".join(map(str, HEAD_DIMS)) + "), "
             "each optionally prefixed by 'nc' for its non-causal variant (nc1, ncci3)")


def _single(token: str) -> Shape:
    """One shape token: N, ciN or hdN, optionally prefixed by 'nc'."""
    body = token[2:] if token.startswith("nc") else token
    table, number = OFFICIAL, body
    if body.startswith("ci"):
        table, number = CI, body[2:]
    elif body.startswith("hd"):
        table, number = HEAD_DIM_SHAPES, body[2:]
    if not number.isdigit() or int(number) not in table:
        raise ValueError(f"unknown shape {token!r}: use {SPEC_HELP}")
    shape = table[int(number)]
    return noncausal(shape) if token.startswith("nc") else shape


def resolve_shapes(spec: str) -> list[Shape]:
    """Turn a spec such as 'official', 'ci,ci-noncausal' or '1,8,ci3,nc13,hd48' into shapes."""
    shapes: list[Shape] = []
    for token in filter(None, (t.strip() for t in spec.strip().lower().split(","))):
        for shape in GROUPS.get(token) or (_single(token),):
            if shape not in shapes:
                shapes.append(shape)
    if not shapes:
        raise ValueError("no shapes selected")
    return shapes
