"""Schedule views: the layout's block tasks re-addressed for strategies that hold several shards at once.

Every strategy consumes the SAME schedule as the ring: ``layout.block_tasks(causal, P, rank, src, s)``
says which (query rows, key rows) sub-blocks of (rank's queries, src's keys) are visible. A strategy
that holds more than one shard in one tensor (gathered K/V, or the head-sharded full sequence of
Ulysses) only needs those tasks shifted to where the shards sit in its tensors. The views below do
exactly that, so the ring engine (``engine.ring_forward``/``ring_backward``) runs them unchanged, and
whatever the layout puts into a task (a mask, a window, document bounds) is carried over by
``dataclasses.replace`` untouched; and since the shards sit side by side, full tasks that abut are joined into
one kernel call (:func:`coalesced`).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ring.schedules.layouts import BlockTask, Layout, ShardView
from megatron_ring.schedules.bounded import BoundedLRU
from megatron_ring.schedules.masks import schedule

__all__ = ["GatheredView", "GroupedView", "coalesced"]

#: :meth:`GroupedView.sequence_order`'s permutations (host index vectors), by layout and size
_ORDERS = BoundedLRU(256, 64 << 20, lambda v: sum(t.untyped_storage().nbytes() for t in v))
#: the views' plain schedules (:meth:`_View.block_tasks`), by view and block: a few slices each
_PLAIN = BoundedLRU(4096, 64 << 20, lambda tasks: 256 * len(tasks) + 64)


def _shift(sl: slice, by: int) -> slice:
    return slice(sl.start + by, sl.stop + by)


def _moved(task: BlockTask, q_off: int, kv_off: int) -> BlockTask:
    return dataclasses.replace(task, q=_shift(task.q, q_off), kv=_shift(task.kv, kv_off))


def coalesced(tasks: tuple[BlockTask, ...]) -> tuple[BlockTask, ...]:
    """``tasks`` with neighbouring unmasked full tasks joined: the same query rows over abutting key rows (the
    shards a rank sees whole, one after another), then the same key rows over abutting query rows. A view holds
    several shards in one tensor, so what the ring runs as a task per shard is one kernel call here: a gathered or
    grouped block without a causal mask is ONE task (before: one per pair of shards, each with its merge)."""
    def plain_full(t: BlockTask) -> bool:
        return type(t) is BlockTask and not t.causal

    for same, along in (("q", "kv"), ("kv", "q")):
        out: list[BlockTask] = []
        for t in tasks:
            prev = out[-1] if out else None
            if (prev is not None and plain_full(prev) and plain_full(t) and getattr(prev, same) == getattr(t, same)
                    and getattr(prev, along).stop == getattr(t, along).start):
                joined = slice(getattr(prev, along).start, getattr(t, along).stop)
                out[-1] = dataclasses.replace(prev, **{along: joined})
            else:
                out.append(t)
        tasks = tuple(out)
    return tasks


class _View(ShardView):
    """A :class:`~megatron_ring.schedules.layouts.ShardView` over ``base``; ``positions`` etc. are the
    base layout's."""

    def __init__(self, base: Layout) -> None:
        self.base = base
        self.name = f"{type(self).__name__}({base.name})"  # subclasses add their shape

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        return self.base.positions(seq_len, world, rank)

    def local_multiple(self) -> int:
        return self.base.local_multiple()

    def causal_tasks(self, world, rank, src, s):  # pragma: no cover - block_tasks is overridden
        raise NotImplementedError

    def block_tasks(self, causal, world, rank, src, s):
        """The base layout's tasks of every pair of shards the view holds (:meth:`_pairs`), moved to where the
        shards sit, full ones :func:`coalesced`; cached (a plan asks at every step of every call)."""
        key = (self.name, causal, world, rank, src, s)
        hit = _PLAIN.get(key)
        return hit if hit is not None else _PLAIN.put(key, coalesced(self._pairs(causal, world, rank, src, s)))

    def _pairs(self, causal, world, rank, src, s) -> tuple[BlockTask, ...]:  # pragma: no cover - per view
        raise NotImplementedError


