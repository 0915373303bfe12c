"""results/<gpu>/results.json: provenance plus one row per (backend, official shape)."""
from __future__ import annotations

import json
from pathlib import Path

from . import provenance
from .report import heatmap, markdown_table, rows_from_benchmark_json


def collect_results(conformance_log: Path, bench_json: Path, out_dir: Path,
                    provenance_json: Path | None = None) -> Path:
    """Merge conformance cases and benchmark rows of official shapes; write json, md and png.

    provenance_json is the file the GPU run wrote; without it, this machine's is collected.
    """
    cases: dict[tuple[str, int], list[dict]] = {}
    for line in conformance_log.read_text().splitlines():
        case = json.loads(line)
        if case.get("shape_kind", "official") == "official":
            cases.setdefault((case["backend"], case["shape"]), []).append(case)
    bench_data = json.loads(bench_json.read_text())
    bench = {(r["backend"], r["shape"]): r for r in rows_from_benchmark_json(bench_data)
             if r["shape_kind"] == "official"}
    rows = []
    for key in sorted(set(cases) | set(bench), key=lambda k: (k[1], k[0])):
        backend, shape = key
        runs, timed = cases.get(key, []), bench.get(key, {})
        rows.append({
            "backend": backend,
            "shape": shape,
            "passed": (all(c["passed"] for c in runs) if runs else timed.get("passed")),
            "bench_check_passed": timed.get("passed"),
            "failed_elements": sum(c["failed_elements"] for c in runs) if runs else None,
            "max_abs_error": max((c["max_abs_error"] for c in runs), default=timed.get(
                "max_abs_error")),
            "worst_ratio": max((c["worst_ratio"] for c in runs), default=None),
            "median_ms": timed.get("median_ms"),
            "events_median_ms": timed.get("events_median_ms"),
            "speedup": timed.get("speedup"),
            "benchmark_over_events": timed.get("benchmark_over_events"),
            "tflops": timed.get("tflops"),
            "fraction_of_fp16_floor": timed.get("fraction_of_fp16_floor"),
            "peak_memory_bytes": timed.get("peak_memory_bytes"),
            "cases": [{k: c[k] for k in ("dtype", "padding", "passed", "failed_elements",
                                         "total_elements", "max_abs_error", "worst_ratio",
                                         "oracle_sequences")} for c in runs],
        })
    out_dir.mkdir(parents=True, exist_ok=True)
    info = json.loads(provenance_json.read_text()) if provenance_json else provenance.collect()
    info["benchmark_machine_info"] = bench_data.get("machine_info", {}).get("cpu", {}).get(
        "brand_raw")
    (out_dir / "results.json").write_text(json.dumps({"provenance": info, "rows": rows},
                                                     indent=1) + "\n")
    timed_rows = [r for r in rows if r["median_ms"] is not None or r["passed"] is False]
    lines = [f"# Results on {info.get('gpu')}", "",
             f"commit `{info.get('commit')}`, driver {info.get('driver')}, "
             + ", ".join(f"{k} {v}" for k, v in info["versions"].items()) + f", {info['date']}",
             "", "Median latency per forward (speedup over torch-baseline in the same run).", "",
             markdown_table(timed_rows), "",
             "Conformance (all cases of each backend and shape, official contract):", "",
             "| backend | shape | passed | cases | max abs error | worst error/allowed |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        err = "-" if r["max_abs_error"] is None else f"{r['max_abs_error']:.2e}"
        ratio = "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2f}"
        lines.append(f"| {r['backend']} | {r['shape']} | {r['passed']} | {len(r['cases'])} | "
                     f"{err} | {ratio} |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    if timed_rows:
        heatmap(timed_rows, out_dir / "speedup.png")
    return out_dir
