"""The CUDA stream seam is driven the same way on CPU, and exchanges start before compute."""
import pytest
import torch

import megatron_ring.core.plan as plan_module
from tests.helpers.launch import run_distributed
from megatron_ring import ring_attention
from megatron_ring.transport.ring import LoopbackRing, Ring
from megatron_ring.transport.streams import SideStream


class RecordingStream(SideStream):
    """A CPU stand-in that logs what a CUDA side stream would be asked to do."""

    def __init__(self, log):
        super().__init__(torch.device("cpu"))
        self.log = log

    def launch(self, *buffers):
        self.log.append(("launch", len(buffers)))
        return super().launch(*buffers)

    def join(self):
        self.log.append(("join",))


def _seam_worker(rank, world, pieces):
    log = []
    ring = Ring(torch.distributed.group.WORLD, torch.device("cpu"))
    ring.stream = RecordingStream(log)
    kernel_calls = []
    real_fwd, real_bwd = plan_module.RingPlan.forward_block, plan_module.RingPlan.backward_block
    launched = lambda: len([e for e in log if e[0] == "launch"])  # noqa: E731

    def spy_fwd(self, task, q, k, v, step=None, padded=None):
        kernel_calls.append(("fwd kernel", step, launched()))
        return real_fwd(self, task, q, k, v, step, padded)

    def spy_bwd(self, *a, **kw):
        kernel_calls.append(("bwd kernel", None, launched()))
        return real_bwd(self, *a, **kw)

    plan_module.RingPlan.forward_block, plan_module.RingPlan.backward_block = spy_fwd, spy_bwd
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    try:
        ring_attention(q, q, q, causal=True, ring=ring, kv_pieces=pieces).sum().backward()
    finally:
        plan_module.RingPlan.forward_block, plan_module.RingPlan.backward_block = real_fwd, real_bwd
    return log, kernel_calls


@pytest.mark.slow
@pytest.mark.parametrize("pieces", [1, 2])
def test_stream_seam_and_prefetch_order(pieces):
    world = 3
    for rank, (log, calls) in enumerate(run_distributed(_seam_worker, world, pieces, timeout=120)):
        launches = [e for e in log if e[0] == "launch"]
        joins = [e for e in log if e[0] == "join"]
        # per piece: forward P-1 K/V exchanges; backward P-1 K/V and P dK/dV exchanges (the last one
        # carries the piece home); each joined once
        n = pieces
        assert len(launches) == n * ((world - 1) + (world - 1) + world) == len(joins)
        assert all(k == 2 for _, k in launches)  # send and receive buffers recorded on the stream
        # forward piece j of step t computes after the exchange bringing that piece for step t+1 was
        # launched (the chain: one exchange per piece, each before its piece's compute)
        fwd = [c for c in calls if c[0] == "fwd kernel"]
        firsts = {}
        for _, step, seen in fwd:
            firsts.setdefault(step, []).append(seen)
        for step, seen in firsts.items():
            expect = min((step + 1) * n, n * (world - 1))
            assert max(seen) == expect and min(seen) >= min(step * n + 1, n * (world - 1)), (step, seen)
        # the last step: every piece's hop home is launched right after its compute, so only the last
        # piece's hop is left in the open
        last_kernel = [c for c in calls if c[0] == "bwd kernel"][-1][2]
        assert len(launches) - last_kernel == 1


def test_loopback_ring_counts_bytes_like_the_real_one():
    ring = LoopbackRing(4, 1, torch.device("cpu"))
    q = torch.randn(1, 8, 2, 16)
    ring_attention(q, q, q, causal=True, ring=ring, kv_pieces=2)
    # K, V and, per piece, the status element and its padding: 16 bytes before the payload (2 K/V heads: 2 pieces)
    assert ring.bytes_sent["fwd_kv"] == 3 * (2 * q.numel() + 2 * 4) * 4
