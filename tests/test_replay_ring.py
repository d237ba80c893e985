"""tests/helpers/replay_ring (the engine's P ranks on one device, one rank at a time on recorded messages, as
tests/gpu runs them on a GPU) against the thread ring (``ring_fakes.ThreadRing``, P ranks as threads, which
is exact on CPU where each rank's backward runs on its own thread): the same outputs and gradients, bit for
bit; the replay settles within its bound of L + 1 passes; an unfinished replay differs (negative control)."""
import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.replay_ring import run_replayed
from tests.helpers.ring_fakes import run_threads

P, S = 4, 64


def _rank_fn(layout, wire):
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, S, 4, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, S, 2, 16, generator=g) for _ in range(2))
    pos = [get_layout(layout).positions(S, P, r) for r in range(P)]

    def rank(r, ring):
        leaves = [t[:, pos[r]].requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, causal=True, layout=layout, comm_dtype=wire, ring=ring)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout[:, pos[r]])]
    return rank


@pytest.mark.parametrize("layout, wire", [("zigzag", None), ("striped", "bf16"), ("contiguous", "fp8")])
def test_replay_equals_threads_bit_for_bit(layout, wire):
    rank = _rank_fn(layout, wire)
    threads = run_threads(rank, P)
    counts = []

    def counting(r, ring):
        res = rank(r, ring)
        counts.append(sum(ring.count.values()))
        return res

    replayed, passes = run_replayed(counting, P)
    assert passes <= max(counts) + 1
    for t, rep in zip(threads, replayed):
        assert not isinstance(t, BaseException) and not isinstance(rep, BaseException), (t, rep)
        assert all(torch.equal(a, b) for a, b in zip(t, rep))
    early, _ = run_replayed(rank, P, stop_after=1)  # negative control: pass 1 still has placeholder K/V
    assert not all(torch.equal(a, b) for t, e in zip(threads, early) for a, b in zip(t, e))
