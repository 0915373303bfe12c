"""Tables and heatmaps from benchmark runs and results files."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .shapes import NONCAUSAL

_PREFIX = {"official": "", "ci": "ci", "headdim": "hd"}  # as the --shapes option spells them
_TABLES = ("official", "ci", "headdim")


def rows_from_benchmark_json(data: dict) -> list[dict]:
    """One row per benchmark of a pytest-benchmark JSON file (saved or --benchmark-json)."""
    rows = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "backend" not in info:
            continue
        stats = bench.get("stats") or {}
        rows.append({
            "backend": info["backend"],
            "shape": info["shape"],
            "shape_kind": info.get("shape_kind", "official"),
            "padding": info.get("padding", 0.0),
            "dtype": info.get("dtype", "float32"),
            "seed": info.get("seed"),
            "passed": info.get("passed"),
            "max_abs_error": info.get("max_abs_error"),
            "median_ms": stats["median"] * 1e3 if "median" in stats else info.get(
                "events_median_ms"),
            "events_median_ms": info.get("events_median_ms"),
            "speedup": info.get("speedup"),
            "speedup_method": info.get("speedup_method"),
            "best_peer": info.get("best_peer"),
            "speedup_vs_best_peer": info.get("speedup_vs_best_peer"),
            "benchmark_over_events": info.get("benchmark_over_events"),
            "tflops": info.get("tflops"),
            "fraction_of_fp16_floor": info.get("fraction_of_fp16_floor"),
            "peak_memory_bytes": info.get("peak_memory_bytes"),
        })
    return rows


def shape_label(kind: str | None, number: int) -> str:
    """The shape as --shapes spells it: '8' (official), 'ci8', 'hd48', 'nc8' (non-causal)."""
    kind = kind or "official"
    table = kind.removesuffix(NONCAUSAL)
    return ("nc" if kind.endswith(NONCAUSAL) else "") + _PREFIX.get(table, table) + str(number)


def _shape_key(row: dict) -> tuple[str, int]:
    return row.get("shape_kind") or "official", row["shape"]


def _shape_sort(key: tuple[str, int]):
    kind, number = key
    table = kind.removesuffix(NONCAUSAL)
    rank = _TABLES.index(table) if table in _TABLES else len(_TABLES)
    return rank, table, kind.endswith(NONCAUSAL), number


def _order(rows: list[dict]) -> tuple[list[str], list[tuple[str, int]]]:
    from .registry import backend_names

    known = backend_names()
    backends = sorted({row["backend"] for row in rows},
                      key=lambda b: (known.index(b) if b in known else len(known), b))
    shapes = sorted({_shape_key(row) for row in rows}, key=_shape_sort)
    return backends, shapes


def _in_geomean(key: tuple[str, int]) -> bool:
    """Official shape 14 is left out of geomeans (torch-baseline cannot run it)."""
    kind, number = key
    return not (kind == "official" and number > 13)


def shape_span(keys: list[tuple[str, int]]) -> str:
    """Shape labels with runs of consecutive numbers joined: '1-13', 'ci1, ci8', 'ci2-ci4'."""
    parts = []
    for key in keys:
        if parts and parts[-1][0] == key[0] and parts[-1][2] == key[1] - 1:
            parts[-1][2] = key[1]
        else:
            parts.append([key[0], key[1], key[1]])
    text = []
    for kind, first, last in parts:
        lo, hi = shape_label(kind, first), shape_label(kind, last)
        text.append(lo if first == last else f"{lo}, {hi}" if last == first + 1 else f"{lo}-{hi}")
    return ", ".join(text)


def geomean(values) -> float | None:
    """Geometric mean of the positive values, or None if there are none."""
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fmt_speedup(value: float | None) -> str:
    """A speedup for tables: two decimals from 1x up, else three significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value >= 1 or value == 0:
        return f"{value:.2f}x"
    return f"{value:#.3g}x"


def fmt_latency(ms: float) -> str:
    """A latency with its unit: '0.250 ms', '20.4 ms', '3.59 s'."""
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1e3:.2f} s"


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("median_ms") is None:
        return "FAIL" if row.get("passed") is False else "-"
    text = fmt_latency(row["median_ms"])
    if row.get("speedup") is not None:
        text += f" ({fmt_speedup(row['speedup'])})"
    return text + (", FAIL" if row.get("passed") is False else "")


def _peer_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("passed") is False:
        return "FAIL"
    if row.get("speedup_vs_best_peer") is None:
        return "-"
    peer = f" ({row['best_peer']})" if row.get("best_peer") else ""
    return fmt_speedup(row["speedup_vs_best_peer"]) + peer


def _grid_table(rows: list[dict], cell, key: str, footer: str) -> list[str]:
    backends, shapes = _order(rows)
    index = {(r["backend"], _shape_key(r)): r for r in rows}
    lines = ["| shape | " + " | ".join(backends) + " |",
             "|---|" + "---|" * len(backends)]
    for shape in shapes:
        cells = [cell(index.get((b, shape))) for b in backends]
        lines.append(f"| {shape_label(*shape)} | " + " | ".join(cells) + " |")
    counted = [s for s in shapes if _in_geomean(s)]
    means = []
    for b in backends:
        # A shape without a passing value (failed, not timed, no passing peer) is left out of
        # this column's geomean, and the cell names it: the footer's span covers every column.
        used = [s for s in counted if (b, s) in index
                and index[(b, s)].get("passed") is not False
                and (index[(b, s)].get(key) or 0) > 0]
        g = geomean(index[(b, s)][key] for s in used)
        text = "-" if g is None else fmt_speedup(g)
        if g is not None and len(used) < len(counted):
            missing = [s for s in counted if s not in used]
            text += (f" ({len(used)} shape{'s' if len(used) > 1 else ''}, "
                     f"not {shape_span(missing)})")
        means.append(text)
    lines.append(f"| {footer}, shapes {shape_span(counted) or '-'} | " + " | ".join(means) + " |")
    return lines


