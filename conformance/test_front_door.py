"""What a new user meets first: the README's Python blocks and folder names, and the suites'
options, which are checked once at start."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_python_blocks_run(capsys):
    """Every ```python block of the README runs as written."""
    blocks = _python_blocks()
    assert blocks, "the README has no Python example"
    for number, code in enumerate(blocks, 1):
        exec(compile(code, f"README.md python block {number}", "exec"), {"__name__": "readme"})
    capsys.readouterr()


def test_readme_names_folders_that_exist():
    """Every backends/... folder the README names exists."""
    named = set(re.findall(r"`backends/(\w+)`", README))
    assert named and all((ROOT / "backends" / name).is_dir() for name in named), named


def _pytest(*options: str) -> subprocess.CompletedProcess:
    """pytest conformance with options, collecting only, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "pytest", "conformance", "--collect-only",
                           "-q", "-p", "no:cacheprovider", *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


BAD_OPTIONS = [
    (["--backend=no-such-backend"], "--backend: no backend named 'no-such-backend'; "
                                    "registered: torch-baseline"),
    (["--shapes", "99"], "--shapes: unknown shape '99'"),
    (["--padding", "1.5"], "--padding: padding ratio must be in [0, 1), got 1.5"),
    (["--seed=-1"], "--seed: seed must be non-negative, got -1"),
    pytest.param(["--device", "cuda"], "--device: 'cuda' needs a CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_option_is_one_usage_error(options, message):
    """A bad suite option stops pytest before collection: one ERROR line, exit code 4."""
    result = _pytest(*options)
    assert result.returncode == 4, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"ERROR: {message}"), lines
