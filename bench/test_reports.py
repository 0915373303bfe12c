"""The report and results tooling, on a small synthetic run (no timing involved)."""
from __future__ import annotations

import json

from layerbench.common.cli import main as cli_main
from layerbench.common.report import (fmt_speedup, heatmap, heatmap_figure, markdown_table,
                                      rows_from_benchmark_json, shape_label, text_colour)
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
    """layerbench report turns a saved run into table.md and speedup.png, with the speedup
    over the fastest peer of the run."""
    run = tmp_path / "0001_run.json"
    run.write_text(json.dumps(_bench_json(MEDIANS)))
    assert cli_main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "triton" in out
    assert "| 1 | - | 8.00x (torch-baseline) |" in out  # ranked against the peers of the run
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


def test_results_md_opens_with_each_backends_newest_times(tmp_path):
    """results.md shows, before the runs, each kernel backend's newest time per shape from
    whichever run timed it last (peers left out), and names those runs."""
    raw = tmp_path / "raw"
    runs = (("run-a", "2026-01-01", {("torch-baseline", 1): 2.0, ("triton", 1): 1.0,
                                     ("torch-baseline", 13): 20.0, ("triton", 13): 4.0}),
            ("run-b", "2026-02-01", {("torch-baseline", 1): 4.0, ("triton", 1): 0.5}))
    for name, date, medians in runs:
        run = raw / name
        run.mkdir(parents=True)
        run.joinpath("bench.json").write_text(json.dumps(_bench_json(medians)))
        run.joinpath("conformance.jsonl").write_text("")
        run.joinpath("provenance.json").write_text(json.dumps(
            {"commit": name, "date": date, "driver": "1", "gpu": "G", "versions": {}}))
    assert cli_main(["collect", "--raw", str(raw), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "results.md").read_text()
    newest = text[text.index("Newest time"):text.index("Run 0:")]
    assert "`triton` run 0 (shape 13), run 1 (shape 1)" in newest
    assert "| shape | triton |" in newest and "torch-baseline |" not in newest
    assert "| 1 | 0.500 ms (8.00x) |" in newest and "| 13 | 4.000 ms (5.00x) |" in newest


def _ci_rows(best_peer: bool = False) -> list[dict]:
    """Rows of a CPU run on CI shapes 1 and 8; triton far slower (the interpreter)."""
    data = _bench_json({("torch-baseline", 1): 1.5, ("torch-sdpa", 1): 0.9, ("triton", 1): 1200.0,
                        ("torch-baseline", 8): 40.0, ("torch-sdpa", 8): 30.0,
                        ("triton", 8): 25000.0})
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        info["shape_kind"] = "ci"
        if best_peer:
            peer = "torch-baseline" if info["backend"] == "torch-sdpa" else "torch-sdpa"
            peer_ms = {"torch-baseline": {1: 1.5, 8: 40.0}, "torch-sdpa": {1: 0.9, 8: 30.0}}
            info["best_peer"] = peer
            info["speedup_vs_best_peer"] = (peer_ms[peer][info["shape"]]
                                            / (bench["stats"]["median"] * 1e3))
    return rows_from_benchmark_json(data)


def test_ci_shapes_are_labelled_and_small_speedups_keep_digits():
    """CI shapes read ci1/ci8, the geomean names them, and 0.00125x keeps 3 significant digits."""
    table = markdown_table(_ci_rows())
    assert "| ci1 | 1.500 ms (1.00x) | 0.900 ms (1.67x) | 1.20 s (0.00125x) |" in table
    assert "| ci8 |" in table and "| 1 |" not in table
    footer = table.splitlines()[-1]
    assert footer.startswith("| geomean speedup, shapes ci1, ci8 |")
    assert "0.00x" not in table and "1-13" not in table
    assert fmt_speedup(0.001234) == "0.00123x" and fmt_speedup(21.584) == "21.58x"
    assert fmt_speedup(0.5) == "0.500x" and fmt_speedup(None) == "-"


def test_official_footer_and_labels():
    """Official shapes keep their plain numbers and the footer says shapes 1-13."""
    medians = {(b, s): ms * s for s in range(1, 15) for b, ms in (("torch-baseline", 2.0),
                                                                   ("triton", 0.5))}
    table = markdown_table(rows_from_benchmark_json(_bench_json(medians)))
    assert "| 14 |" in table
    assert table.splitlines()[-1].startswith("| geomean speedup, shapes 1-13 |")
    assert shape_label("ci", 3) == "ci3" and shape_label("official-noncausal", 8) == "nc8"


def test_best_peer_table_when_rows_carry_it():
    """Rows with speedup_vs_best_peer get a second table naming the peer; others do not."""
    assert "fastest peer" not in markdown_table(_ci_rows())
    table = markdown_table(_ci_rows(best_peer=True))
    assert "fastest peer" in table
    assert "| ci1 | 0.600x (torch-sdpa) | 1.67x (torch-baseline) | 0.000750x (torch-sdpa) |" \
        in table
    assert "geomean vs best peer, shapes ci1, ci8" in table


def test_heatmap_fits_its_title_and_has_colour_bars(tmp_path):
    """With two shapes the title lies inside the figure; each panel has a colour bar; cell
    labels are white on dark cells and black on light ones."""
    import matplotlib.pyplot as plt

    for best_peer, panels in ((False, 1), (True, 2)):
        title = "speedup over torch-baseline of the same run"
        fig = heatmap_figure(_ci_rows(best_peer), title)
        try:
            assert len(fig.axes) == 2 * panels  # a heatmap and its colour bar per panel
            renderer = fig.canvas.get_renderer()
            width = fig.bbox.width
            heat = fig.axes[0]
            box = heat.title.get_window_extent(renderer)
            assert heat.get_title() == title and box.x0 >= 0 and box.x1 <= width
            colours = {t.get_text().split("\n")[0]: t.get_color() for t in heat.texts}
            assert colours["0.00125x"] == "white"  # deep red
            assert colours["1.00x"] == "black"  # pale yellow
        finally:
            plt.close(fig)
    assert text_colour((0.0, 0.3, 0.1, 1.0)) == "white"
    assert text_colour((0.9, 0.9, 0.6, 1.0)) == "black"
    png = heatmap(_ci_rows(True), tmp_path / "speedup.png")
    assert png.stat().st_size > 1000


def _kept_run(raw, name: str, medians: dict, cases: list[dict], date: str = "2026-01-01"):
    """A run-*/ folder of collect --raw: bench.json, conformance.jsonl and provenance.json."""
    run = raw / name
    run.mkdir(parents=True)
    run.joinpath("bench.json").write_text(json.dumps(_bench_json(medians)))
    run.joinpath("conformance.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    run.joinpath("provenance.json").write_text(json.dumps(
        {"commit": name, "date": date, "driver": "1", "gpu": "G", "versions": {}}))


