"""The timing functions: alternating medians on CPU, and a replayed graph that holds exactly its
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


def test_attention_comparison_checks_each_kernel():
    """compare_attention_kernels reports a near-zero error for a kernel that computes
    attention, a large one for a kernel that drops the causal mask, and TFLOP/s for both."""
    from layerbench.common.runner import compare_attention_kernels
    from layerbench.reference import packed_attention

    batch, seq_len, heads, head_dim = 2, 24, 2, 8

    def attention(causal):
        def run(qkv, ctx):
            out = packed_attention(qkv, None, batch=batch, seq_len=seq_len, heads=heads,
                                   causal=causal)[0].reshape(batch * seq_len, -1)
            ctx[0].copy_(out.half())
            ctx[1].copy_((out - ctx[0].float()).half())
        return run

    rows = compare_attention_kernels({"right": attention(True), "full": attention(False)},
                                     batch=batch, seq_len=seq_len, heads=heads,
                                     head_dim=head_dim, causal=True, rounds=2, device="cpu")
    assert [r["kernel"] for r in rows] == ["right", "full"]
    assert rows[0]["max_abs"] < 1e-3 < rows[1]["max_abs"]
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in rows)
