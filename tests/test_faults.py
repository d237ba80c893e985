"""A ring peer that dies or stalls makes the survivors raise RingPeerError naming it, in bounded time.

Every failure of an exchange -- when it is launched or when it is waited for -- becomes RingPeerError
naming the peer and the step, after the failing rank wrote its failure note, so every survivor's
failure chain names the rank that is really lost.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.launch import run_distributed
from tests.helpers.ring_fakes import DoneWork, one_rank_group, ring_as  # noqa: F401 - one_rank_group is a fixture
from megatron_ring import RingPeerError, ring_attention
from megatron_ring.transport.failure_notes import who_is_lost
from megatron_ring_lab.launch import WorkerError

# Upper bounds on the failure-note walk (megatron_ring.transport.failure_notes.who_is_lost defaults): a rank that
# raises spends at most NOTE_JOIN_S in it; its chain waits at most NOTE_WAIT_S for a missing note.
NOTE_WAIT_S = 2.0
NOTE_JOIN_S = NOTE_WAIT_S + 1.0


# Process start-up is not under test: the launcher gives the workers this long to join the group (a
# loaded shared machine can take minutes), and the hang guard `_guard_s` counts from then.
STARTUP_S = 240.0
DONE_KEY = "test_faults/survivors_done"


def _guard_s(timeout_s):
    """Hang guard for one fault run, from the configured timeouts: the healthy call, then the worst
    survivor (two time-outs and two note walks, see _check's bounds), with as much again to spare."""
    return 2 * (2 * (timeout_s + NOTE_JOIN_S)) + 30.0


def _fault_worker(rank, world, fault, victim, timeout_s):
    q = torch.randn(1, 64, 2, 16, requires_grad=True)
    ring_attention(q, q, q, causal=True, timeout_s=timeout_s).sum().backward()  # healthy call first
    store = dist.distributed_c10d._get_default_store()
    if rank == victim:
        if fault.startswith("die"):
            os._exit(3)
        # stall (take no part) until every survivor has raised, then leave
        stall_until = time.monotonic() + _guard_s(timeout_s)
        while store.add(DONE_KEY, 0) < world - 1 and time.monotonic() < stall_until:
            time.sleep(0.1)
        return "stalled"
    if fault == "die_launch" and rank == (victim + 1) % world:
        _fail_receive_launches()
    start = time.monotonic()
    try:
        ring_attention(q, q, q, causal=True, timeout_s=timeout_s)
        res = ("finished", "", time.monotonic() - start)
    except RingPeerError as exc:
        res = ("error", str(exc), time.monotonic() - start)
    if fault == "stall":
        store.add(DONE_KEY, 1)
    return res


def _fail_receive_launches():
    """From now on, launching a receive raises at once, as gloo does when the sender's connection is
    already closed (the race behind a flaky failure: a raw RuntimeError escaping Ring.exchange)."""
    real = dist.batch_isend_irecv

    def launch(ops):
        if any(op.op is dist.irecv for op in ops):
            raise RuntimeError("[fake] Connection closed by peer")
        return real(ops)

    dist.batch_isend_irecv = launch


def _check(results, victim, bound_s):
    times = {}
    print(f"\nvictim {victim}: seconds to raise per rank: "
          f"{ {r: round(x[2], 2) for r, x in enumerate(results) if isinstance(x, tuple)} } (bound {bound_s:.1f}s)")
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(res, tuple) and res[0] == "error", f"rank {rank}: {res}"
        assert "ring peer global rank" in res[1]
        times[rank] = res[2]
        assert res[2] < bound_s, f"rank {rank} took {res[2]:.1f}s to notice (bound {bound_s:.1f}s)"
        # every survivor, neighbour of the victim or not, names it through the failure-note chain
        assert f"global rank {victim} left no failure note" in res[1], f"rank {rank}: {res[1]}"
    return times


@pytest.mark.slow
def test_dead_peer_is_reported_quickly():
    # A dead peer's closed connection is noticed at once. Worst case for a survivor that is no neighbour
    # of the victim: it waits until a neighbour of the victim has walked the notes and exited (closing its
    # connections), then walks the notes itself: 2 * NOTE_JOIN_S, plus process exit and scheduling slack.
    # The ring timeout (20 s) is far above this, so a time-out never stands in for the detection.
    res = run_distributed(_fault_worker, 4, "die", 1, 20.0, timeout=_guard_s(20.0), startup_timeout=STARTUP_S,
                          return_exceptions=True)
    assert isinstance(res[1], WorkerError)
    _check(res, 1, bound_s=20.0)


@pytest.mark.slow
def test_dead_peer_seen_at_launch_is_reported_with_a_note():
    """Deterministic launch-time failure: rank 2's receive launch raises (its sender, rank 1, is dead)."""
    res = run_distributed(_fault_worker, 4, "die_launch", 1, 20.0, timeout=_guard_s(20.0),
                          startup_timeout=STARTUP_S, return_exceptions=True)
    assert isinstance(res[1], WorkerError)
    _check(res, 1, bound_s=20.0)
    assert "receiving from ring peer global rank 1 failed to start at fwd_kv step 0" in res[2][1], res[2][1]
    assert "[fake] Connection closed by peer" in res[2][1]


@pytest.mark.slow
def test_stalled_peer_times_out_with_its_name():
    timeout_s = 3.0
    res = run_distributed(_fault_worker, 4, "stall", 2, timeout_s, timeout=_guard_s(timeout_s),
                          startup_timeout=STARTUP_S, return_exceptions=True)
    # The victim's neighbours time out after timeout_s and walk the notes; the others fail when a
    # neighbour exits, or time out themselves (one more timeout_s): 2 * (timeout_s + NOTE_JOIN_S) + slack.
    _check(res, 2, bound_s=2 * (timeout_s + NOTE_JOIN_S) + 5.0)


# ----- launch-time failures in one process (a world of one; the ring's peers are set by hand) -----

@pytest.mark.parametrize("failing_op", ["isend", "irecv"])
def test_launch_failure_names_its_peer_and_writes_a_note(one_rank_group, monkeypatch, failing_op):
    def launch(ops):
        if any(op.op.__name__ == failing_op for op in ops):
            raise RuntimeError("[fake] Connection closed by peer")
        return [DoneWork() for _ in ops]

    monkeypatch.setattr(dist, "batch_isend_irecv", launch)
    ring = ring_as(2, 4, coalesced=False)
    buf = torch.zeros(4)
    with pytest.raises(RingPeerError) as info:
        ring.exchange(buf, torch.empty(4), "bwd_dkv", 3)
    peer, role = (3, "sending to") if failing_op == "isend" else (1, "receiving from")
    msg = str(info.value)
    assert f"{role} ring peer global rank {peer} failed to start at bwd_dkv step 3" in msg, msg
    assert "this is global rank 2" in msg and "[fake] Connection closed by peer" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
    # the note is on the store, and the chain (nobody else reported) names the blamed peer as lost
    assert one_rank_group.get("megatron_ring/failure/0-1-2-3/2") == str(peer).encode()
    assert f"global rank {peer} left no failure note" in msg


@pytest.mark.parametrize("failure", ["closed", "timeout"])
def test_failed_cross_rank_check_is_a_named_error(one_rank_group, monkeypatch, failure):
    """A rank that died (or stalls) before the call's cross-rank check (an all_gather over the group, the
    call's first collective): the others raise RingPeerError, naming themselves and the lost rank, not the
    backend's bare error; a stalled rank is waited for no longer than the ring's time-out."""
    def all_gather(out, t, group=None, async_op=False):
        if failure == "closed":
            raise RuntimeError("[fake] Connection closed by peer")

        class Never:
            def wait(self, timeout=None):
                assert timeout is not None, "the check must wait with the ring's time-out"
                return False
        return Never()

    monkeypatch.setattr(dist, "all_gather", all_gather)
    ring = ring_as(2, 4, coalesced=False, timeout_s=3.0)
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(RingPeerError) as info:
        ring_attention(q, q, q, causal=True, ring=ring)
    msg = str(info.value)
    assert "cross-rank check" in msg and "this is global rank 2" in msg, msg
    assert ("[fake] Connection closed by peer" if failure == "closed" else "did not complete within") in msg, msg
    assert "left no failure note" in msg, msg  # the failure notes name the lost rank


def test_failure_chain_follows_notes_naming_two_peers(one_rank_group):
    """A coalesced (NCCL) failure blames both neighbours; the chain keeps the one that left a note out."""
    key = "megatron_ring/failure/0-1-2-3/"
    one_rank_group.set(key + "3", "2,0")  # rank 3's one Work failed: both its neighbours suspected
    one_rank_group.set(key + "0", "1")
    text = who_is_lost([0, 1, 2, 3], 2, [1, 3], timed_out=False, grace_s=0.2)
    assert "global rank 1 left no failure note" in text, text

