"""State kept per process group (transport/groups.py) is held weakly and cannot outlive its group."""
import gc
import weakref

import torch
import torch.distributed as dist

from megatron_ring.transport import groups
from megatron_ring.transport.groups import group_ranks, is_live
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


def test_a_context_goes_with_its_group(one_rank_group):
    g = dist.new_group([0])
    groups.context(g).choices["k"] = 1
    groups.context(None).choices["k"] = 2
    assert groups.context(g).choices == {"k": 1} and groups.context(None).choices == {"k": 2}
    assert [x for x, _ in groups.contexts()][:1] == [None] and g in [x for x, _ in groups.contexts()]
    dist.destroy_process_group(g)
    del g
    gc.collect()
    assert [x for x, _ in groups.contexts() if x is not None and x is not dist.group.WORLD] == []
    groups.forget(None)
    assert not groups.context(None)


def test_a_destroyed_groups_context_is_dropped_when_a_new_group_comes(one_rank_group):
    """The context of a destroyed group that is still referenced (here by ``old``) goes when a new group gets
    one, and the new group (which may sit where the old one did) does not find it: everything the library
    keeps per group (rings, agreed signatures, auto's machines and choices, a2a+p2p's outer rings) is in it."""
    old = dist.new_group([0])
    ctx = groups.context(old)
    old_ring = ctx.rings["ring"] = Ring(old, torch.device("cpu"))
    ctx.signatures.add((1, 2))
    ctx.choices["sig"] = "p2p"
    ctx.outer_rings["ring"] = old_ring
    assert is_live(old) and group_ranks(old) == [0]
    dist.destroy_process_group(old)
    assert not is_live(old)
    new = dist.new_group([0])
    fresh = groups.context(new)
    assert not fresh and fresh is not ctx
    fresh.rings["ring"] = Ring(new, torch.device("cpu"))
    assert [g for g, _ in groups.contexts() if g is not None and g is not dist.group.WORLD] == [new]
    groups.forget(new)
    assert [g for g, _ in groups.contexts() if g is not None and g is not dist.group.WORLD] == []


def test_a_destroyed_groups_ring_is_released_with_no_new_group(one_rank_group):
    """The Ring ``ring_attention`` keeps in the group's context holds its group weakly, so once torch has
    destroyed the group and the caller dropped it, the Ring and the entry go at the next collection: no new
    group has to come (that sweep used to be the only way out). Negative control: while the caller still holds
    the group (not destroyed), the Ring stays and is reused."""
    from megatron_ring import ring_attention

    q = torch.randn(1, 8, 2, 4)
    g = dist.new_group([0])
    ring_attention(q, q, q, group=g)
    ring = groups.context(g).rings.get((q.device, None))
    assert isinstance(ring, Ring) and ring.group is g
    gc.collect()
    assert groups.context(g).rings.get((q.device, None)) is ring  # kept while the group lives
    ring_ref, group_ref = weakref.ref(ring), weakref.ref(g)
    dist.destroy_process_group(g)
    del g, ring
    gc.collect()
    assert group_ref() is None and ring_ref() is None
    assert not [x for x, _ in groups.contexts() if x is not None and x is not dist.group.WORLD]


def test_auto_set_machine_is_kept_in_the_contexts_and_forgotten_with_none():
    """``auto.set_machine`` (docs/strategies.md) stores the machine in a context: for one group, or in the
    no-group context for every group; ``set_machine(None)`` forgets every machine and choice."""
    from types import SimpleNamespace

    from megatron_ring.planning.cost_model import Machine
    from megatron_ring.strategies import auto

    every = Machine(flops=1e12, bw_intra=1e10, latency=1e-5)
    mine = Machine(flops=2e12, bw_intra=1e10, latency=1e-5)
    g = object.__new__(type("G", (), {"__weakref__": None}))  # a stand-in group (never a live process group)
    plan = SimpleNamespace(ring=SimpleNamespace(group=None))
    auto.set_machine(every)
    assert auto.machine_for(plan, torch.device("cpu"), torch.float32) is every
    groups.context(None).choices["sig"] = "p2p"
    auto.set_machine(mine, group=g, device_type="cpu")
    assert groups.context(g).machines[("set", "cpu")] is mine
    auto.set_machine(None)
    assert not groups.context(None) and not groups.context(g)
    groups.forget(g)
