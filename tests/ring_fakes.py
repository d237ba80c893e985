"""Test seams for the ring's transport: a world-of-one gloo group whose Ring is told its peers by hand,
and fake Work objects that behave like gloo's (blocking wait) or NCCL's (one coalesced Work whose
``wait()`` returns at once and whose completion is only visible through ``is_completed()``)."""
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_ring.comm import Ring


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (so P2POp and the job's store exist); yields the store."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.distributed_c10d._get_default_store()
    finally:
        dist.destroy_process_group()


def ring_as(rank, world, coalesced, timeout_s=5.0, device_waits_block_host=True):
    """A Ring over the one-process group that believes it is ``rank`` of ``world``.

    ``coalesced``: the backend returns one Work per batch (NCCL). ``device_waits_block_host=False``
    also makes it use the watchdog deadline (as on CUDA).
    """
    ring = Ring(dist.group.WORLD, torch.device("cpu"), timeout_s=timeout_s)
    ring.world, ring.rank, ring.my_global = world, rank, rank
    ring.next_global, ring.prev_global = (rank + 1) % world, (rank - 1) % world
    ring.members, ring.coalesced = list(range(world)), coalesced
    ring.watchdog_deadline = coalesced or not device_waits_block_host
    ring.aborted = 0

    def abort():
        ring.aborted += 1

    ring.abort_communicators = abort
    return ring


class DoneWork:
    def wait(self, *_):
        return True

    def is_completed(self):
        return True


class NcclLikeWork:
    """One coalesced Work: ``wait()`` returns at once (orders streams only) and records its arguments;
    ``is_completed()`` turns True when ``finish()`` is called; ``fail(exc)`` makes both raise ``exc``."""

    def __init__(self):
        self.wait_calls = []
        self._done = threading.Event()
        self._exc = None

    def finish(self):
        self._done.set()

    def fail(self, exc):
        self._exc = exc

    def wait(self, *args):
        self.wait_calls.append(args)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self):
        if self._exc is not None:
            raise self._exc
        return self._done.is_set()
