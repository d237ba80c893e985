"""Head bookkeeping shared by the engine and the strategies."""
from __future__ import annotations

import functools

__all__ = ["head_groups", "kv_replication"]


def head_groups(h_kv: int, groups: int) -> list[slice]:
    """Split K/V heads ``[0, h_kv)`` into ``groups`` near-equal slices (at most one slice per head)."""
    return list(_head_groups(h_kv, int(groups)))


@functools.lru_cache(maxsize=256)
def _head_groups(h_kv: int, groups: int) -> tuple[slice, ...]:
    n = max(1, min(groups, h_kv))
    bounds = [round(i * h_kv / n) for i in range(n + 1)]
    return tuple(slice(a, b) for a, b in zip(bounds, bounds[1:]))


def kv_replication(h: int, h_kv: int, world: int) -> int:
    """How many times each of ``h_kv`` K/V heads is repeated (the least that divides the ``h / h_kv`` query
    heads per K/V head) so that the K/V heads split evenly over ``world`` ranks (the all-to-all strategies)."""
    g = h // h_kv
    return next(e for e in range(1, g + 1) if g % e == 0 and (h_kv * e) % world == 0)