def _case(backend: str, shape: int, passed: bool, source: str = "conformance",
          dtype: str = "float32", padding: float = 0.0) -> dict:
    return {"backend": backend, "shape": shape, "shape_kind": "official", "dtype": dtype,
            "padding": padding, "source": source, "passed": passed,
            "failed_elements": 0 if passed else 1, "total_elements": 10,
            "max_abs_error": 1e-3, "worst_ratio": 0.5 if passed else 1.1,
            "oracle_sequences": None}


def test_run_failures_mark_times_and_leave_peers_out(tmp_path):
    """A failed case of the run that timed a row marks its time FAIL in that run's table and
    in results.json, keeps it out of geomeans, and a peer that failed any case of the shape
    in that run is not the best peer; an untimed peer whose benchmark check failed reads FAIL."""
    raw = tmp_path / "raw"
    medians = {("torch-baseline", 1): 2.0, ("torch-fp16", 1): 0.5, ("triton", 1): 0.25,
               ("torch-baseline", 2): 4.0, ("triton", 2): 1.0}
    cases = [
        # torch-fp16 passed the benchmark's check on shape 1 but failed a conformance case.
        _case("torch-fp16", 1, True, source="bench"),
        _case("torch-fp16", 1, False, padding=0.25),
        # torch-fp16 missed the benchmark's check on shape 2, so it was not timed there.
        _case("torch-fp16", 2, False, source="bench"),
        # triton failed one check of shape 2 and passed the same check later in the run.
        _case("triton", 2, False, source="bench"),
        _case("triton", 2, True, source="bench"),
    ]
    _kept_run(raw, "run-a", medians, cases)
    assert cli_main(["collect", "--raw", str(raw), "--out", str(tmp_path / "out")]) == 0
    rows = {(r["backend"], r["shape"]): r
            for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    fp16, triton1, triton2 = rows[("torch-fp16", 1)], rows[("triton", 1)], rows[("triton", 2)]
    assert fp16["passed"] is False and fp16["bench_check_passed"] is True
    assert triton1["best_peer"] == "torch-baseline" and triton1["speedup_vs_best_peer"] == 8.0
    assert triton2["passed"] is False and triton2["bench_check_passed"] is True
    text = (tmp_path / "out" / "results.md").read_text()
    run = text[text.index("Run 0:"):text.index("Conformance (")]
    assert "| 1 | 2.000 ms (1.00x) | 0.500 ms (4.00x), FAIL | 0.250 ms (8.00x) |" in run
    assert "| 2 | 4.000 ms (1.00x) | FAIL | 1.000 ms (4.00x), FAIL |" in run
    assert "| 1 | - | FAIL | 8.00x (torch-baseline) |" in run
    assert "| geomean speedup, shapes 1, 2 | 1.00x | - | 8.00x (1 shape, not 2) |" in run
    assert "timed here: torch-baseline, torch-fp16, triton" in text


def test_geomeans_name_the_shapes_they_leave_out():
    """A shape without a passing peer (or a failed row) is left out of that column's geomean,
    and the footer cell says which shapes it leaves out."""
    medians = {(b, s): ms for s in (1, 6, 13) for b, ms in (("torch-baseline", 2.0),
                                                            ("triton", 0.5))}
    rows = rows_from_benchmark_json(_bench_json(medians))
    for row in rows:
        if row["backend"] == "triton":
            row["best_peer"] = None if row["shape"] == 6 else "torch-baseline"
            row["speedup_vs_best_peer"] = None if row["shape"] == 6 else 4.0
        if row["backend"] == "torch-baseline" and row["shape"] == 13:
            row["passed"] = False
    lines = markdown_table(rows).splitlines()
    assert lines[-1] == ("| geomean vs best peer, shapes 1, 6, 13 | - | "
                         "4.00x (2 shapes, not 6) |")
    speed = next(line for line in lines if line.startswith("| geomean speedup"))
    assert speed == "| geomean speedup, shapes 1, 6, 13 | 1.00x (2 shapes, not 13) | 4.00x |"


def test_results_keep_the_speedup_method_and_inputs(tmp_path):
    """results.json rows say how their speedup was taken and on which inputs, and the newest
    times' table says it too; each case names the log it came from."""
    data = _bench_json(MEDIANS)
    for bench in data["benchmarks"]:
        bench["extra_info"].update(speedup_method="alternating CUDA events", seed=7,
                                   dtype="float32")
    raw = tmp_path / "raw"
    _kept_run(raw, "run-a", MEDIANS, [_case("triton", 1, True, source="bench")])
    (raw / "run-a" / "bench.json").write_text(json.dumps(data))
    assert cli_main(["collect", "--raw", str(raw), "--out", str(tmp_path / "out")]) == 0
    rows = {(r["backend"], r["shape"]): r
            for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    row = rows[("triton", 1)]
    assert row["speedup_method"] == "alternating CUDA events"
    assert row["bench_seed"] == 7 and row["bench_dtype"] == "float32"
    assert row["cases"][0]["log"] == "run-a/conformance.jsonl"
    text = (tmp_path / "out" / "results.md").read_text()
    newest = text[text.index("Newest time"):text.index("Run 0:")]
    assert "Speedup over torch-baseline from alternating CUDA events." in newest
