"""results/<gpu>/results.json: provenance plus one row per (backend, official shape)."""
from __future__ import annotations

import json
from pathlib import Path

from . import provenance
from .report import heatmap, markdown_table, rows_from_benchmark_json, shape_span


def append_json_line(path, row: dict) -> None:
    """Append row to the file at path as one JSON line."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def add_best_peer(rows: list[dict]) -> list[dict]:
    """Give each row of one run best_peer and speedup_vs_best_peer: the ratio of the median of
    the fastest peer (PEERS) that passed the contract on that shape to the row's median.

    A peer is ranked against the other peers; rows without a median or passing peer get None.
    """
    from .registry import PEERS

    for row in rows:
        rivals = [r for r in rows if r["shape"] == row["shape"]
                  and r.get("shape_kind") == row.get("shape_kind") and r["backend"] in PEERS
                  and r["backend"] != row["backend"] and r.get("passed") and r.get("median_ms")]
        best = min(rivals, key=lambda r: r["median_ms"], default=None)
        row["best_peer"] = None if best is None else best["backend"]
        row["speedup_vs_best_peer"] = (best["median_ms"] / row["median_ms"]
                                       if best is not None and row.get("median_ms") else None)
    return rows


def _failed_cases(log: Path) -> dict[tuple[str, int], list[dict]]:
    """The failed cases of official shapes in a run's conformance log, by (backend, shape)."""
    if not log.is_file():
        return {}
    failed: dict[tuple[str, int], list[dict]] = {}
    for line in log.read_text().splitlines():
        case = json.loads(line)
        if case.get("shape_kind", "official") == "official" and not case["passed"]:
            failed.setdefault((case["backend"], case["shape"]), []).append(case)
    return failed


