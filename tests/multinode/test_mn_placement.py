"""Ring placement: consecutive ring neighbours stay on one node where possible (no processes needed).

The provider (megatron_ring.megatron.initialize_context_parallel) uses Megatron-Core's CP groups in
group order as the ring order; torchrun gives node ``k`` the global ranks ``k*P .. k*P+P-1``. Here the
groups come from Megatron-Core's own ``RankGenerator`` with the default order "tp-cp-ep-dp-pp" for
cluster shapes we cannot launch on this machine; the 2-host runs in test_mn_parity.py check the
same on the rings the provider really built across network namespaces.
"""
import itertools

import pytest
from megatron.core.parallel_state import RankGenerator

from placement import inter_node_hops, min_inter_node_hops

SHAPES = [  # (nodes, gpus per node, tp, cp, pp)
    (2, 2, 1, 4, 1), (2, 2, 2, 2, 1), (2, 8, 1, 16, 1), (2, 8, 2, 8, 1), (4, 8, 8, 4, 1), (4, 8, 2, 4, 2),
    (4, 8, 4, 8, 1), (8, 8, 1, 8, 1), (8, 8, 2, 16, 2), (16, 4, 1, 64, 1), (3, 4, 2, 6, 1), (2, 4, 1, 2, 1),
]


@pytest.mark.parametrize("nodes,per_node,tp,cp,pp", SHAPES)
def test_ring_hops_are_minimal(nodes, per_node, tp, cp, pp):
    world = nodes * per_node
    dp = world // (tp * cp * pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    rings = gen.get_ranks("cp")
    assert sorted(itertools.chain(*rings)) == list(range(world))
    node_of = lambda r: r // per_node  # noqa: E731 - torchrun's contiguous rank blocks per node
    for ring in rings:
        hops = inter_node_hops(ring, node_of)
        assert hops == min_inter_node_hops(ring, node_of), (ring, hops)
        # and no more nodes than needed: CP peers are tp apart, so a ring covers cp*tp consecutive ranks
        assert len({node_of(r) for r in ring}) == -(-cp * tp // per_node)


def test_hop_counting():
    node = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert inter_node_hops([0, 1, 2, 3], node) == 2 == min_inter_node_hops([0, 1, 2, 3], node)
    assert inter_node_hops([0, 2, 1, 3], node) == 4  # alternating nodes: every hop crosses the network
    assert inter_node_hops([0, 1], node) == 0 == min_inter_node_hops([0, 1], node)
    assert inter_node_hops([0], node) == 0
