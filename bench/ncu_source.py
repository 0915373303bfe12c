"""Summarise Nsight Compute's per-instruction source page of one kernel (`ncu --import REPORT
--page source --csv --print-source sass`, as `NCU_SOURCE=1 bash bench/gpu_run.sh ncu` writes to
ncu-source.csv): warp instructions executed, the stall reasons' shares of all stall samples,
and the most sampled SASS instructions with their main stall reason.

    python bench/ncu_source.py out/gpu/ncu-source.csv --top 40 > ncu-source.txt
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    """A cell as a number (ncu writes thousands separators; empty cells are 0)."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source(path: str | Path) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, one dict a SASS instruction) from the CSV: its first row names the
    kernel, its second holds the column names."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source page (its first row names no kernel)")
    header = rows[1]
    for column in ("Address", "Source", SAMPLES, EXECUTED):
        if column not in header:
            raise ValueError(f"{path}: no {column!r} column")
    return rows[0][1], [dict(zip(header, row)) for row in rows[2:] if row]


def summarise(path: str | Path, top: int = 40) -> str:
    """The summary text of the source page at path."""
    kernel, rows = read_source(path)
    columns = rows[0].keys() if rows else ()
    stalls = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    samples = sum(_number(r[SAMPLES]) for r in rows)
    executed = sum(_number(r[EXECUTED]) for r in rows)
    lines = [f"kernel: {kernel}",
             f"SASS instructions: {len(rows)}; warp instructions executed: {executed:.0f}; "
             f"stall samples: {samples:.0f}", "", "Stall reasons (share of all samples):"]
    totals = {c: sum(_number(r[c]) for r in rows) for c in stalls}
    for column, total in sorted(totals.items(), key=lambda item: -item[1]):
        if total:
            lines.append(f"  {column:28s} {total:7.0f} {100 * total / max(samples, 1):5.1f}%")
    lines += ["", f"The {top} instructions with the most samples (address, SASS, samples, warp "
              "instructions executed, main stall):"]
    for r in sorted(rows, key=lambda r: -_number(r[SAMPLES]))[:top]:
        main = max(stalls, key=lambda c: _number(r[c])) if stalls else "-"
        lines.append(f"  {r['Address'][-5:]}  {r['Source'][:64]:64s} {_number(r[SAMPLES]):6.0f} "
                     f"{_number(r[EXECUTED]):9.0f}  {main}")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="the source page as CSV")
    parser.add_argument("--top", type=int, default=40, help="instructions listed")
    args = parser.parse_args()
    try:
        sys.stdout.write(summarise(args.csv, args.top))
    except (OSError, ValueError) as exc:
        print(f"ncu_source: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
