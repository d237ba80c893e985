"""NCCL's fault behaviour, checked on CPU through the transport seam (tests/helpers/ring_fakes.py).

On NCCL ``batch_isend_irecv`` returns ONE coalesced Work for the send and the receive, and
``work.wait()`` does not block the host. So: a failure must name both neighbours; the ring must never
call ``work.wait(timeout)`` (a blocking host wait per step); the deadline is kept by the watchdog thread,
whose error reads like NCCL's own time-out and is raised by the ring's next launch or wait.
"""
import re
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.ring_fakes import NcclLikeWork, one_rank_group, ring_as  # noqa: F401 - one_rank_group is a fixture
from megatron_ring import RingPeerError
from megatron_ring.transport.ring import looks_like_timeout
from megatron_ring.transport.deadline import watchdog

BOTH = "exchanging with ring peer global rank 3 (sending to) and ring peer global rank 1 (receiving from)"


def _one_work_backend(monkeypatch, work):
    batches = []

    def launch(ops):
        batches.append([(op.op.__name__, op.peer) for op in ops])
        return [work]

    monkeypatch.setattr(dist, "batch_isend_irecv", launch)
    return batches


def test_nccl_single_work_failure_names_both_neighbours(one_rank_group, monkeypatch):
    work = NcclLikeWork()
    batches = _one_work_backend(monkeypatch, work)
    ring = ring_as(2, 4, coalesced=True, timeout_s=None)
    ex = ring.exchange(torch.zeros(4), torch.empty(4), "fwd_kv", 1)
    assert batches == [[("isend", 3), ("irecv", 1)]]  # one batch: NCCL coalesces it into one Work
    work.fail(RuntimeError("[fake] NCCL error: remote process exited or there was a network error"))
    with pytest.raises(RingPeerError) as info:
        ex.wait()
    msg = str(info.value)
    assert f"{BOTH} failed at fwd_kv step 1 (this is global rank 2)" in msg, msg
    assert "sending to ring peer global rank 3 failed" not in msg  # the one Work is not blamed on the send
    assert one_rank_group.get("megatron_ring/failure/0-1-2-3/2") == b"3,1"
    assert "global ranks 3, 1 left no failure note; one of them (or its node) is lost" in msg, msg


def test_nccl_launch_failure_names_both_neighbours(one_rank_group, monkeypatch):
    def launch(ops):
        raise RuntimeError("[fake] NCCL error in: ncclGroupEnd")

    monkeypatch.setattr(dist, "batch_isend_irecv", launch)
    ring = ring_as(2, 4, coalesced=True, timeout_s=None)
    with pytest.raises(RingPeerError, match=re.escape(f"{BOTH} failed to start at bwd_kv step 0")):
        ring.exchange(torch.zeros(4), torch.empty(4), "bwd_kv", 0)


def test_nccl_deadline_never_blocks_the_host(one_rank_group, monkeypatch):
    """The normal path: wait() without a timeout (stream ordering only); the watchdog lets go of the
    exchange once it completes, and nothing fails."""
    work = NcclLikeWork()
    _one_work_backend(monkeypatch, work)
    # the deadline is far from what three launches cost on any host: had wait() blocked on the work (which completes
    # only at finish() below), the deadline would expire first and the watchdog record a failure
    ring = ring_as(2, 4, coalesced=True, timeout_s=5.0)
    t0 = time.monotonic()
    for step in range(3):
        ring.exchange(torch.zeros(4), torch.empty(4), "fwd_kv", step).wait()
    assert time.monotonic() - t0 < 5.0 and ring.failure is None and ring.aborted == 0  # returned before the deadline
    assert work.wait_calls == [(), (), ()]  # never work.wait(timeout): that blocks NCCL's host thread
    work.finish()
    deadline = time.monotonic() + 5
    while watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watchdog.pending() == 0 and ring.failure is None and ring.aborted == 0


def test_nccl_deadline_expiry_aborts_and_raises_nccl_like_text(one_rank_group, monkeypatch):
    work = NcclLikeWork()  # never completes: the peer is gone
    _one_work_backend(monkeypatch, work)
    ring = ring_as(2, 4, coalesced=True, timeout_s=0.3)
    ring.exchange(torch.zeros(4), torch.empty(4), "bwd_dkv", 2).wait()  # returns: no host block
    deadline = time.monotonic() + 10  # 0.3 s deadline + the note walk (2 s after a time-out)
    while (ring.failure is None or not ring.aborted) and time.monotonic() < deadline:  # recorded, then aborted
        time.sleep(0.02)
    assert ring.aborted == 1  # the communicators were aborted, releasing a stream stuck on the peer
    with pytest.raises(RingPeerError) as info:  # raised by the ring's next launch
        ring.exchange(torch.zeros(4), torch.empty(4), "bwd_dkv", 3)
    msg = str(info.value)
    assert f"{BOTH} timed out" in msg and "at bwd_dkv step 2" in msg, msg
    assert "Watchdog caught ring exchange timeout (Timeout(ms)=300)" in msg, msg
    assert "milliseconds before timing out" in msg and looks_like_timeout(msg)
    assert one_rank_group.get("megatron_ring/failure/0-1-2-3/2") == b"3,1"


