"""``a2a+p2p``: Ulysses all-to-all inside the inner group, the ring across the outer group.

``hierarchical_groups=(inner, outer)`` follows Megatron's ``hierarchical_context_parallel_sizes``
convention: with ``group`` ranks ``g_0..g_{P-1}`` and inner size ``n``, rank ``o*n + i`` has inner group
``g_{o*n} .. g_{o*n+n-1}`` (consecutive) and outer group ``g_i, g_{n+i}, g_{2n+i}, ...`` (same inner
index). After the inner all-to-all a rank holds its head slice (``head_split(h, h_kv, n)``: ``h/n`` heads when
``n`` divides them) of its ``n`` inner shards (a super-block);
the engine's ring then passes those super-blocks around the outer group with the layout's own tasks
(:class:`~megatron_ring.schedules.views.GroupedView`). The wire codec applies on the outer ring (the inter-node hop,
where bytes cost most), so each block is quantised once; the inner all-to-all carries the compute dtype.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.wire.codecs import IdentityCodec
from megatron_ring.core.plan import RingPlan
from megatron_ring.strategies.a2a import _A2A, check_heads, run_grouped
from megatron_ring.transport.deadline import timeout_seconds
from megatron_ring.transport.groups import group_ranks, ring_over
from megatron_ring.strategies.refusal import precheck_kv

__all__ = ["run", "check_hierarchical_groups", "make_hierarchical_groups", "HIER_HINT"]

HIER_HINT = ("pass hierarchical_groups=(inner, outer) (Megatron: --hierarchical-context-parallel-sizes "
             "INNER OUTER, e.g. GPUs per node and number of nodes)")

def make_hierarchical_groups(inner_size: int) -> tuple[Any, Any]:
    """``(inner, outer)`` groups over the default (world) group, built the Megatron way.

    Collective: every rank must call it (``new_group`` is). Without Megatron this is how to get the
    groups ``comm_type="a2a+p2p"`` needs; with Megatron, use the provider's (``RingState.hierarchical_groups``).
    """
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    if inner_size < 1 or world % inner_size:
        raise ValueError(f"inner size {inner_size} does not divide the world size {world}")
    mine: list[Any] = [None, None]
    for o in range(world // inner_size):
        g = dist.new_group(list(range(o * inner_size, (o + 1) * inner_size)))
        if me // inner_size == o:
            mine[0] = g
    for i in range(inner_size):
        g = dist.new_group(list(range(i, world, inner_size)))
        if me % inner_size == i:
            mine[1] = g
    return mine[0], mine[1]


def check_hierarchical_groups(group: Any, world: int, rank: int, hierarchical_groups: Any) -> str | None:
    """The reason ``hierarchical_groups`` is unusable for a2a+p2p on this rank, or None if it is fine."""
    if hierarchical_groups is None:
        return f"comm_type='a2a+p2p' needs the hierarchical groups; {HIER_HINT}"
    try:
        inner, outer = hierarchical_groups
    except (TypeError, ValueError):
        return (f"hierarchical_groups must be a pair (inner, outer) of process groups, got "
                f"{type(hierarchical_groups).__name__}; {HIER_HINT}")
    try:
        members, inner_r, outer_r = group_ranks(group), group_ranks(inner), group_ranks(outer)
    except Exception as exc:  # noqa: BLE001 - not process groups, or not containing this rank
        return f"hierarchical_groups must be process groups containing this rank ({exc}); {HIER_HINT}"
    n, m = len(inner_r), len(outer_r)
    if n * m != world:
        return (f"hierarchical group sizes {n} (inner) x {m} (outer) = {n * m} do not multiply to the "
                f"context-parallel group size {world}; {HIER_HINT}")
    o, i = divmod(rank, n)
    want_inner, want_outer = members[o * n:(o + 1) * n], members[i::n]
    if inner_r != want_inner or outer_r != want_outer:
        return (f"hierarchical groups are not built the Megatron way: on group rank {rank} the inner group should be "
                f"global ranks {want_inner} (consecutive) and the outer {want_outer} (same inner index), got "
                f"{inner_r} and {outer_r}; {HIER_HINT}")
    return None


def run(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *,
        hierarchical_groups=None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Expects :func:`check_hierarchical_groups` to have passed on every rank (see ``strategies.run_strategy``)."""
    ring = plan.ring
    inner, outer = hierarchical_groups
    n = len(group_ranks(inner))
    what = f"comm_type='a2a+p2p' (inner group of {n})"
    check_heads(qh.shape[1], n, what)
    timeout = timeout_seconds(ring)
    outer_ring = ring_over(outer, qh.device, timeout, outer=True)
    kh, vh = precheck_kv(plan, plan.codec, kh, vh)  # K/V the outer ring's codec refuses: zeros, recorded
    return run_grouped(qh, kh, vh, plan, inner=_A2A(ring_over(inner, qh.device, timeout), plan.ring), outer=outer_ring,
                       a2a_codec=IdentityCodec(), ring_codec=plan.codec, sink=sink,
                       what=what)
