"""The strategies' schedule views (``schedules/views.py``): their plain schedules cover exactly the pairs the mask
leaves visible, once each, with full tasks coalesced: a gathered or grouped block without a causal mask is one
kernel call, not one per pair of shards."""
from __future__ import annotations

import itertools

import torch

from megatron_ring.schedules.layouts import BlockTask, get_layout
from megatron_ring.schedules.masks import DocumentZigzag
from megatron_ring.schedules.views import GatheredView, GroupedView, coalesced


def _covered(tasks, rows: int, cols: int) -> torch.Tensor:
    """How many times the tasks cover each (query row, key row): a causal task its top-left triangle, a masked one
    its mask's visible pairs."""
    m = torch.zeros(rows, cols, dtype=torch.int64)
    for t in tasks:
        block, mask = m[t.q, t.kv], t.explicit_mask()
        block += (mask.allowed().long() if mask is not None else torch.ones_like(block).tril() if t.causal else 1)
    return m


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference: causal (or not) over the global positions (a plain schedule's rule; documents and windows
    come with a call's mask, ``masks.schedule``)."""
    return (kpos[None, :] <= qpos[:, None]).long() if causal else torch.ones(len(qpos), len(kpos), dtype=torch.long)


def _cases():
    for world, s in ((2, 8), (3, 8), (4, 16), (8, 8)):
        # Megatron's per-document zigzag: its positions (its plain schedule has masked tasks where its runs of rows
        # do not line up with the blocks)
        bases = [get_layout(n) for n in ("contiguous", "zigzag", "striped")] + [
            DocumentZigzag([0, 2 * world, s * world])]
        for base, causal in itertools.product(bases, (True, False)):
            for rank in range(world):  # all_gather: this rank's queries against every shard, world-size-1 plan
                view = GatheredView(base, world, rank)
                yield (view, causal, (1, 0, 0, s), view.positions(s * world, world, rank),
                       view.key_positions(s * world))
            for inner in (n for n in (2, 3, 4) if world % n == 0):
                view, outer = GroupedView(base, inner), world // inner  # a2a+p2p's outer ring (and a2a's world 1)
                for o, o_src in itertools.product(range(outer), repeat=2):
                    yield (view, causal, (outer, o, o_src, inner * s), view.positions(s * world, outer, o),
                           view.positions(s * world, outer, o_src))


def test_view_schedules_cover_the_visible_pairs_once_with_full_tasks_coalesced():
    cases = joined = 0
    for view, causal, (world, rank, src, rows), qpos, kpos in _cases():
        tasks = view.block_tasks(causal, world, rank, src, rows)
        want = _visible(qpos, kpos, causal)
        assert torch.equal(_covered(tasks, len(qpos), len(kpos)), want), (view.name, causal, world, rank, src)
        pairs = view._pairs(causal, world, rank, src, rows)
        assert torch.equal(_covered(pairs, len(qpos), len(kpos)), want)  # the same pairs as before coalescing
        if not causal:
            assert len(tasks) == 1, (view.name, tasks)  # a block without a causal mask: one kernel call
        if tasks:  # negative control: a task left out is seen
            assert not torch.equal(_covered(tasks[:-1], len(qpos), len(kpos)), want)
        cases += 1
        joined += len(pairs) - len(tasks)
    assert cases > 300 and joined > 500, (cases, joined)


def test_coalescing_joins_only_full_tasks_that_abut():
    full = lambda q, kv: BlockTask(slice(*q), slice(*kv), False)  # noqa: E731
    assert coalesced((full((0, 4), (0, 4)), full((0, 4), (4, 8)))) == (full((0, 4), (0, 8)),)
    assert coalesced((full((0, 4), (0, 4)), full((4, 8), (0, 4)))) == (full((0, 8), (0, 4)),)
    apart = (full((0, 4), (0, 4)), full((0, 4), (5, 8)))  # a gap between the key rows
    causal = (BlockTask(slice(0, 4), slice(0, 4), True), full((0, 4), (4, 8)))
    other_rows = (full((0, 4), (0, 4)), full((0, 3), (4, 8)))
    for tasks in (apart, causal, other_rows):
        assert coalesced(tasks) == tasks
