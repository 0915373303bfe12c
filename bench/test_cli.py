"""The layerbench command's front door: argument errors, the CPU default, streamed rows with
speedups over torch-baseline and the best peer, and the GPU scripts on a machine without CUDA."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from layerbench.common import runner
from layerbench.common.cli import compare_backends, main as cli_main
from layerbench.common.registry import PEERS
from layerbench.common.shapes import resolve_shapes

ROOT = Path(__file__).resolve().parent.parent
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.parametrize("argv, message", [
    (["--backends", "tritn"], "argument --backends: no backend named 'tritn'; registered: "),
    (["--shapes", "99"], "argument --shapes: unknown shape '99'"),
    (["--padding", "1.5"], "argument --padding: padding ratio must be in [0, 1), got 1.5"),
    (["--seed", "-1"], "argument --seed: seed must be non-negative"),
    (["--device", "tpu"], "argument --device: unknown device 'tpu'"),
])
def test_bad_arguments_exit_2_with_one_message(argv, message, capsys):
    """A bad value prints argparse's usage and one error line, exit code 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"layerbench compare: error: {message}" in err and "Traceback" not in err


@no_cuda
def test_device_cuda_without_cuda(capsys):
    """--device cuda on a machine without CUDA says it needs a CUDA device (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_official_shapes_on_a_cpu_need_allow_slow(capsys):
    """Official shapes on the CPU are refused, with why, unless --allow-slow is given."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--device", "cpu", "--shapes", "official"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "official shapes on a CPU" in err and "--allow-slow" in err
    assert "ci on a CPU" in cli_main_help(capsys)


def cli_main_help(capsys) -> str:
    """The compare command's --help text."""
    with pytest.raises(SystemExit):
        cli_main(["compare", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_compare_streams_rows_with_both_speedups(tmp_path, monkeypatch, capsys):
    """Rows reach the screen shape by shape (before the next shape is prepared), with the
    speedup over torch-baseline and over the best peer, named."""
    prepared_shapes = []
    prepare = runner.prepare

    def recording_prepare(shape, **kw):
        prepared_shapes.append(shape.id)
        return prepare(shape, **kw)

    monkeypatch.setattr(runner, "prepare", recording_prepare)
    shapes = resolve_shapes("ci2,ci7")
    emitted = []
    rows = compare_backends(["torch-sdpa", "torch-baseline"], shapes, padding=0.0, seed=0,
                            device=torch.device("cpu"), rounds=3, progress=False,
                            on_row=lambda row: emitted.append((row, list(prepared_shapes))))
    assert [r for r, _ in emitted] == rows
    in_peer_order = sorted(["torch-sdpa", "torch-baseline"], key=PEERS.index)
    assert [r["backend"] for r in rows] == in_peer_order * 2
    assert all(seen == [shapes[0].id] for row, seen in emitted if row["shape"] == 2)
    for index, row in enumerate(rows):
        assert row["passed"] and row["speedup"] > 0
        other = rows[index ^ 1]  # the other peer on the same shape
        assert row["best_peer"] == other["backend"]
        assert row["speedup_vs_best_peer"] == pytest.approx(other["median_ms"] / row["median_ms"])

    out = tmp_path / "rows.json"
    code = cli_main(["compare", "--device", "cpu", "--shapes", "ci2", "--backends",
                     "torch-baseline,torch-sdpa", "--rounds", "3", "--no-progress",
                     "--seed", "0", "--json", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"vs {PEERS[0]}" in lines[0] and "vs best peer" in lines[0]
    assert "x torch-sdpa" in lines[2] and "x torch-baseline" in lines[3]
    saved = json.loads(out.read_text())["rows"]
    assert {r["best_peer"] for r in saved} == {"torch-baseline", "torch-sdpa"}


def test_list_says_tf32_is_cuda_only(capsys):
    """layerbench list does not claim TF32 matmuls for torch-baseline on a CPU."""
    assert cli_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("torch-baseline"))
    text = " ".join(lines[first:first + 2])  # its summary and capabilities
    assert "TF32" in text
    for clause in text.split("TF32")[1:]:
        assert "CUDA" in clause.split(";")[0], text


@no_cuda
@pytest.mark.parametrize("script, argv", [("one_forward.py", []),
                                          ("tile_sweep.py", ["narrow", "--shapes", "1"]),
                                          ("wmma_sweep.py", ["gemm"]),
                                          ("cutile_sweep.py", ["attention"])])
def test_gpu_scripts_say_they_need_cuda(script, argv, monkeypatch, capsys):
    """The GPU scripts stop with 'needs a CUDA device' and exit 2 on a machine without CUDA."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
    assert exit_info.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
