"""The CUDA stream seam is driven the same way on CPU, and exchanges start before compute."""
import torch

import megatron_ring.engine as engine
from dist_utils import run_distributed
from megatron_ring import ring_attention
from megatron_ring.comm import LoopbackRing, Ring
from megatron_ring.streams import SideStream


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


def _seam_worker(rank, world):
    log = []
    ring = Ring(torch.distributed.group.WORLD, torch.device("cpu"))
    ring.stream = RecordingStream(log)
    kernel_calls = []
    real_tasks = engine.RingPlan.tasks

    def spy(self, step, s):
        kernel_calls.append(("compute", step, len([e for e in log if e[0] == "launch"])))
        return real_tasks(self, step, s)

    real_bwd = engine.RingPlan.backward_block

    def spy_bwd(self, *a, **kw):
        kernel_calls.append(("bwd kernel", len([e for e in log if e[0] == "launch"])))
        return real_bwd(self, *a, **kw)

    engine.RingPlan.tasks, engine.RingPlan.backward_block = spy, spy_bwd
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    ring_attention(q, q, q, causal=True, ring=ring).sum().backward()
    engine.RingPlan.tasks, engine.RingPlan.backward_block = real_tasks, real_bwd
    return log, kernel_calls


def test_stream_seam_and_prefetch_order():
    world = 3
    for rank, (log, calls) in enumerate(run_distributed(_seam_worker, world, timeout=120)):
        launches = [e for e in log if e[0] == "launch"]
        joins = [e for e in log if e[0] == "join"]
        # forward: P-1 K/V exchanges; backward: P-1 K/V + P-1 dK/dV exchanges + the final hop home in
        # four messages (dK, dV of the lower then the upper half of the key rows); each joined once
        assert len(launches) == (world - 1) + (world - 1) + (world - 1) + 4 == len(joins)
        assert all(n == 2 for _, n in launches)  # send and receive buffers recorded on the stream
        # forward step t computes after the exchange for step t+1 was launched (double buffering)
        fwd = calls[:world]
        assert [c[2] for c in fwd] == [1, 2, 2]
        # the last step computes its upper key rows after the lower rows' hop home was launched: only
        # the upper half's two messages are left in the open (zigzag: rank P-1's last visitor is rank
        # 0's block, whose upper rows it does not see, so all four go after its one kernel call)
        last_kernel = [c for c in calls if c[0] == "bwd kernel"][-1][1]
        assert len(launches) - last_kernel == (2 if rank < world - 1 else 4)


def test_loopback_ring_counts_bytes_like_the_real_one():
    ring = LoopbackRing(4, 1, torch.device("cpu"))
    q = torch.randn(1, 8, 2, 16)
    ring_attention(q, q, q, causal=True, ring=ring)
    assert ring.bytes_sent["fwd_kv"] == 3 * (2 * q.numel() + 1) * 4  # K, V and the status element
