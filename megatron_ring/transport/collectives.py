"""The collectives the strategies need, with deadlines that name what failed.

``all_to_all_single`` / ``all_gather_into_tensor`` run on every backend this project meets (NCCL, gloo);
``reduce_scatter`` falls back to an all-to-all plus a local sum where the backend has no reduce-scatter
(gloo): same bytes on the wire. Every call is asynchronous and returns a :class:`Pending`.

Each collective runs over a :class:`~megatron_ring.transport.ring.Transport` of its group (the ring over the
context-parallel group, or ``ring_over`` an inner group), which holds the group, the deadline and the way waits
keep it, exactly as the ring's exchanges do (:mod:`.ring`, :mod:`.deadline`):

* where a wait blocks the host anyway (gloo), :meth:`Pending.wait` carries the deadline and turns a failure or a
  time-out into ``RingPeerError``;
* where it does not (CUDA, NCCL: ``work.wait()`` only makes the current stream wait, ``work.wait(timeout)``
  would block the CPU thread until the collective completes, a host synchronisation per collective), the wait
  carries no deadline: the watchdog thread keeps it (counted from when the device reaches the collective), records
  the error on the transport and aborts its communicators, and the next collective or wait on it raises.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.device import ops_for
from megatron_ring.errors import RingPeerError
from megatron_ring.transport.deadline import watchdog
from megatron_ring.transport.groups import group_ranks

__all__ = ["Pending", "all_to_all", "all_gather", "reduce_scatter"]


class Pending:
    """A collective in flight over ``over``; ``then`` runs after the wait (e.g. the local sum of a
    reduce-scatter)."""

    def __init__(self, work: Any, what: str, over: Any, then: Callable[[], None] | None = None) -> None:
        self.work, self.what, self.over, self.then = work, what, over, then

    def wait(self) -> None:
        if self.work is None:
            return
        over = self.over
        over.raise_if_failed()
        timeout = over.timeout if not over.watchdog_deadline else None  # the watchdog's otherwise (module doc)
        try:
            ok = self.work.wait(timeout) if timeout is not None else self.work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised naming the collective and its group
            over.raise_if_failed()  # the watchdog's diagnosis (it aborted the communicators)
            raise RingPeerError(f"context-parallel {self.what} over global ranks {group_ranks(over.group)} failed "
                                f"(this is global rank {dist.get_rank()}): {exc}. A peer process or its node "
                                "has probably died or stalled; check the other ranks' logs.") from exc
        if ok is False:
            raise RingPeerError(f"context-parallel {self.what} over global ranks {group_ranks(over.group)} timed "
                                f"out after {timeout.total_seconds()} s (this is global rank {dist.get_rank()})")
        self.work = None
        if self.then is not None:
            self.then()


_LAUNCHED = threading.local()


def launched() -> int:
    """Collectives this thread has launched so far (:func:`megatron_ring.core.engine.one_ring` tells from it whether
    an error came after a call's first collective: the group is then out of step)."""
    return getattr(_LAUNCHED, "n", 0)


def _start(launch: Callable[[], Any], what: str, over: Any, device: torch.device,
           then: Callable[[], None] | None = None) -> Pending:
    """Launch one collective over ``over`` (its tensors on ``device``); where the watchdog keeps the deadline, it
    watches the collective from when the device reaches it (an event recorded just before; none while the stream
    is captured into a CUDA graph: replays have no Work to watch, NCCL's own watchdog keeps the time-out there)."""
    over.raise_if_failed()
    _LAUNCHED.n = launched() + 1
    ops = ops_for(device)
    watched = over.watchdog_deadline and over.timeout is not None and not ops.capturing(device)
    started = None
    if watched and ops.has_streams:
        event = ops.record_event()
        started = lambda: ops.event_done(event)  # noqa: E731
    work = launch()
    if watched:
        watchdog.watch(over, (), [work], what, 0, started)
    return Pending(work, what, over, then)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, over: Any, what: str, in_splits: list[int] | None = None,
               out_splits: list[int] | None = None) -> Pending:
    """Chunk j of ``inp`` (split on dim 0) goes to group rank j; chunk i of ``out`` comes from rank i.
    Equal chunks by default; ``in_splits`` / ``out_splits``: the chunks' lengths on dim 0 (uneven
    all-to-all, which NCCL and gloo both run)."""
    return _start(lambda: dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                                                 input_split_sizes=in_splits, group=over.group, async_op=True),
                  what, over, inp.device)


def all_gather(out: torch.Tensor, inp: torch.Tensor, over: Any, what: str) -> Pending:
    """``out`` (``[P * n]`` flat) receives every rank's ``inp`` (``[n]`` flat) in group-rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # new name in torch 2.13
    return _start(lambda: gather(out, inp, group=over.group, async_op=True), what, over, inp.device)


_NO_REDUCE_SCATTER = {"gloo"}


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, over: Any, what: str) -> Pending:
    """``out`` (``[n]``) = sum over ranks of chunk ``rank`` of ``inp`` (``[P * n]``, rank-major)."""
    group = over.group
    if dist.get_backend(group) not in _NO_REDUCE_SCATTER:
        return _start(lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True),
                      what, over, inp.device)
    world = dist.get_world_size(group)
    parts = torch.empty_like(inp)
    return _start(lambda: dist.all_to_all_single(parts, inp, group=group, async_op=True), what, over, inp.device,
                  then=lambda: torch.sum(parts.view(world, -1), dim=0, out=out))