def has_best_peer(rows: list[dict]) -> bool:
    """Whether any row carries a speedup over the fastest peer."""
    return any(r.get("speedup_vs_best_peer") is not None for r in rows)


def markdown_table(rows: list[dict], best_peer: bool = True) -> str:
    """Shapes down, backends across: 'median (speedup over torch-baseline)', geomeans last.

    When rows carry speedup_vs_best_peer (and best_peer is true) a second table follows:
    the speedup over the fastest peer that passed the contract on the shape, that peer named.
    """
    methods = sorted({r["speedup_method"] for r in rows if r.get("speedup_method")})
    lines = ([f"Speedup over torch-baseline from {' and '.join(methods)}.", ""]
             if methods else [])
    lines += _grid_table(rows, _cell, "speedup", "geomean speedup")
    if best_peer and has_best_peer(rows):
        lines += ["", "Speedup over the fastest peer that passed the contract on the shape in "
                  "the same run (the peer in brackets):", ""]
        lines += _grid_table(rows, _peer_cell, "speedup_vs_best_peer", "geomean vs best peer")
    return "\n".join(lines) + "\n"


def _log_ticks(vmin: float, vmax: float) -> list[float]:
    """Colour-bar ticks: the powers of ten in range, with 2 and 5 between them if fewer than 3."""
    exponents = range(math.floor(math.log10(vmin)), math.ceil(math.log10(vmax)) + 1)
    lo, hi = vmin * (1 - 1e-9), vmax * (1 + 1e-9)
    ticks = [10.0 ** e for e in exponents if lo <= 10.0 ** e <= hi]
    if len(ticks) < 3:
        ticks = sorted(m * 10.0 ** e for e in exponents for m in (1, 2, 5)
                       if lo <= m * 10.0 ** e <= hi)
    return ticks


def _panel(fig, ax, rows, backends, shapes, key, title, with_peer):
    """Draw one heatmap of rows[key] (log colour scale) with its colour bar."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    index = {(r["backend"], _shape_key(r)): r for r in rows}
    grid = np.full((len(backends), len(shapes)), np.nan)
    for i, b in enumerate(backends):
        for j, s in enumerate(shapes):
            row = index.get((b, s))
            if row and row.get(key) and row.get("passed") is not False:
                grid[i, j] = row[key]
    finite = np.abs(np.log10(grid[np.isfinite(grid)]))
    bound = max(1.0, float(finite.max())) if finite.size else 1.0
    norm = LogNorm(vmin=10 ** -bound, vmax=10 ** bound)
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    for i, b in enumerate(backends):
        for j, s in enumerate(shapes):
            row = index.get((b, s))
            value = grid[i, j]
            if row and row.get("passed") is False:
                text, colour = "fail", "black"
            elif np.isnan(value):
                text, colour = "-", "black"
            else:
                text = fmt_speedup(float(value))
                if with_peer and row.get("best_peer"):
                    text += "\n" + row["best_peer"]
                colour = text_colour(cmap(norm(value)))
            ax.text(j, i, text, ha="center", va="center", color=colour,
                    fontsize=6.5 if with_peer else 8)
    ax.set_xticks(range(len(shapes)), [shape_label(*s) for s in shapes])
    ax.set_yticks(range(len(backends)), backends)
    ax.set_xlabel("shape")
    ax.set_title(title, fontsize=10)
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("speedup (log scale)", fontsize=8)
    bar.ax.yaxis.set_major_locator(FixedLocator(_log_ticks(norm.vmin, norm.vmax)))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    bar.ax.yaxis.set_minor_locator(NullLocator())
    bar.ax.tick_params(labelsize=7)


def text_colour(rgba) -> str:
    """'white' on a dark cell colour, 'black' on a light one."""
    r, g, b = rgba[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


def heatmap_figure(rows: list[dict], title: str = "speedup over torch-baseline",
                   best_peer: bool = True):
    """A matplotlib figure of speedup heatmaps, backend x shape, sized to hold its titles.

    When rows carry speedup_vs_best_peer (and best_peer is true) a second heatmap below shows
    the speedup over the fastest peer that passed on each shape, naming that peer.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends, shapes = _order(rows)
    panels = [("speedup", title, False)]
    if best_peer and has_best_peer(rows):
        panels.append(("speedup_vs_best_peer",
                       "speedup over the fastest peer that passed (peer named)", True))
    labels = 0.3 + 0.08 * max(len(b) for b in backends)  # backend names, inches
    bar = 1.3  # colour bar with its ticks and label, inches
    cells = max(0.8 * len(shapes), 0.085 * max(len(t) for _, t, _ in panels))
    heights = [0.45 * len(backends) * (1.5 if peer else 1.0) + 1.0 for _, _, peer in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(labels + cells + bar, sum(heights)),
                             height_ratios=heights, squeeze=False)
    for ax, (key, text, peer) in zip(axes[:, 0], panels):
        _panel(fig, ax, rows, backends, shapes, key, text, peer)
    fig.tight_layout()
    return fig


def heatmap(rows: list[dict], path: str | Path, title: str = "speedup over torch-baseline",
            best_peer: bool = True) -> Path:
    """Write a PNG heatmap of speedup, backend x shape (grey where no number exists), with a
    second one of the speedup over the fastest peer when rows carry it."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(rows, title, best_peer)
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    return path


def load_json(path: str | Path) -> dict:
    """Read a JSON file."""
    return json.loads(Path(path).read_text())
