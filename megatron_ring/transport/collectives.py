"""The collectives the strategies need, with bounded waits that name what failed.

``all_to_all_single`` / ``all_gather_into_tensor`` run on every backend this project meets (NCCL, gloo);
``reduce_scatter`` falls back to an all-to-all plus a local sum where the backend has no reduce-scatter
(gloo): same bytes on the wire. Every call is asynchronous and returns a :class:`Pending` whose
:meth:`Pending.wait` turns a failure or a time-out into ``RingPeerError`` (as the ring does).
"""
from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.errors import RingPeerError
from megatron_ring.transport.groups import group_ranks

__all__ = ["Pending", "all_to_all", "all_gather", "reduce_scatter"]


class Pending:
    """A collective in flight; ``then`` runs after the wait (e.g. the local sum of a reduce-scatter)."""

    def __init__(self, work: Any, what: str, group: Any, timeout_s: float | None,
                 then: Callable[[], None] | None = None) -> None:
        self.work, self.what, self.group, self.timeout_s, self.then = work, what, group, timeout_s, then

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            ok = (self.work.wait(datetime.timedelta(seconds=self.timeout_s)) if self.timeout_s is not None
                  else self.work.wait())
        except Exception as exc:  # noqa: BLE001 - re-raised naming the collective and its group
            raise RingPeerError(f"context-parallel {self.what} over global ranks {group_ranks(self.group)} failed "
                                f"(this is global rank {dist.get_rank()}): {exc}. A peer process or its node "
                                "has probably died or stalled; check the other ranks' logs.") from exc
        if ok is False:
            raise RingPeerError(f"context-parallel {self.what} over global ranks {group_ranks(self.group)} timed "
                                f"out after {self.timeout_s} s (this is global rank {dist.get_rank()})")
        self.work = None
        if self.then is not None:
            self.then()


_LAUNCHED = threading.local()


def launched() -> int:
    """Collectives this thread has launched so far (:func:`megatron_ring.core.engine.one_ring` tells from it whether
    an error came after a call's first collective: the group is then out of step)."""
    return getattr(_LAUNCHED, "n", 0)


def _launch() -> None:
    _LAUNCHED.n = launched() + 1


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Any, timeout_s: float | None, what: str,
               in_splits: list[int] | None = None, out_splits: list[int] | None = None) -> Pending:
    """Chunk j of ``inp`` (split on dim 0) goes to group rank j; chunk i of ``out`` comes from rank i.
    Equal chunks by default; ``in_splits`` / ``out_splits``: the chunks' lengths on dim 0 (uneven
    all-to-all, which NCCL and gloo both run)."""
    _launch()
    work = dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    return Pending(work, what, group, timeout_s)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, timeout_s: float | None, what: str) -> Pending:
    """``out`` (``[P * n]`` flat) receives every rank's ``inp`` (``[n]`` flat) in group-rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # new name in torch 2.13
    _launch()
    work = gather(out, inp, group=group, async_op=True)
    return Pending(work, what, group, timeout_s)


_NO_REDUCE_SCATTER = {"gloo"}


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, timeout_s: float | None,
                   what: str) -> Pending:
    """``out`` (``[n]``) = sum over ranks of chunk ``rank`` of ``inp`` (``[P * n]``, rank-major)."""
    _launch()
    if dist.get_backend(group) not in _NO_REDUCE_SCATTER:
        work = dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Pending(work, what, group, timeout_s)
    world = dist.get_world_size(group)
    parts = torch.empty_like(inp)
    work = dist.all_to_all_single(parts, inp, group=group, async_op=True)
    return Pending(work, what, group, timeout_s,
                   then=lambda: torch.sum(parts.view(world, -1), dim=0, out=out))
