"""Ring placement arithmetic: how many of a ring's hops cross a node boundary, and the least possible.

In one ring step every member sends one K/V block to its successor, so the number of *inter-node hops*
of the ring (successor on another node) is the number of blocks that cross the network per step.
A ring whose members live on ``n`` distinct nodes needs at least ``n`` such hops when ``n > 1`` (it must
leave and re-enter every node) and 0 when ``n == 1``; it reaches that bound exactly when the members of
each node are consecutive in ring order.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence


def inter_node_hops(ring: Sequence[int], node_of: Callable[[int], object] | Mapping[int, object]) -> int:
    node = node_of.__getitem__ if isinstance(node_of, Mapping) else node_of
    n = len(ring)
    if n < 2:
        return 0
    return sum(node(ring[i]) != node(ring[(i + 1) % n]) for i in range(n))


def min_inter_node_hops(ring: Sequence[int], node_of: Callable[[int], object] | Mapping[int, object]) -> int:
    node = node_of.__getitem__ if isinstance(node_of, Mapping) else node_of
    nodes = {node(r) for r in ring}
    return 0 if len(nodes) < 2 else len(nodes)
