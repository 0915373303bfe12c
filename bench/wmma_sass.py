"""The wmma kernels compiled for sm_90 without a GPU: per kernel, registers, spills and
tensor-core instructions of its SASS.

Each .cu source of backends/wmma is compiled by the command the run-time build uses
(backends/wmma/build.py nvcc_command), then read with cuobjdump (bench/sass.py):

    python bench/wmma_sass.py [--arch 90] [--json rows.json]

wmma lowers to mma.sync, so the kernels show HMMA (not Hopper's HGMMA) and load fragments
with LDSM; none may use local memory.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass import functions, global_before_wait, kernels  # noqa: E402

from layerbench.backends.wmma import build  # noqa: E402

# Sources whose every kernel multiplies on the tensor cores (norm.cu has none).
TENSOR_CORE_SOURCES = ("linear.cu", "linear_two_products.cu", "linear_three_products.cu",
                       "attention.cu", "block.cu", "peak.cu")
# Kernels outside the forward (launched on their own, never as programmatic dependents).
STANDALONE_KERNELS = ("attention_layout_probe_kernel", "mma_peak_kernel")
# Forward kernels that copy weights to shared memory (LDGSTS) before the wait.
WEIGHTS_FIRST_KERNELS = ("linear_tiled", "linear_stream", "ffn_block_kernel")


def short_name(mangled: str) -> str:
    """The kernel's demangled name without namespaces and parameters (c++filt), e.g.
    'attention_kernel<64>'; the mangled name where c++filt is missing."""
    try:
        name = subprocess.run(["c++filt", mangled], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return mangled
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = name[:name.rfind("(")] if name.endswith(")") else name
    return re.sub(r"\b\w+::", "", name)


def rows(arch: str = "90", objects: Path | None = None) -> list[dict]:
    """One row per kernel of every .cu source; objects: a folder of '<source>-sm<arch>.o'
    files compiled by the same command (the strict compile test's) to read instead."""
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in (s for s in build.SOURCES if s.endswith(".cu")):
            obj = Path(objects or tmp) / f"{source}-sm{arch}.o"
            if objects is None or not obj.exists():
                obj = Path(tmp) / obj.name
                subprocess.run(build.nvcc_command(build.SOURCE_DIR / source, arch, obj),
                               check=True, capture_output=True, text=True)
            bodies = functions(obj)
            for name, info in sorted(kernels(obj, bodies).items()):
                kernel = short_name(name)
                body = bodies.get(name, "")
                weights_first = kernel.startswith(WEIGHTS_FIRST_KERNELS)
                found.append({"source": source, "kernel": kernel, "mangled": name, "arch": arch,
                              "needs_mma": source in TENSOR_CORE_SOURCES,
                              "forward": not kernel.startswith(STANDALONE_KERNELS),
                              "weights_first": weights_first,
                              "copies_before_wait": global_before_wait(body) - global_before_wait(
                                  body, ("LDGSTS",)),
                              "global_before_wait": global_before_wait(
                                  body, ("LDGSTS",) if weights_first else ()),
                              **info})
    return found


def problems(row: dict) -> list[str]:
    """What a kernel lacks: no local memory, HMMA where it multiplies, and (sm_90 forward
    kernels) the wait for the kernel before it ahead of any global memory access but the
    weight copies (LDGSTS) of WEIGHTS_FIRST_KERNELS."""
    found = []
    if row["stack_bytes"] or row["spill_stores"] or row["local_loads"]:
        found.append(f"local memory: {row['stack_bytes']} bytes, {row['spill_stores']} STL, "
                     f"{row['local_loads']} LDL")
    if row["needs_mma"] and not row["HMMA"]:
        found.append("no HMMA")
    if row.get("arch") == "90" and row["forward"]:
        if not row["dependency_wait"] or not row["dependents_launch"]:
            found.append("no griddepcontrol wait or launch_dependents")
        elif row["global_before_wait"]:
            found.append(f"{row['global_before_wait']} global accesses before the wait")
    return found


def main() -> int:
    """Print the table; with --check, exit 1 when a kernel has a problem."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="90")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    print("| source | kernel | registers | stack bytes | HMMA | LDSM | problems |")
    print("|---|---|---|---|---|---|---|")
    table = rows(args.arch)
    failed = False
    for row in table:
        found = problems(row)
        failed |= bool(found)
        print(f"| {row['source']} | {row['kernel']} | {row['registers']} | "
              f"{row['stack_bytes']} | {row['HMMA']} | {row['LDSM']} | "
              f"{'; '.join(found) or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