def test_gloo_keeps_the_timeout_on_its_blocking_wait(one_rank_group, monkeypatch):
    """gloo's wait blocks the host anyway: the deadline rides on it, no watchdog involved."""
    works = [NcclLikeWork(), NcclLikeWork()]
    queue = list(works)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [queue.pop(0)])
    ring = ring_as(2, 4, coalesced=False, timeout_s=0.5)
    ring.exchange(torch.zeros(4), torch.empty(4), "fwd_kv", 0).wait()
    assert watchdog.pending() == 0
    assert [[c[0].total_seconds() for c in w.wait_calls] for w in works] == [[0.5], [0.5]]


@pytest.mark.parametrize("text", [
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=COALESCED, "
    "NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.",
    "[PG ID 2 PG GUID 5 Rank 1] Work WorkNCCL(SeqNum=9, OpType=COALESCED) timed out in blocking wait.",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv "
    "operation to complete",
])
def test_backend_timeout_texts_are_recognised(text):
    assert looks_like_timeout(text)
    assert not looks_like_timeout("Connection closed by peer [127.0.0.1]:29500")


def test_a_failure_without_text_is_named_by_its_type(one_rank_group, monkeypatch):
    """An exchange that fails with an exception carrying no text (a peer's thread or process that stopped) names
    the exception's type, not an empty reason (": ."); a failure with text keeps its text."""
    for exc, shown in ((RuntimeError(), ": RuntimeError."), (ConnectionResetError("reset by peer"), ": reset by peer.")):
        def launch(ops, exc=exc):
            raise exc

        monkeypatch.setattr(dist, "batch_isend_irecv", launch)
        with pytest.raises(RingPeerError) as info:
            ring_as(2, 4, coalesced=False).exchange(torch.zeros(4), torch.empty(4), "fwd_kv", 1)
        assert f"failed to start at fwd_kv step 1 (this is global rank 2){shown}" in str(info.value), str(info.value)


def _collective_backend(monkeypatch, work):
    """Every collective of transport/collectives.py returns ``work`` (NCCL: its wait() does not block the host)."""
    launched = []

    def launch(name):
        def run(*args, **kwargs):
            launched.append(name)
            return work
        return run

    for name in ("all_gather_single", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, launch(name))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    return launched


def test_nccl_collectives_leave_the_deadline_to_the_watchdog(one_rank_group, monkeypatch):
    """The collective strategies' collectives (all_gather, a2a, a2a+p2p) with a deadline on NCCL: wait() without a
    timeout (stream ordering only; ``work.wait(timeout)`` would block the host until the collective completes), the
    watchdog watching; at expiry it aborts the communicators, and the next collective on that transport raises an
    error naming the collective, its group and the time-out. Negative control: gloo keeps the timeout on its
    blocking wait, no watchdog."""
    from megatron_ring.transport.collectives import all_gather, all_to_all, reduce_scatter

    work = NcclLikeWork()
    launched = _collective_backend(monkeypatch, work)
    ring = ring_as(2, 4, coalesced=True, timeout_s=5.0)
    t0 = time.monotonic()
    all_gather(torch.empty(8), torch.zeros(2), ring, "all-gather of the input status").wait()
    all_to_all(torch.empty(8), torch.zeros(8), ring, "all-to-all of K/V").wait()
    reduce_scatter(torch.empty(2), torch.zeros(8), ring, "reduce-scatter of dK/dV").wait()
    assert time.monotonic() - t0 < 5.0 and len(launched) == 3 and work.wait_calls == [(), (), ()]
    assert watchdog.pending() == 3 and ring.failure is None
    work.finish()
    deadline = time.monotonic() + 5
    while watchdog.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watchdog.pending() == 0 and ring.failure is None and ring.aborted == 0

    stuck = NcclLikeWork()  # never completes: a peer is gone
    _collective_backend(monkeypatch, stuck)
    ring = ring_as(2, 4, coalesced=True, timeout_s=0.3)
    all_to_all(torch.empty(8), torch.zeros(8), ring, "all-to-all of O").wait()  # returns: no host block
    deadline = time.monotonic() + 10
    while (ring.failure is None or not ring.aborted) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ring.aborted == 1
    with pytest.raises(RingPeerError) as info:  # raised by the next collective's launch
        all_to_all(torch.empty(8), torch.zeros(8), ring, "all-to-all of dO")
    msg = str(info.value)
    assert "all-to-all of O over the ring's group failed (this is global rank 2)" in msg, msg
    assert "Watchdog caught collective operation timeout (Timeout(ms)=300)" in msg and looks_like_timeout(msg), msg

    gloo = [NcclLikeWork()]
    _collective_backend(monkeypatch, gloo[0])
    ring = ring_as(2, 4, coalesced=False, timeout_s=0.5)
    all_gather(torch.empty(8), torch.zeros(2), ring, "all-gather of K/V (forward)").wait()
    assert gloo[0].wait_calls[0][0].total_seconds() == 0.5 and watchdog.pending() == 0
