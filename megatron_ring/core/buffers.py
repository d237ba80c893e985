"""Communication buffers reused across ring steps and calls (wire K/V blocks, dK/dV accumulators).

The ring's buffers have the same sizes step after step, layer after layer and call after call. On CPU
a fresh large tensor costs a page fault per 4 KiB page on first touch (glibc serves big blocks with
``mmap`` and returns them to the system when freed), so the engine takes its buffers from this pool and
gives them back when a ring is over. On CUDA torch's caching allocator already reuses memory, and knows
about streams, so the pool stays out of the way there (``take`` allocates, ``give`` drops).

A buffer is given back only after every exchange that touches it has been waited for, and never while
a caller can still see it (the dK/dV buffer that becomes the returned gradient is not given back).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["BufferPool", "POOL"]


class BufferPool:
    """Free tensors by ``(numel, dtype, device)``; at most ``per_key`` of each and ``keys`` sizes kept
    (least recently used sizes are dropped first)."""

    def __init__(self, per_key: int = 16, keys: int = 8) -> None:  # per_key: a ring's n + 1 piece slots
        self.per_key, self.keys = per_key, keys
        self._free: "OrderedDict[tuple, list[torch.Tensor]]" = OrderedDict()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements with undefined contents."""
        device = torch.device(device)
        key = (int(numel), dtype, device)
        free = self._free.get(key)
        if free:
            self._free.move_to_end(key)
            return free.pop()
        return torch.empty(int(numel), dtype=dtype, device=device)

    def give(self, *tensors: torch.Tensor) -> None:
        """Return buffers obtained from :meth:`take` (no one may use them afterwards)."""
        for t in tensors:
            if t.device.type != "cpu":
                continue
            key = (t.numel(), t.dtype, t.device)
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self.per_key:
                free.append(t)
            while len(self._free) > self.keys:
                self._free.popitem(last=False)

    def clear(self) -> None:
        self._free.clear()


#: The process-wide pool the engine uses.
POOL = BufferPool()