def run_rows(bench_rows: list[dict], failed: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """One run's official rows with the run's own verdicts, ranked against its passing peers.

    A row keeps its benchmark check in bench_check_passed; passed is False where any case of
    the run failed for that backend and shape (its conformance suite or any benchmark check),
    so such a time is marked FAIL, left out of geomeans and never used as the best peer. A
    backend whose benchmark check failed (not timed, absent from the benchmark file) gets a
    row without a median, so its cell reads FAIL rather than '-'.
    """
    rows = []
    for row in bench_rows:
        if row["shape_kind"] != "official":
            continue
        row = {**row, "bench_check_passed": row.get("passed")}
        if (row["backend"], row["shape"]) in failed:
            row["passed"] = False
        rows.append(row)
    timed = {(r["backend"], r["shape"]) for r in rows}
    for (backend, shape), cases in sorted(failed.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        checks = [c for c in cases if c.get("source") == "bench"]
        if (backend, shape) not in timed and checks:
            rows.append({"backend": backend, "shape": shape, "shape_kind": "official",
                         "padding": checks[0].get("padding", 0.0), "passed": False,
                         "bench_check_passed": False, "median_ms": None, "speedup": None})
    return add_best_peer(rows)


def raw_inputs(raw: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(conformance logs, benchmark files, provenance files) of a folder of kept runs.

    Loose *.jsonl files come first; then each run-*/ folder, ordered by its provenance date.
    """
    runs = sorted((d for d in raw.glob("run-*") if (d / "provenance.json").is_file()),
                  key=lambda d: json.loads((d / "provenance.json").read_text()).get("date", ""))
    conformance = sorted(raw.glob("*.jsonl")) + [d / "conformance.jsonl" for d in runs
                                                 if (d / "conformance.jsonl").is_file()]
    benched = [d for d in runs if (d / "bench.json").is_file()]
    return (conformance, [d / "bench.json" for d in benched],
            [d / "provenance.json" for d in benched])


def newest_section(rows: list[dict]) -> list[str]:
    """Markdown lines: the newest time of each kernel backend (not a peer) and shape, each from
    its own run, with the runs each backend's times come from; nothing if none was timed."""
    from .registry import PEERS

    newest = [{**r, "shape_kind": "official", "padding": r.get("bench_padding") or 0.0}
              for r in rows if r["median_ms"] is not None and r["backend"] not in PEERS]
    if not newest:
        return []
    runs: dict[str, dict[int, list[tuple[str, int]]]] = {}  # backend -> run -> shapes
    for r in sorted(newest, key=lambda r: r["shape"]):
        runs.setdefault(r["backend"], {}).setdefault(r["run"], []).append(("official", r["shape"]))
    sources = [f"`{backend}` " + ", ".join(
        f"run {run} (shape{'s' if len(keys) > 1 else ''} {shape_span(keys)})"
        for run, keys in sorted(by_run.items())) for backend, by_run in sorted(runs.items())]
    return ["", "Newest time of each kernel backend and shape, each from its own run, its "
            "speedups against that run's `torch-baseline` and fastest passing peer: "
            + "; ".join(sources) + ".", "", markdown_table(newest)]


def collect_results(conformance_logs: list[Path], bench_jsons: list[Path], out_dir: Path,
                    provenance_jsons: list[Path] | None = None) -> Path:
    """Merge conformance cases and benchmark rows of official shapes; write json, md and png.

    Several runs may be merged: a later conformance log or benchmark file replaces the earlier
    rows of the same backend and shape. Each run's table and best peers use that run's own
    verdicts (run_rows): a failed case in the run's conformance.jsonl marks the time FAIL.
    provenance_jsons pair with bench_jsons (the files the GPU runs wrote); without them, this
    machine's provenance is collected. Each row names its benchmark run in "run", an index
    into "runs", and each of its cases the log it came from.
    """
    cases: dict[tuple[str, int], dict[tuple, dict]] = {}
    for log in conformance_logs:
        for line in log.read_text().splitlines():
            case = {**json.loads(line), "log": f"{log.parent.name}/{log.name}"}
            if case.get("shape_kind", "official") == "official":
                # A benchmark's own check sits beside the suite's case of the same inputs.
                cases.setdefault((case["backend"], case["shape"]), {})[
                    (case["dtype"], case["padding"], case.get("source", "conformance"))] = case
    cases = {key: list(by_case.values()) for key, by_case in cases.items()}
    runs = [json.loads(p.read_text()) for p in provenance_jsons] if provenance_jsons else []
    if len(runs) < len(bench_jsons):
        runs += [provenance.collect()] * (len(bench_jsons) - len(runs))
    bench: dict[tuple[str, int], dict] = {}
    per_run: list[list[dict]] = []
    for index, path in enumerate(bench_jsons):
        failed = _failed_cases(path.parent / "conformance.jsonl")
        timed_here = run_rows(rows_from_benchmark_json(json.loads(path.read_text())), failed)
        # A backend this run checked and found wrong keeps no earlier run's time.
        for key in failed:
            bench.pop(key, None)
        baseline = {r["shape"]: r["median_ms"] for r in timed_here
                    if r["backend"] == "torch-baseline"}
        for row in timed_here:
            if row["median_ms"] is not None:
                bench[(row["backend"], row["shape"])] = {
                    **row, "run": index, "baseline_ms": baseline.get(row["shape"])}
        per_run.append(timed_here)
    rows = []
    for key in sorted(set(cases) | set(bench), key=lambda k: (k[1], k[0])):
        backend, shape = key
        checked, timed = cases.get(key, []), bench.get(key, {})
        rows.append({
            "backend": backend,
            "shape": shape,
            # False where the run that timed it had a failed case, even if a later log
            # passed the same case.
            "passed": (timed.get("passed") if not checked or timed.get("passed") is False
                       else all(c["passed"] for c in checked)),
            "bench_check_passed": timed.get("bench_check_passed"),
            "failed_elements": sum(c["failed_elements"] for c in checked) if checked else None,
            "max_abs_error": max((c["max_abs_error"] for c in checked), default=timed.get(
                "max_abs_error")),
            "worst_ratio": max((c["worst_ratio"] for c in checked), default=None),
            "median_ms": timed.get("median_ms"),
            "events_median_ms": timed.get("events_median_ms"),
            "speedup": timed.get("speedup"),
            "speedup_method": timed.get("speedup_method"),
            "speedup_vs_best_peer": timed.get("speedup_vs_best_peer"),
            "best_peer": timed.get("best_peer"),
            "baseline_ms": timed.get("baseline_ms"),
            "benchmark_over_events": timed.get("benchmark_over_events"),
            "tflops": timed.get("tflops"),
            "fraction_of_fp16_floor": timed.get("fraction_of_fp16_floor"),
            "peak_memory_bytes": timed.get("peak_memory_bytes"),
            "run": timed.get("run"),
            "bench_padding": timed.get("padding"),
            "bench_dtype": timed.get("dtype"),
            "bench_seed": timed.get("seed"),
            "cases": [{k: c.get(k) for k in ("dtype", "padding", "source", "passed",
                                             "failed_elements", "total_elements",
                                             "max_abs_error", "worst_ratio",
                                             "oracle_sequences", "seed", "log")}
                      for c in checked],
        })
    out_dir.mkdir(parents=True, exist_ok=True)
    info = runs[-1] if runs else provenance.collect()
    (out_dir / "results.json").write_text(json.dumps(
        {"provenance": info, "runs": runs, "rows": rows}, indent=1) + "\n")
    lines = [f"# Results on {info.get('gpu')}", ""]
    for index, run in enumerate(runs):
        names = (sorted({r["backend"] for r in per_run[index] if r["median_ms"] is not None})
                 if index < len(per_run) else [])
        lines.append(f"- run {index}: commit `{run.get('commit')}`, {run.get('date')}, driver "
                     f"{run.get('driver')}, " + ", ".join(f"{k} {v}" for k, v in
                                                         run["versions"].items())
                     + f"; timed here: {', '.join(names) or 'nothing'}")
    lines += newest_section(rows)
    for index, timed_here in enumerate(per_run):
        paddings = sorted({r["padding"] for r in timed_here if r["padding"]})
        padded = f", inputs padded at {', '.join(map(str, paddings))}" if paddings else ""
        lines += ["", f"Run {index}: median latency per forward (speedup over torch-baseline "
                  f"of the same run{padded}).", "", markdown_table(timed_here)]
    lines += ["", "Conformance (all cases of each backend and shape, official contract):", "",
             "| backend | shape | passed | cases | max abs error | worst error/allowed |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        err = "-" if r["max_abs_error"] is None else f"{r['max_abs_error']:.2e}"
        ratio = "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.2f}"
        lines.append(f"| {r['backend']} | {r['shape']} | {r['passed']} | {len(r['cases'])} | "
                     f"{err} | {ratio} |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    if per_run and per_run[-1]:
        # The newest time of each backend and shape, drawn only where its verdict passes.
        heatmap([{**r, "shape_kind": "official"} for r in rows if r["median_ms"] is not None],
                out_dir / "speedup.png",
                title="speedup over torch-baseline of the same run")
    return out_dir
