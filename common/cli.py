"""The layerbench command: compare backends, list them, and turn runs into tables and plots."""
from __future__ import annotations

import argparse
import os
import json
import random
import sys
from pathlib import Path

import torch


class UsageError(ValueError):
    """A bad command-line value; the command prints it argparse-style and exits 2."""


def check_device(name: str | None) -> torch.device:
    """The device --device names (default: cuda if present, else cpu); ValueError if unusable."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use 'cuda' or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name!r} needs a CUDA device, and this machine has none "
                             "(use 'cpu')")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name!r}: this machine has {torch.cuda.device_count()} CUDA "
                             "devices")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported: use 'cuda' or 'cpu'")
    return device


def check_padding(ratio: float) -> float:
    """ratio itself if it is a padding ratio in [0, 1), else ValueError."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"padding ratio must be in [0, 1), got {ratio:g}")
    return ratio


def check_seed(seed: int | None) -> int | None:
    """seed itself if it is None or non-negative, else ValueError."""
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return seed


def check_backends(spec) -> list[str]:
    """Backend names of a --backend(s) spec; ValueError naming the registered backends."""
    from .registry import resolve_backends

    try:
        return resolve_backends(spec)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def check_shapes(spec: str):
    """Shapes of a --shapes spec; ValueError (from resolve_shapes) if it names none."""
    from .shapes import resolve_shapes

    return resolve_shapes(spec)


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
                     rounds: int = 20, progress: bool = True, on_row=None) -> list[dict]:
    """Check then time every backend on every shape; rows with verdict, latency and speedups.

    The peers run first in each shape, so each row's speedup over the fastest peer is known
    once the peers are done; on_row(row) is called as soon as a row is final.
    """
    from tqdm import tqdm

    from . import runner
    from .errors import Unsupported
    from .registry import PEERS, peers_first
    from .results import add_best_peer

    baseline_name = PEERS[0]
    backends = peers_first(backends)
    peers_run = [name for name in backends if name in PEERS]
    rows = []
    bar = tqdm(total=len(backends) * len(shapes), disable=not progress, unit="case",
               file=sys.stderr)
    for shape in shapes:
        prepared = runner.prepare(shape, padding=padding, dtype=torch.float32, seed=seed,
                                  device=device)
        reference = None
        try:
            baseline = runner.build(baseline_name, prepared)
        except Unsupported:
            baseline = None
        shape_rows, waiting = [], []
        for name in backends:
            bar.set_description(f"{shape.id} {name}")
            row = {"backend": name, "shape": shape.number, "shape_kind": shape.kind,
                   "verdict": "", "passed": None, "max_abs_error": None, "median_ms": None,
                   "speedup": None, "best_peer": None, "speedup_vs_best_peer": None}
            try:
                layer = (baseline if name == baseline_name and baseline
                         else runner.build(name, prepared))
                report, reference = runner.check(layer, prepared, reference)
                row.update(passed=report.passed, max_abs_error=report.max_abs_error,
                           failed_elements=report.failed_elements,
                           verdict="PASS" if report.passed else
                           f"FAIL {report.failed_elements}/{report.total_elements}")
                if report.passed or name == baseline_name:  # the denominator is timed anyway
                    other = None if name == baseline_name else baseline
                    timing = runner.time_against_baseline(layer, prepared, other, rounds=rounds)
                    row["median_ms"] = timing.median_ms
                    row["speedup"] = 1.0 if name == baseline_name else timing.speedup
                    row.update(timing.extra)
            except Unsupported as exc:
                row["verdict"] = f"SKIP: {exc}"
            rows.append(row)
            shape_rows.append(row)
            bar.update()
            waiting.append(row)
            if name in PEERS and name != peers_run[-1]:
                continue  # its speedup over the other peers waits for the last peer
            add_best_peer(shape_rows)
            for done in waiting:
                if on_row:
                    on_row(done)
            waiting = []
        del prepared, baseline
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return rows


def format_header() -> str:
    """The header lines of the compare table."""
    from .registry import PEERS

    header = (f"{'shape':>6}  {'backend':16s} {'max abs err':>11} {'median ms':>10} "
              f"{'vs ' + PEERS[0]:>18}  {'vs best peer':24s} verdict")
    return header + "\n" + "-" * len(header)


