"""A least-recently-used cache bounded by its number of entries AND by the bytes its entries hold.

The schedule caches key on what a plan is a function of. A packed batch brings new documents, so new keys, in
every micro-batch, and nothing evicted the old ones but the count: 4096 schedules of 8K-row blocks held about
1 GiB of index vectors per rank. Bounded by bytes as well, a cache keeps the recent plans (the micro-batches in
flight reuse theirs in every later layer and in the backward) and lets the rest go.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["BoundedLRU"]


class BoundedLRU:
    """``get(key)`` / ``put(key, value)``; the oldest entries go once there are more than ``size`` or they hold more
    than ``nbytes`` in all (``weigh(value)``: the bytes one value holds). The newest entry is always kept."""

    def __init__(self, size: int, nbytes: int, weigh: Callable[[Any], int]) -> None:
        self.size, self.nbytes, self.weigh = size, nbytes, weigh
        self._entries: "OrderedDict[Hashable, tuple[Any, int]]" = OrderedDict()
        self.held = 0  #: bytes the entries hold

    def get(self, key: Hashable) -> Any:
        """The value of ``key`` (now the most recent), or None."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, value: Any) -> Any:
        """Keep ``value`` under ``key``, evicting the oldest entries past the bounds; returns ``value``."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.held -= old[1]
        weight = self.weigh(value)
        self._entries[key] = (value, weight)
        self.held += weight
        while len(self._entries) > 1 and (len(self._entries) > self.size or self.held > self.nbytes):
            _, (_, w) = self._entries.popitem(last=False)
            self.held -= w
        return value

    def clear(self) -> None:
        self._entries.clear()
        self.held = 0

    def __len__(self) -> int:
        return len(self._entries)
