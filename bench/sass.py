"""Reading compiled GPU code: per kernel, registers, spills and the instructions that matter,
from `cuobjdump` (the CUDA toolkit's, else the one bundled with Triton)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from layerbench.common.cuda_host import cuda_tool as tool

PATTERNS = {
    "HGMMA": r"\bHGMMA\.",
    "HMMA": r"\bHMMA\.",
    "LDSM": r"\bLDSM\.",
    "load128": r"\b(LDG\.E\.128|LDGSTS\.E\.BYPASS\.128|LDG\.E\.EL\.128)",
    "load16": r"\bLDG\.E\.(U16|S16)\b",
    "spill_stores": r"\bSTL\b",
    "local_loads": r"\bLDL\b",
    "dependency_wait": r"\bACQBULK\b",      # griddepcontrol.wait
    "dependents_launch": r"\bPREEXIT\b",    # griddepcontrol.launch_dependents
}


def _run(*args: str) -> str:
    return subprocess.run([tool("cuobjdump"), *args], check=True, capture_output=True,
                          text=True).stdout


def functions(path: str | Path) -> dict[str, str]:
    """Kernel name -> its SASS text, for every kernel of a cubin or object file."""
    return dict(re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)",
                           _run("-sass", str(path)), flags=re.S))


def kernels(path: str | Path, bodies: dict[str, str] | None = None) -> dict[str, dict]:
    """Kernel name -> registers, stack_bytes (stack + local), shared_bytes (static) and the
    counts of PATTERNS in its SASS, for every kernel of a cubin or object file (bodies: its
    functions(path), where already read)."""
    usage = _run("-res-usage", str(path))
    found: dict[str, dict] = {}
    for name, fields in re.findall(r"Function (\S+):\s*\n\s*(.*)", usage):
        value = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", fields)}
        found[name] = {"registers": value.get("REG", 0),
                       "stack_bytes": value.get("STACK", 0) + value.get("LOCAL", 0),
                       "shared_bytes": value.get("SHARED", 0)}
    for name, body in (functions(path) if bodies is None else bodies).items():
        counts = {key: len(re.findall(pattern, body)) for key, pattern in PATTERNS.items()}
        found.setdefault(name, {}).update(counts)
    return found
