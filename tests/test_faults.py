"""A ring peer that dies or stalls makes the survivors raise RingPeerError naming it, in bounded time."""
import os
import time

import torch

from dist_utils import run_distributed
from megatron_ring import RingPeerError, ring_attention
from megatron_ring.launch import WorkerError


def _fault_worker(rank, world, fault, victim, timeout_s):
    q = torch.randn(1, 64, 2, 16, requires_grad=True)
    ring_attention(q, q, q, causal=True, timeout_s=timeout_s).sum().backward()  # healthy call first
    if rank == victim:
        if fault == "die":
            os._exit(3)
        time.sleep(timeout_s * 4)  # stall, then leave without taking part
        return "stalled"
    start = time.monotonic()
    try:
        ring_attention(q, q, q, causal=True, timeout_s=timeout_s)
    except RingPeerError as exc:
        return ("error", str(exc), time.monotonic() - start)
    return ("finished", "", time.monotonic() - start)


def _check(results, victim, timeout_s, bound_s):
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(res, tuple) and res[0] == "error", f"rank {rank}: {res}"
        assert "ring peer global rank" in res[1]
        assert res[2] < bound_s, f"rank {rank} took {res[2]:.1f}s to notice"
        # every survivor, neighbour of the victim or not, names it through the failure-note chain
        assert f"global rank {victim} left no failure note" in res[1], f"rank {rank}: {res[1]}"


def test_dead_peer_is_reported_quickly():
    res = run_distributed(_fault_worker, 4, "die", 1, 20.0, timeout=120, return_exceptions=True)
    assert isinstance(res[1], WorkerError)
    _check(res, 1, 20.0, bound_s=25.0)


def test_stalled_peer_times_out_with_its_name():
    res = run_distributed(_fault_worker, 4, "stall", 2, 3.0, timeout=120, return_exceptions=True)
    _check(res, 2, 3.0, bound_s=15.0)
