"""State kept per process group (transport/groups.py) is held weakly and cannot outlive its group."""
import gc
import weakref

import torch
import torch.distributed as dist

from megatron_ring.core import validation
from megatron_ring.strategies import a2a_p2p, auto
from megatron_ring.transport.groups import PerGroup, group_ranks, is_live
from megatron_ring.transport.ring import Ring

from tests.helpers.ring_fakes import one_rank_group  # noqa: F401 - fixture


def test_process_groups_take_weak_references(one_rank_group):
    g = dist.new_group([0])
    ref = weakref.ref(g)
    assert ref() is g
    dist.destroy_process_group(g)
    del g
    gc.collect()
    assert ref() is None


def test_an_entry_goes_with_its_group(one_rank_group):
    cache = PerGroup()
    g = dist.new_group([0])
    cache.set(g, "k", 1)
    cache.set(None, "k", 2)
    assert (g, "k") in cache and cache.get(None, "k") == 2 and len(cache) == 2
    dist.destroy_process_group(g)
    del g
    gc.collect()
    assert len(cache) == 1 and cache.groups() == [None]


def test_a_destroyed_groups_ring_is_dropped_when_a_new_group_comes(one_rank_group):
    """The entry of a destroyed group that is still referenced (here by ``old``) goes when a new group comes,
    and the new group (which may sit where the old one did) does not find it."""
    cache = PerGroup()
    old = dist.new_group([0])
    old_ring = cache.setdefault(old, "ring", lambda: Ring(old, torch.device("cpu")))
    assert is_live(old) and group_ranks(old) == [0]
    dist.destroy_process_group(old)
    assert not is_live(old)
    new = dist.new_group([0])
    new_ring = cache.setdefault(new, "ring", lambda: Ring(new, torch.device("cpu")))
    assert new_ring is not old_ring and new_ring.group is new
    assert cache.groups() == [new] and len(cache) == 1


def test_the_librarys_caches_hold_no_stale_group(one_rank_group):
    """The consistency check's, auto's and a2a+p2p's caches are per-group tables: after a group is
    destroyed and a new one made, only the new group has entries."""
    old = dist.new_group([0])
    for table in (validation._checked, auto._choices, a2a_p2p._outer_rings):
        table.set(old, "probe", object())
    dist.destroy_process_group(old)
    del old
    new = dist.new_group([0])
    for table in (validation._checked, auto._choices, a2a_p2p._outer_rings):
        table.set(new, "probe", object())
        gc.collect()
        assert [g for g in table.groups() if g is not None] == [new]
        table.clear()


def test_a_destroyed_groups_ring_is_released_with_no_new_group(one_rank_group):
    """The Ring ``ring_attention`` keeps per group (``api._rings``) holds its group weakly, so once torch has
    destroyed the group and the caller dropped it, the Ring and the entry go at the next collection: no new
    group has to come (that sweep used to be the only way out). Negative control: while the caller still holds
    the group (not destroyed), the Ring stays and is reused."""
    from megatron_ring import api, ring_attention

    q = torch.randn(1, 8, 2, 4)
    g = dist.new_group([0])
    ring_attention(q, q, q, group=g)
    ring = api._rings.get(g, (q.device, None))
    assert isinstance(ring, Ring) and ring.group is g
    gc.collect()
    assert api._rings.get(g, (q.device, None)) is ring  # kept while the group lives
    ring_ref, group_ref = weakref.ref(ring), weakref.ref(g)
    dist.destroy_process_group(g)
    del g, ring
    gc.collect()
    assert group_ref() is None and ring_ref() is None
    assert not [x for x in api._rings.groups() if x is not None and x is not dist.group.WORLD]