class GatheredView(_View):
    """Queries: this rank's shard (``s`` rows). Keys: all ``world`` shards concatenated (src-major).

    Used with a world-size-1 plan: ``block_tasks(causal, 1, 0, 0, s)`` lists, for every source shard,
    the base tasks (rank, src) with key rows moved to ``src * s``. Sources this rank cannot see under
    the mask contribute no task (not computed).
    """

    def __init__(self, base: Layout, world: int, rank: int) -> None:
        super().__init__(base)
        self.world, self.rank = world, rank
        self.name = f"GatheredView({base.name},{world},{rank})"

    def key_positions(self, seq_len: int) -> torch.Tensor:
        """Global positions of the gathered keys (every shard, src-major); queries: ``positions``."""
        return torch.cat([self.base.positions(seq_len, self.world, j) for j in range(self.world)])

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        return self.base.positions(seq_len, self.world, self.rank)  # this rank's queries

    def _pairs(self, causal, world, rank, src, s):
        assert world == 1, "GatheredView is consumed by a world-size-1 plan"
        return tuple(_moved(t, 0, j * s) for j in range(self.world)
                     for t in self.base.block_tasks(causal, self.world, self.rank, j, s))

    def masked_tasks(self, rule, world, rank, src, s, tile=None, one_task=None):
        """Documents / windows: the base layout's masked schedule (:func:`..masks.schedule`; whole blocks where
        ``tile = s``: this rank's queries against each source shard), moved alike, full tasks coalesced."""
        assert world == 1, "GatheredView is consumed by a world-size-1 plan"
        return coalesced(tuple(_moved(t, 0, j * s) for j in range(self.world)
                               for t in schedule(self.base, rule, self.world, self.rank, j, s, tile, one_task)))


class GroupedView(_View):
    """Super-blocks of ``inner`` consecutive shards (Ulysses' head-sharded sequence, a2a+p2p's outer ring).

    Outer rank ``o`` holds shards ``o*inner .. o*inner+inner-1`` (global ranks of the base layout) one
    after another; ``block_tasks(causal, outer_world, o, o_src, inner*s)`` is the union over
    (query shard, key shard) pairs of the base tasks, each moved to its shard's offsets.
    """

    def __init__(self, base: Layout, inner: int) -> None:
        super().__init__(base)
        self.inner = inner
        self.name = f"GroupedView({base.name},{inner})"

    def positions(self, seq_len: int, world: int, rank: int) -> torch.Tensor:
        """The super-block's global positions: base shards ``rank*inner ..`` one after another."""
        n = self.inner
        return torch.cat([self.base.positions(seq_len, world * n, rank * n + i) for i in range(n)])

    def _pairs(self, causal, world, rank, src, s):
        n = self.inner
        if s % n:
            raise ValueError(f"super-block of {s} rows is not {n} shards")
        c = s // n
        total = world * n
        return tuple(_moved(t, i * c, j * c)
                     for i in range(n) for j in range(n)
                     for t in self.base.block_tasks(causal, total, rank * n + i, src * n + j, c))

    def sequence_order(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The super-block of a world of one (the whole sequence, ``n`` rows: every shard's rows one after another, as
        a2a holds them) put in the sequence's order: ``(order, back)``, host index vectors, ``x[order]`` in order and
        ``y[back]`` back in the shards'. None where they are in order already (``contiguous``). Once per layout and
        size (a new document mix of the per-document zigzag is a new layout: the cache is bounded)."""
        key = (type(self.base), self.base.name, self.inner, n)
        hit = _ORDERS.get(key)
        if hit is None:
            pos = self.positions(n, 1, 0)
            hit = _ORDERS.put(key, () if torch.equal(pos, torch.arange(n, dtype=pos.dtype))
                              else (torch.argsort(pos), pos))
        return hit or None

    def masked_tasks(self, rule, world, rank, src, s, tile=None, one_task=None):
        """Documents / windows: the base layout's masked schedule (:func:`..masks.schedule`), moved alike; whole
        blocks of the super-block (``tile = s``) are whole blocks of its shards."""
        n = self.inner
        c = s // n
        tile = c if tile == s else tile
        return coalesced(tuple(_moved(t, i * c, j * c)
                               for i in range(n) for j in range(n)
                               for t in schedule(self.base, rule, world * n, rank * n + i, src * n + j, c, tile,
                                                 one_task)))
