"""The timing helpers: alternating medians on CPU, and a replayed graph that holds exactly its
launches on a GPU."""
from __future__ import annotations

import pytest
import torch

from layerbench.common.timing import alternating_medians_ms, replayed


def test_alternating_medians_time_each_function():
    """One median per function, in order, each at least the function's own sleep."""
    import time

    fast, slow = (lambda: time.sleep(0.001)), (lambda: time.sleep(0.004))
    medians = alternating_medians_ms([fast, slow], "cpu", warmup=1, rounds=3)
    assert len(medians) == 2 and 1.0 <= medians[0] < medians[1] and medians[1] >= 4.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_graph_holds_its_launches():
    """Building runs fn once; each replay then runs it `repeats` times."""
    x = torch.zeros(4, device="cuda")
    replay = replayed(lambda: x.add_(1), 5, "cuda")
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4
    replay()
    replay()
    torch.cuda.synchronize()
    assert x.tolist() == [11.0] * 4
