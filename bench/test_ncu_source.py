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


def test_memory_table_per_opcode(tmp_path):
    """Shared wavefronts and global sectors are summed per opcode (predicates dropped),
    with the instructions over their ideal listed by excess."""
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
              '"L1 Wavefronts Shared","L1 Wavefronts Shared Ideal",'
              '"L2 Theoretical Sectors Global","L2 Theoretical Sectors Global Ideal"')
    rows = ['"0x10","LDS.128 R4, [R2]","1","10","80","40","0","0"',
            '"0x20","@!P0 LDS.128 R8, [R2+0x10]","1","10","40","40","0","0"',
            '"0x30","STG.E.128 [R6], R4","1","10","0","0","96","64"',
            '"0x40","FFMA R1, R2, R3, R4","1","10","0","0","0","0"']
    path = tmp_path / "ncu-source.csv"
    path.write_text('"Kernel Name","void k(int)",\n' + header + "\n" + "\n".join(rows) + "\n")
    text = summarise(path, top=5)
    shared = text.split("Shared wavefronts per opcode")[1]
    assert "all 120 against 80" in shared
    assert "LDS.128" in shared.splitlines()[1] and "1.50" in shared.splitlines()[1]
    over = shared.split("over the ideal")[1].split("Global sectors")[0].strip().splitlines()[1:]
    assert len(over) == 1 and over[0].split()[:2] == ["0x10", "LDS.128"]
    assert "all 96 against 64" in text.split("Global sectors per opcode")[1]
    assert "FFMA" not in text.split("Shared wavefronts per opcode")[1]


def test_no_memory_table_without_its_columns(tmp_path):
    """A page without the memory columns gets no memory table."""
    path = _page(tmp_path, ['"0x10","FFMA R1, R2, R3, R4","10","1,000","2","8","1"'])
    assert "per opcode" not in summarise(path)
