"""Test seams for the ring's transport: a world-of-one gloo group whose Ring is told its peers by hand,
and fake Work objects that behave like gloo's (blocking wait) or NCCL's (one coalesced Work whose
``wait()`` returns at once and whose completion is only visible through ``is_completed()``)."""
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_ring.transport.ring import Exchange, Ring, Transport


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


class ThreadRing(Transport):
    """P ranks of one ring as P threads of this process: exchanges go through in-memory queues, so the
    whole engine (forward and backward rings, codecs, status element) runs without processes. On CPU only for
    a backward: on CUDA one autograd thread runs every rank's backward, so a rank blocked in a receive holds
    it and the ring deadlocks (tests/helpers/replay_ring.py runs P ranks on one GPU instead).

    ``WAIT_S``: how long a receive waits for its message (a test of the message sequence lowers it)."""

    WAIT_S = 120.0

    def __init__(self, queues, world, rank):
        super().__init__(world, rank, range(world))
        self._queues = queues  # {(rank, channel): queue.Queue}

    @staticmethod
    def make(world):
        import queue
        from megatron_ring.transport.ring import CHANNEL_TAGS
        qs = {(r, ch): queue.Queue() for r in range(world) for ch in CHANNEL_TAGS}
        return [ThreadRing(qs, world, r) for r in range(world)]

    def exchange(self, send, recv, channel, step):
        self._queues[(self.next_global, channel)].put(send.clone())
        self.bytes_sent[channel] += send.numel() * send.element_size()
        box, wait_s = self._queues[(self.rank, channel)], self.WAIT_S

        class _Recv:
            def wait(self, *_):
                recv.copy_(box.get(timeout=wait_s))
                return True

            def is_completed(self):
                return True

        return Exchange(self, [((("receiving from", self.prev_global),), [_Recv()])], channel, step)


def run_threads(fn, world):
    """``fn(rank, ring)`` on ``world`` threads sharing one ThreadRing; per-rank results or exceptions."""
    rings = ThreadRing.make(world)
    results = [None] * world

    def body(r):
        try:
            results[r] = fn(r, rings[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def thd_ring_in_global_order(world, layout, q, k, v, dout, **call_kw):
    """``ring_attention`` on each rank's share (``layout``'s positions) of the packed ``q, k, v [T, h, d]``
    (``qkv_format="thd"``, ``call_kw`` passed on), backward with its share of ``dout``, on ``world`` threads;
    returns ``[out, dq, dk, dv]`` put back in the global token order (an exception of any rank is raised)."""
    from megatron_ring import ring_attention

    T = q.shape[0]
    pos = [layout.positions(T, world, r) for r in range(world)]

    def rank(r, ring):
        leaves = [t[pos[r]].detach().clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, qkv_format="thd", layout=layout, ring=ring, **call_kw)
        out.backward(dout[pos[r]])
        return [out.detach()] + [t.grad for t in leaves]

    res = run_threads(rank, world)
    for x in res:
        if isinstance(x, BaseException):
            raise x
    got = []
    for i in range(4):
        full = torch.empty((T,) + res[0][i].shape[1:], dtype=res[0][i].dtype)
        for r in range(world):
            full[pos[r]] = res[r][i]
        got.append(full)
    return got
