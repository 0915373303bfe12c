"""Reading compiled GPU code: per kernel, registers, spills and the instructions that matter,
from `cuobjdump` (the CUDA toolkit's, else the one bundled with Triton)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from layerbench.common.cuda_host import cuda_tool as tool

# Each pattern starts with the opcode's first letters, so that a search can skip ahead to
# them; a match counts where no letter, digit or underscore comes right before it.
PATTERNS = {
    "HGMMA": r"HGMMA\.",
    "HMMA": r"HMMA\.",
    "LDSM": r"LDSM\.",
    "load128": r"(?:LDG\.E\.128|LDGSTS\.E\.BYPASS\.128|LDG\.E\.EL\.128)",
    "load16": r"LDG\.E\.(?:U16|S16)\b",
    "spill_stores": r"STL\b",
    "local_loads": r"LDL\b",
    "dependency_wait": r"ACQBULK\b",      # griddepcontrol.wait
    "dependents_launch": r"PREEXIT\b",    # griddepcontrol.launch_dependents
}
_COMPILED = {key: re.compile(pattern) for key, pattern in PATTERNS.items()}
# Opcodes that touch global memory (or generic addresses, which may be global).
GLOBAL_ACCESS_OPS = ("LDG", "STG", "LDGSTS", "ATOMG", "ATOM", "RED", "LD", "ST", "CCTL",
                     "UBLKCP", "UTMALDG", "UTMASTG")


def global_before_wait(body: str, allowed: tuple[str, ...] = ()) -> int:
    """Global (or generic) memory instructions of a SASS body before its first
    griddepcontrol.wait (ACQBULK), all of them where it has none; opcodes in allowed (e.g.
    LDGSTS, for weights copied before the wait) not counted."""
    ops = "|".join(op for op in GLOBAL_ACCESS_OPS if op not in allowed)
    access = re.compile(rf"\b(?:{ops})\b")
    count = 0
    for line in body.splitlines():
        if _COMPILED["dependency_wait"].search(line):
            return count
        count += bool(access.search(line))
    return count


def _run(*args: str) -> str:
    return subprocess.run([tool("cuobjdump"), *args], check=True, capture_output=True,
                          text=True).stdout


def count_words(pattern: re.Pattern, text: str) -> int:
    """Matches of pattern in text that begin a word (not right after a letter, digit or _)."""
    return sum(1 for m in pattern.finditer(text)
               if m.start() == 0 or not (text[m.start() - 1].isalnum()
                                         or text[m.start() - 1] == "_"))


def functions(path: str | Path) -> dict[str, str]:
    """Kernel name -> its SASS text, for every kernel of a cubin or object file."""
    parts = re.split(r"\n[ \t]*Function : (\S+)\n", "\n" + _run("-sass", str(path)))
    return dict(zip(parts[1::2], (body.rstrip("\n") for body in parts[2::2])))


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
        counts = {key: count_words(pattern, body) for key, pattern in _COMPILED.items()}
        found.setdefault(name, {}).update(counts)
    return found
