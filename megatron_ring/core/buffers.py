"""Communication buffers reused across ring steps and calls (wire K/V blocks, dK/dV accumulators).

The ring's buffers have the same sizes step after step, layer after layer and call after call. On CPU
a fresh large tensor costs a page fault per 4 KiB page on first touch (glibc serves big blocks with
``mmap`` and returns them to the system when freed), so the engine takes its buffers from this pool and
gives them back when a ring is over. On CUDA torch's caching allocator already reuses memory, and knows
about streams, so the pool stays out of the way there (``take`` allocates, ``give`` drops).

A buffer is given back only after every exchange that touches it has been waited for, and never while
a caller can still see it (the dK/dV buffer that becomes the returned gradient is not given back). A buffer
made under ``torch.inference_mode()`` is an inference tensor, which torch lets nothing write outside that
mode: the pool does not keep one (a later call in training would fail writing its K/V into it); a buffer
made outside, taken and written in inference mode, is kept as any other.

A ring's K/V slots are taken and given back as ONE :class:`SlotSet` (keyed by the ring's wire signature),
which keeps what the engine derives from its buffers (the decoded K/V views of each slot), so a later ring
of the same signature (the backward of a call, the next layer, the next step) makes none of them again.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["BufferPool", "POOL", "SlotSet"]


class SlotSet:
    """A ring's wire slots (``buffers``) and what is derived from them once (``views``: slot index ->
    anything made from that slot's buffer, e.g. its decoded K, V views). Taken and given back whole."""

    __slots__ = ("key", "buffers", "views")

    def __init__(self, key: tuple, buffers: list[torch.Tensor]) -> None:
        self.key, self.buffers, self.views = key, buffers, {}


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
        """Return buffers obtained from :meth:`take` (no one may use them afterwards); kept on CPU only, and not
        an inference tensor (see the module doc)."""
        for t in tensors:
            if t.device.type != "cpu" or t.is_inference():
                continue
            self._keep((t.numel(), t.dtype, t.device), t)

    def take_set(self, key: tuple, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> SlotSet:
        """A :class:`SlotSet` of ``count`` 1-D buffers of ``numel`` elements (undefined contents) for the
        signature ``key``: one given back with that key (its derived views kept), else fresh buffers."""
        full = ("set", key, count, int(numel), dtype, torch.device(device))
        free = self._free.get(full)
        if free:
            try:  # another thread (the tests' thread ring) may have taken the last one since
                return free.pop()
            except IndexError:
                pass
        return SlotSet(full, [torch.empty(int(numel), dtype=dtype, device=device) for _ in range(count)])

    def give_set(self, slots: SlotSet) -> None:
        """Return a set obtained from :meth:`take_set` (no one may use its buffers or views afterwards);
        kept on CPU only and not if made in inference mode, as :meth:`give`."""
        if slots.buffers and (slots.buffers[0].device.type != "cpu" or slots.buffers[0].is_inference()):
            return
        self._keep(slots.key, slots, max(1, self.per_key // len(slots.buffers)))  # per_key buffers at most

    def _keep(self, key: tuple, item, limit: int | None = None) -> None:
        free = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(free) < (self.per_key if limit is None else limit):
            free.append(item)
        while len(self._free) > self.keys:
            self._free.popitem(last=False)

    def clear(self) -> None:
        self._free.clear()


#: The process-wide pool the engine uses.
POOL = BufferPool()
