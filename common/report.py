"""Tables and heatmaps from benchmark runs and results files."""
from __future__ import annotations

import json
import math
from pathlib import Path


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
            "passed": info.get("passed"),
            "max_abs_error": info.get("max_abs_error"),
            "median_ms": stats["median"] * 1e3 if "median" in stats else info.get(
                "events_median_ms"),
            "events_median_ms": info.get("events_median_ms"),
            "speedup": info.get("speedup"),
            "benchmark_over_events": info.get("benchmark_over_events"),
            "tflops": info.get("tflops"),
            "fraction_of_fp16_floor": info.get("fraction_of_fp16_floor"),
            "peak_memory_bytes": info.get("peak_memory_bytes"),
        })
    return rows


def _order(rows: list[dict]) -> tuple[list[str], list[int]]:
    from .registry import backend_names

    known = backend_names()
    backends = sorted({row["backend"] for row in rows},
                      key=lambda b: (known.index(b) if b in known else len(known), b))
    shapes = sorted({row["shape"] for row in rows})
    return backends, shapes


def geomean(values) -> float | None:
    """Geometric mean of the positive values, or None if there are none."""
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("passed") is False:
        return "FAIL"
    if row.get("median_ms") is None:
        return "-"
    ms = row["median_ms"]
    text = f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1e3:.2f} s"
    if row.get("speedup") is not None:
        text += f" ({row['speedup']:.2f}x)"
    return text


def markdown_table(rows: list[dict]) -> str:
    """Shapes down, backends across: 'median (speedup over torch-baseline)', geomeans last."""
    backends, shapes = _order(rows)
    index = {(r["backend"], r["shape"]): r for r in rows}
    lines = ["| shape | " + " | ".join(backends) + " |",
             "|---|" + "---|" * len(backends)]
    for shape in shapes:
        cells = [_cell(index.get((b, shape))) for b in backends]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    means = []
    for b in backends:
        g = geomean(index[(b, s)].get("speedup") for s in shapes if s <= 13 and (b, s) in index)
        means.append("-" if g is None else f"{g:.2f}x")
    lines.append("| geomean speedup, shapes 1-13 | " + " | ".join(means) + " |")
    return "\n".join(lines) + "\n"


def heatmap(rows: list[dict], path: str | Path, title: str = "speedup over torch-baseline"
            ) -> Path:
    """Write a PNG heatmap of speedup, backend x shape (grey where no number exists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    backends, shapes = _order(rows)
    index = {(r["backend"], r["shape"]): r for r in rows}
    grid = np.full((len(backends), len(shapes)), np.nan)
    for i, b in enumerate(backends):
        for j, s in enumerate(shapes):
            row = index.get((b, s))
            if row and row.get("speedup") and row.get("passed") is not False:
                grid[i, j] = row["speedup"]
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(shapes), 1.2 + 0.55 * len(backends)))
    logs = np.log10(grid)
    finite = logs[np.isfinite(logs)]
    bound = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")
    ax.imshow(np.ma.masked_invalid(logs), cmap=cmap, vmin=-bound, vmax=bound, aspect="auto")
    for i in range(len(backends)):
        for j in range(len(shapes)):
            row = index.get((backends[i], shapes[j]))
            text = "fail" if row and row.get("passed") is False else (
                "-" if np.isnan(grid[i, j]) else f"{grid[i, j]:.1f}")
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(shapes)), [str(s) for s in shapes])
    ax.set_yticks(range(len(backends)), backends)
    ax.set_xlabel("shape")
    ax.set_title(title + " (log colour scale)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_json(path: str | Path) -> dict:
    """Read a JSON file."""
    return json.loads(Path(path).read_text())