def format_row(r: dict) -> str:
    """One line of the compare table."""
    from .report import fmt_speedup, shape_label
    from .runner import fmt_ms

    err = "-" if r["max_abs_error"] is None else f"{r['max_abs_error']:.2e}"
    peer = "-"
    if r.get("speedup_vs_best_peer") is not None:
        peer = f"{fmt_speedup(r['speedup_vs_best_peer'])} {r['best_peer']}"
    return (f"{shape_label(r['shape_kind'], r['shape']):>6}  {r['backend']:16s} {err:>11} "
            f"{fmt_ms(r['median_ms']):>10} {fmt_speedup(r['speedup']):>18}  {peer:24s} "
            f"{r['verdict'][:100]}")


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of compare rows."""
    return "\n".join([format_header()] + [format_row(r) for r in rows])


def _checked(option: str, check, value):
    """check(value), a ValueError turned into a UsageError naming option."""
    try:
        return check(value)
    except ValueError as exc:
        raise UsageError(f"argument {option}: {exc}") from None


def checked_or_exit(parser, option: str, check, value):
    """check(value), or the parser's usage error naming option (exit 2): for scripts."""
    try:
        return _checked(option, check, value)
    except UsageError as exc:
        parser.error(str(exc))


def cmd_compare(args) -> int:
    """The main job: verdict, median latency and speedups per backend and shape."""
    from tqdm import tqdm

    device = _checked("--device", check_device, args.device)
    shapes = _checked("--shapes", check_shapes,
                      args.shapes or ("official" if device.type == "cuda" else "ci"))
    backends = _checked("--backends", check_backends, args.backends)
    _checked("--padding", check_padding, args.padding)
    _checked("--seed", check_seed, args.seed)
    if args.rounds < 1:
        raise UsageError(f"argument --rounds: must be at least 1, got {args.rounds}")
    official = [s.table == "official" for s in shapes]
    if device.type == "cpu" and any(official) and not args.allow_slow:
        raise UsageError(
            "argument --shapes: official shapes on a CPU run full-size layers (Triton in its "
            "interpreter) and take hours; use CI shapes (ci, ci1, ...: the CPU default) or "
            "pass --allow-slow")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    what = "official" if all(official) else \
        "CI" if all(s.kind == "ci" for s in shapes) else "selected"
    default = "" if args.shapes else (" (the default on a GPU)" if device.type == "cuda"
                                      else " (the default without a GPU)")
    print(f"layerbench compare: {len(backends)} backends x {len(shapes)} {what} shapes"
          f"{default} on {device}, padding {args.padding}, seed {seed}", file=sys.stderr)

    def show(line: str) -> None:
        """Print line to stdout above the progress bar, at once."""
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    show(format_header())
    rows = compare_backends(backends, shapes, padding=args.padding, seed=seed, device=device,
                            rounds=args.rounds, progress=not args.no_progress,
                            on_row=lambda row: show(format_row(row)))
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "rows": rows}, indent=1))
    return 1 if any(r["passed"] is False for r in rows) else 0


def cmd_report(args) -> int:
    """Markdown table and PNG heatmap from a saved pytest-benchmark run."""
    from .report import heatmap, load_json, markdown_table, rows_from_benchmark_json
    from .results import add_best_peer

    path = Path(args.run) if args.run else _latest_saved_run()
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    rows = add_best_peer(rows_from_benchmark_json(load_json(path)))
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
        raise UsageError("collect needs --raw, or --conformance and --bench")
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
    p.set_defaults(func=cmd_list, parser=p)

    p = sub.add_parser(
        "compare",
        help="check and time backends per shape (the main job; without a GPU: CI shapes)",
        description="Check every backend against the strict-fp32 truth, then time it, per "
                    "shape. Without a GPU it runs on the CPU with the CI shapes (few tokens "
                    "each; Triton in its interpreter) and refuses the official shapes unless "
                    "--allow-slow is given. Rows print as each finishes.")
    p.add_argument("--backends", nargs="+", default=["all"],
                   help="names, comma lists, 'all' or 'peers' (default all)")
    p.add_argument("--shapes", default=None,
                   help="'official', 'ci' or a list such as 1,8,ci3 (default: official on a "
                        "GPU, ci on a CPU)")
    p.add_argument("--allow-slow", action="store_true",
                   help="run official shapes on a CPU (full size, through Triton's "
                        "interpreter: hours)")
    p.add_argument("--padding", type=float, default=0.0, help="padding ratio in [0, 1) "
                                                              "(default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed (default: fresh, printed)")
    p.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda if present, else cpu)")
    p.add_argument("--rounds", type=int, default=20, help="timing rounds (default 20)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compare, parser=p)

    p = sub.add_parser("report", help="markdown table and PNG heatmap of a saved benchmark run")
    p.add_argument("run", nargs="?", help="pytest-benchmark JSON (default: newest saved run)")
    p.add_argument("--out", default=None, help="folder for table.md and speedup.png")
    p.set_defaults(func=cmd_report, parser=p)

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
    p.set_defaults(func=cmd_collect, parser=p)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        args.parser.error(str(exc))  # prints usage and the message, exits 2
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
