"""bench/ncu_source.py on a small source page written as ncu writes it."""
from __future__ import annotations

import pytest

from bench.ncu_source import read_source, summarise

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_wait","stall_barrier (Not Issued)"')


def _page(tmp_path, rows: list[str]):
    path = tmp_path / "ncu-source.csv"
    path.write_text('"Kernel Name","void k(int)",\n' + HEADER + "\n" + "\n".join(rows) + "\n")
    return path


def test_summary_shares_and_order(tmp_path):
    """Shares are of all samples, thousands separators are read, and the most sampled
    instruction comes first with its main stall reason."""
    path = _page(tmp_path, ['"0x10","FFMA R1, R2, R3, R4","10","1,000","2","8","1"',
                            '"0x20","BAR.SYNC 0x0","30","500","27","3","5"'])
    kernel, rows = read_source(path)
    assert kernel == "void k(int)" and len(rows) == 2
    text = summarise(path, top=2)
    assert "warp instructions executed: 1500; stall samples: 40" in text
    assert "stall_barrier                     29  72.5%" in text
    assert "stall_wait                        11  27.5%" in text
    listed = text.split("main stall):\n")[1].splitlines()
    assert "BAR.SYNC" in listed[0] and listed[0].endswith("stall_barrier")
    assert "FFMA" in listed[1] and listed[1].endswith("stall_wait")


def test_refuses_other_files(tmp_path):
    """A CSV that is not an ncu source page is refused with the reason."""
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu source page"):
        read_source(path)
    path.write_text('"Kernel Name","k",\n"Address","Source"\n')
    with pytest.raises(ValueError, match="no 'Warp Stall Sampling"):
        read_source(path)
