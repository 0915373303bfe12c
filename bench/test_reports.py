"""The report and results tooling, on a small synthetic run (no timing involved)."""
from __future__ import annotations

import json

from layerbench.common.cli import main as cli_main
from layerbench.common.report import markdown_table, rows_from_benchmark_json
from layerbench.common.results import collect_results


def _bench_json(medians: dict[tuple[str, int], float]) -> dict:
    benchmarks = []
    for (backend, shape), ms in medians.items():
        base = medians[("torch-baseline", shape)]
        benchmarks.append({
            "name": f"test_forward[s{shape:02d}-{backend}]",
            "stats": {"median": ms / 1e3},
            "extra_info": {"backend": backend, "shape": shape, "shape_kind": "official",
                           "passed": True, "max_abs_error": 1e-3, "speedup": base / ms,
                           "events_median_ms": ms, "tflops": 1.0,
                           "fraction_of_fp16_floor": 0.001, "peak_memory_bytes": 1 << 20},
        })
    return {"benchmarks": benchmarks}


MEDIANS = {("torch-baseline", 1): 2.0, ("triton", 1): 0.25, ("torch-baseline", 13): 20.0,
           ("triton", 13): 2.5}


def test_markdown_table_ranks_and_geomeans():
    """The table shows median and speedup per cell and the geomean over shapes 1-13."""
    table = markdown_table(rows_from_benchmark_json(_bench_json(MEDIANS)))
    assert "| 1 | 2.000 ms (1.00x) | 0.250 ms (8.00x) |" in table
    assert "8.00x |" in table.splitlines()[-1]


def test_collect_writes_results_with_provenance(tmp_path):
    """collect merges conformance cases and timings into results.json, results.md and a PNG."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_bench_json(MEDIANS)))
    log = tmp_path / "conformance.jsonl"
    case = {"backend": "triton", "shape": 1, "shape_kind": "official", "dtype": "float32",
            "padding": 0.0, "passed": False, "failed_elements": 3, "total_elements": 10,
            "max_abs_error": 0.01, "worst_ratio": 5.0, "oracle_sequences": None}
    log.write_text(json.dumps(case) + "\n")
    prov = tmp_path / "prov.json"
    prov.write_text(json.dumps({"commit": "abc", "date": "today", "driver": "1", "gpu": "G",
                                "versions": {"torch": "x"}}))
    out = collect_results([log], [bench], tmp_path / "out", [prov])
    data = json.loads((out / "results.json").read_text())
    assert data["provenance"]["commit"] == "abc"
    rows = {(r["backend"], r["shape"]): r for r in data["rows"]}
    assert rows[("triton", 1)]["passed"] is False and rows[("triton", 1)]["failed_elements"] == 3
    assert rows[("triton", 13)]["speedup"] == 8.0 and rows[("triton", 13)]["baseline_ms"] == 20.0
    for key in ("backend", "shape", "passed", "failed_elements", "max_abs_error", "median_ms",
                "speedup"):
        assert key in rows[("torch-baseline", 1)]
    assert (out / "speedup.png").stat().st_size > 1000
    assert "commit `abc`" in (out / "results.md").read_text()


def test_padded_run_is_labelled(tmp_path):
    """Rows keep the benchmark's padding ratio, and results.md says a run was padded."""
    data = _bench_json(MEDIANS)
    for bench in data["benchmarks"]:
        bench["extra_info"]["padding"] = 0.25
    assert {r["padding"] for r in rows_from_benchmark_json(data)} == {0.25}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(data))
    prov = tmp_path / "prov.json"
    prov.write_text(json.dumps({"commit": "abc", "date": "today", "driver": "1", "gpu": "G",
                                "versions": {"torch": "x"}}))
    out = collect_results([], [bench], tmp_path / "out", [prov])
    assert "inputs padded at 0.25" in (out / "results.md").read_text()
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["bench_padding"] for r in rows} == {0.25}


def test_report_command(tmp_path, capsys):
    """layerbench report turns a saved run into table.md and speedup.png."""
    run = tmp_path / "0001_run.json"
    run.write_text(json.dumps(_bench_json(MEDIANS)))
    assert cli_main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "triton" in capsys.readouterr().out
    assert (tmp_path / "rep" / "speedup.png").exists()


def test_collect_from_kept_runs_orders_them_by_date(tmp_path):
    """collect --raw merges run-*/ folders oldest first, so the newer run's rows win."""
    raw = tmp_path / "raw"
    for name, date, triton_ms in (("run-new", "2026-02-01", 0.5), ("run-old", "2026-01-01", 1.0)):
        run = raw / name
        run.mkdir(parents=True)
        run.joinpath("bench.json").write_text(json.dumps(_bench_json(
            {("torch-baseline", 1): 2.0, ("triton", 1): triton_ms})))
        run.joinpath("conformance.jsonl").write_text("")
        run.joinpath("provenance.json").write_text(json.dumps(
            {"commit": name, "date": date, "driver": "1", "gpu": "G", "versions": {}}))
    assert cli_main(["collect", "--raw", str(raw), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["commit"] for r in data["runs"]] == ["run-old", "run-new"]
    rows = {(r["backend"], r["shape"]): r for r in data["rows"]}
    assert rows[("triton", 1)]["median_ms"] == 0.5 and rows[("triton", 1)]["run"] == 1
