"""Head bookkeeping shared by the engine and the strategies."""
from __future__ import annotations

__all__ = ["head_groups"]


def head_groups(h_kv: int, groups: int) -> list[slice]:
    """Split K/V heads ``[0, h_kv)`` into ``groups`` near-equal slices (at most one slice per head)."""
    n = max(1, min(int(groups), h_kv))
    bounds = [round(i * h_kv / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]
