"""Summarise Nsight Compute's per-instruction source page of one kernel (`ncu --import REPORT
--page source --csv --print-source sass`, as `NCU_SOURCE=1 bash bench/gpu_run.sh ncu` writes to
ncu-source.csv): warp instructions executed, the stall reasons' shares of all stall samples,
the most sampled SASS instructions with their main stall reason, and, where the page has the
memory columns, shared-memory wavefronts and global sectors against their ideal per opcode
(bank conflicts, uncoalesced accesses) with the instructions of the most excess.

    python bench/ncu_source.py out/gpu/ncu-source.csv --top 40 > ncu-source.txt
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# (name, actual, ideal) column triples of the memory table: excess = actual - ideal.
MEMORY = (("shared wavefronts", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"),
          ("global sectors", "L2 Theoretical Sectors Global",
           "L2 Theoretical Sectors Global Ideal"))


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
    return "\n".join(lines + memory_lines(rows, top)) + "\n"


def opcode(source: str) -> str:
    """The opcode of a SASS line with its modifiers, without a predicate ('@!P0 LDS R1, [R2]'
    gives 'LDS')."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].rstrip(",") if words else "-"


def memory_lines(rows: list[dict[str, str]], top: int) -> list[str]:
    """Per memory column pair the page has: actual and ideal totals per opcode, then the top
    instructions by excess (actual - ideal); nothing where the page lacks the columns."""
    lines = []
    for name, actual, ideal in MEMORY:
        if not rows or actual not in rows[0] or ideal not in rows[0]:
            continue
        per_op: dict[str, list[float]] = {}
        for r in rows:
            if _number(r[actual]):
                totals = per_op.setdefault(opcode(r["Source"]), [0.0, 0.0, 0])
                totals[0] += _number(r[actual])
                totals[1] += _number(r[ideal])
                totals[2] += 1
        if not per_op:
            continue
        all_actual = sum(t[0] for t in per_op.values())
        all_ideal = sum(t[1] for t in per_op.values())
        lines += ["", f"{name.capitalize()} per opcode (actual, ideal, actual/ideal, "
                      f"instructions): all {all_actual:.0f} against {all_ideal:.0f}"]
        for op, (a, i, n) in sorted(per_op.items(), key=lambda item: -item[1][0]):
            lines.append(f"  {op:36s} {a:13.0f} {i:13.0f} {a / i if i else float('inf'):6.2f}"
                         f" {n:4d}")
        excess = [r for r in rows if _number(r[actual]) > _number(r[ideal])]
        excess.sort(key=lambda r: _number(r[ideal]) - _number(r[actual]))
        if excess:
            lines.append(f"  most {name} over the ideal (address, SASS, actual, ideal):")
            for r in excess[:top]:
                lines.append(f"  {r['Address'][-5:]}  {r['Source'][:64]:64s} "
                             f"{_number(r[actual]):11.0f} {_number(r[ideal]):11.0f}")
    return lines


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
