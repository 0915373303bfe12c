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


def test_no_kernel_has_a_problem(sass_rows):
    """No kernel spills registers or uses local memory, lacks HMMA where it multiplies, or
    (a forward kernel) touches global memory before waiting for the kernel before it
    (wmma_sass.problems)."""
    offenders = [row["kernel"] for row in sass_rows if wmma_sass.problems(row)]
    assert not offenders, offenders


def test_forward_kernels_wait_for_the_kernel_before_them(sass_rows):
    """Every forward kernel waits for the kernel before it (griddepcontrol.wait: ACQBULK)
    before any global memory access and lets the next one launch (PREEXIT), as programmatic
    dependent launches need; the probe and ceiling kernels, launched on their own, do not.
    The GEMM and ffn_block kernels copy weights (LDGSTS) before the wait, and only those;
    the others copy nothing before it."""
    forward = [row for row in sass_rows if row["forward"]]
    assert forward and len(forward) < len(sass_rows)
    for row in forward:
        assert row["dependency_wait"] >= 1 and row["dependents_launch"] >= 1, row["kernel"]
        assert row["global_before_wait"] == 0, row["kernel"]
        assert (row["copies_before_wait"] > 0) == row["weights_first"], row["kernel"]
    assert {row["kernel"].split("<")[0] for row in forward if row["weights_first"]} == set(
        wmma_sass.WEIGHTS_FIRST_KERNELS)
    for row in sass_rows:
        if not row["forward"]:
            assert row["dependency_wait"] == 0, row["kernel"]


def test_tiled_gemms_copy_only_weights_before_the_wait(sass_rows):
    """A tiled GEMM copies exactly its first STAGES - 1 stages of weights before the wait:
    16-byte vectors per thread BN / (threads / (BK / 8)) per part, one part (two with three
    products), so no copy of the rows (which the kernel before writes) comes first."""
    tiled = [row for row in sass_rows if row["kernel"].startswith("linear_tiled<")]
    assert tiled
    for row in tiled:
        bm, bn, warps_m, warps_n, bk, stages, products = (
            int(v) for v in row["kernel"].split("<")[1].split(",")[:7])
        rows_per_pass = warps_m * warps_n * 32 // (bk // 8)
        parts = 2 if products == 3 else 1
        assert row["copies_before_wait"] == (stages - 1) * (bn // rows_per_pass) * parts, row


def test_stream_gemms_and_ffn_block_copy_only_weights_before_the_wait(sass_rows):
    """The stream GEMMs copy the same number of vectors before the wait whatever their tile,
    warps, stages or epilogue (the weight slice's loop), twice that with three products (its
    lo part); ffn_block as many with one product as with two (which copies the context's lo
    part too): a copy of the rows before the wait would vary with them."""
    def counts(prefix, key):
        found = {}
        for row in sass_rows:
            if row["kernel"].startswith(prefix):
                found.setdefault(key(row["kernel"]), set()).add(row["copies_before_wait"])
        return found
    stream = counts("linear_stream<", lambda k: int(k.split("<")[1].split(",")[5]) == 3)
    assert len(stream[False]) == len(stream[True]) == 1, stream
    assert stream[True] == {2 * next(iter(stream[False]))}
    ffn = counts("ffn_block_kernel<", lambda k: "ffn")
    assert len(ffn["ffn"]) == 1 and ffn["ffn"] != {0}, ffn


def test_global_accesses_before_the_wait_are_counted():
    """global_before_wait (bench/sass.py) counts global and generic accesses (not shared
    ones) up to the first ACQBULK, all of them in a body without one, and not the allowed
    opcodes."""
    from sass import global_before_wait

    body = ("  /*0010*/  LDS R2, [R3] ;\n  /*0020*/  @P0 LDG.E R4, desc[UR4][R6.64] ;\n"
            "  /*0030*/  ACQBULK ;\n  /*0040*/  STG.E [R6.64], R4 ;\n")
    assert global_before_wait(body) == 1
    assert global_before_wait(body.replace("ACQBULK", "NOP")) == 2
    copy = body.replace("@P0 LDG.E R4,", "LDGSTS.E.BYPASS.128 [R4],")
    assert global_before_wait(copy) == 1 and global_before_wait(copy, ("LDGSTS",)) == 0
