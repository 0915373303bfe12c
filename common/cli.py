"""The layerbench command: compare backends, list them, and turn runs into tables and plots."""
from __future__ import annotations

import argparse
import os
import json
import random
import sys
from pathlib import Path

import torch


def _device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def cmd_list(args) -> int:
    """Print every registered backend with its capabilities."""
    from .registry import list_backends

    for row in list_backends():
        if "error" in row:
            print(f"{row['name']:16s} cannot load: {row['error']}")
            continue
        print(f"{row['name']:16s} {row['summary']}")
        print(f"{'':16s} devices {row['devices']}, dtypes {row['dtypes']}, "
              f"head dims {row['head_dims']}, padding {row['padding']}"
              + (f"; {row['notes']}" if row["notes"] else ""))
    return 0


def compare_backends(backends: list[str], shapes, *, padding: float, seed: int, device,
                     rounds: int = 20, progress: bool = True) -> list[dict]:
    """Check then time every backend on every shape; rows with verdict, latency and speedup."""
    from tqdm import tqdm

    from . import runner
    from .errors import Unsupported
    from .registry import PEERS

    rows = []
    bar = tqdm(total=len(backends) * len(shapes), disable=not progress, unit="case",
               file=sys.stderr)
    for shape in shapes:
        prepared = runner.prepare(shape, padding=padding, dtype=torch.float32, seed=seed,
                                  device=device)
        reference = None
        try:
            baseline = runner.build(PEERS[0], prepared)
        except Unsupported:
            baseline = None
        for name in backends:
            bar.set_description(f"{shape.id} {name}")
            row = {"backend": name, "shape": shape.number, "shape_kind": shape.kind,
                   "verdict": "", "passed": None, "max_abs_error": None, "median_ms": None,
                   "speedup": None}
            try:
                layer = baseline if name == PEERS[0] and baseline else runner.build(name, prepared)
                report, reference = runner.check(layer, prepared, reference)
                row.update(passed=report.passed, max_abs_error=report.max_abs_error,
                           failed_elements=report.failed_elements,
                           verdict="PASS" if report.passed else
                           f"FAIL {report.failed_elements}/{report.total_elements}")
                if report.passed:
                    other = None if name == PEERS[0] else baseline
                    timing = runner.time_against_baseline(layer, prepared, other, rounds=rounds)
                    row["median_ms"] = timing.median_ms
                    row["speedup"] = 1.0 if name == PEERS[0] else timing.speedup
                    row.update(timing.extra)
            except Unsupported as exc:
                row["verdict"] = f"SKIP: {exc}"
            rows.append(row)
            bar.update()
        del prepared, baseline
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of compare rows."""
    from .runner import fmt_ms

    header = f"{'shape':>5}  {'backend':16s} {'max abs err':>11} {'median ms':>10} " \
             f"{'speedup':>8}  verdict"
    lines = [header, "-" * len(header)]
    for r in rows:
        err = "-" if r["max_abs_error"] is None else f"{r['max_abs_error']:.2e}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.3g}x"
        shape = ("ci" if r["shape_kind"] == "ci" else "") + str(r["shape"])
        lines.append(f"{shape:>5}  {r['backend']:16s} {err:>11} {fmt_ms(r['median_ms']):>10} "
                     f"{speed:>8}  {r['verdict'][:100]}")
    return "\n".join(lines)


def cmd_compare(args) -> int:
    """The main job: verdict, median latency and speedup per backend and shape."""
    from .registry import resolve_backends
    from .shapes import resolve_shapes

    device = _device(args.device)
    shapes = resolve_shapes(args.shapes or ("official" if device.type == "cuda" else "ci"))
    backends = resolve_backends(args.backends)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"layerbench compare: {len(backends)} backends x {len(shapes)} shapes on {device}, "
          f"padding {args.padding}, seed {seed}", file=sys.stderr)
    rows = compare_backends(backends, shapes, padding=args.padding, seed=seed, device=device,
                            rounds=args.rounds, progress=not args.no_progress)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "rows": rows}, indent=1))
    return 1 if any(r["passed"] is False for r in rows) else 0


def cmd_report(args) -> int:
    """Markdown table and PNG heatmap from a saved pytest-benchmark run."""
    from .report import heatmap, load_json, markdown_table, rows_from_benchmark_json

    path = Path(args.run) if args.run else _latest_saved_run()
    rows = rows_from_benchmark_json(load_json(path))
    if not rows:
        print(f"{path} holds no layerbench benchmarks", file=sys.stderr)
        return 1
    table = markdown_table(rows)
    print(table)
    out = Path(args.out or path.with_suffix(""))
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table)
    png = heatmap(rows, out / "speedup.png")
    print(f"wrote {out / 'table.md'} and {png}", file=sys.stderr)
    return 0


def _latest_saved_run() -> Path:
    runs = sorted(Path(".benchmarks").glob("*/*.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit("no saved run under .benchmarks/ (run pytest bench --benchmark-autosave)")
    return runs[-1]


def cmd_collect(args) -> int:
    """Merge a conformance log and a benchmark run into results.json, results.md, speedup.png."""
    from .results import collect_results, raw_inputs

    if args.raw:
        conformance, bench, prov = raw_inputs(Path(args.raw))
    elif args.conformance and args.bench:
        conformance = [Path(p) for p in args.conformance]
        bench = [Path(p) for p in args.bench]
        prov = [Path(p) for p in args.provenance] if args.provenance else None
    else:
        print("collect needs --raw, or --conformance and --bench", file=sys.stderr)
        return 2
    out = collect_results(conformance, bench, Path(args.out), prov)
    print(Path(out / "results.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the layerbench command."""
    if not torch.cuda.is_available():
        # No GPU: Triton kernels run in Triton's interpreter (set before triton is imported).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    parser = argparse.ArgumentParser(prog="layerbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="registered backends and what they support")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("compare", help="check and time backends per shape (the main job)")
    p.add_argument("--backends", nargs="+", default=["all"],
                   help="names, comma lists, 'all' or 'peers' (default all)")
    p.add_argument("--shapes", default=None,
                   help="'official', 'ci' or numbers like 1,8,13 (default: official on a GPU, "
                        "ci on a CPU)")
    p.add_argument("--padding", type=float, default=0.0, help="padding ratio (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: fresh, printed)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--rounds", type=int, default=20, help="timing rounds (default 20)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="markdown table and PNG heatmap of a saved benchmark run")
    p.add_argument("run", nargs="?", help="pytest-benchmark JSON (default: newest saved run)")
    p.add_argument("--out", default=None, help="folder for table.md and speedup.png")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("collect", help="write results/<gpu>/ from a conformance log and a "
                                       "benchmark run")
    p.add_argument("--raw", default=None,
                   help="folder of kept GPU runs (run-*/ with conformance.jsonl, bench.json, "
                        "provenance.json; loose *.jsonl conformance logs), merged oldest first")
    p.add_argument("--conformance", nargs="+",
                   help="JSON-lines files from --results-file (later ones win)")
    p.add_argument("--bench", nargs="+",
                   help="pytest-benchmark JSON files (later ones win)")
    p.add_argument("--out", required=True, help="folder, e.g. results/h200")
    p.add_argument("--provenance", default=None, nargs="+",
                   help="provenance JSON of each benchmark file, written on the GPU machine "
                        "(default: collect here)")
    p.set_defaults(func=cmd_collect)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
