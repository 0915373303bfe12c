"""The wmma kernels compiled for sm_90 without a GPU: HMMA where they multiply, no local memory."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from layerbench.backends.wmma import build

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wmma_sass  # noqa: E402


@pytest.fixture(scope="module")
def sass_rows(wmma_objects):
    """Rows of bench/wmma_sass.py for sm_90 (every kernel of every .cu source), from the
    compile test's objects where that test ran first in the session."""
    if build.nvcc_path() is None:
        pytest.skip(build.toolkit_missing())
    try:
        return wmma_sass.rows("90", wmma_objects)
    except FileNotFoundError as exc:
        pytest.skip(f"cuobjdump is not available ({exc})")


def test_every_source_has_kernels(sass_rows):
    """Each .cu source yields kernels (the report reads what it compiles)."""
    sources = {row["source"] for row in sass_rows}
    assert sources == {s for s in build.SOURCES if s.endswith(".cu")}


def test_tensor_core_kernels_issue_hmma(sass_rows):
    """GEMM, attention and fused-block kernels multiply with HMMA and load fragments by LDSM."""
    for row in sass_rows:
        if row["needs_mma"]:
            assert row["HMMA"] > 0 and row["LDSM"] > 0, row["kernel"]


def test_no_local_memory(sass_rows):
    """No kernel spills registers or uses local memory."""
    offenders = [row["kernel"] for row in sass_rows if wmma_sass.problems(row)]
    assert not offenders, offenders
