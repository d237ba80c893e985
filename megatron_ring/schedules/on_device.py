"""The plan's index tensors (global positions, document ids) on the compute device, copied once per
signature and device and then reused.

The schedule is planned on the host, from host index tensors. A kernel that needs them (an explicit mask,
position-keyed dropout) needs them on the device; copying them at every call is a host-to-device copy from
pageable memory, which synchronises the host with the device. Here each one is copied at its first use and kept
(an LRU bounded in entries and bytes, keyed by what the tensor is a function of, never by object identity), so a
steady-state call makes no host-to-device copy; and that first copy goes through the device seam
(:func:`~megatron_ring.device.to_device`: on CUDA from pinned memory, non_blocking), so it does not make the host
wait either. Tensors are small: one int64 per local token.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_ring.device import held_under_capture, to_device
from megatron_ring.schedules.bounded import BoundedLRU

__all__ = ["cached_on", "positions_on", "clear"]

#: at most 1024 tensors and 64 MiB (a layout that carries documents, e.g. the per-document zigzag, is new every
#: micro-batch)
_CACHE = BoundedLRU(1024, 64 << 20, lambda t: t.untyped_storage().nbytes())


def cached_on(key: tuple, make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()`` (a host tensor) on ``device``, copied once per ``(key, device)``."""
    full = (key, torch.device(device))
    hit = _CACHE.get(full)
    t = hit if hit is not None else _CACHE.put(full, to_device(make(), device))
    held_under_capture(device, t)  # a CUDA graph reading it: kept, whatever the cache evicts
    return t


def positions_on(schedule, seq_len: int, world: int, rank: int, device: torch.device) -> torch.Tensor:
    """``schedule.positions(seq_len, world, rank)`` on ``device`` (a layout's or a view's name identifies
    its positions; the class is part of the key too)."""
    return cached_on(("positions", type(schedule), schedule.name, seq_len, world, rank),
                     lambda: schedule.positions(seq_len, world, rank), device)


def clear() -> None:
    """Forget every cached tensor (tests that switch fake tensor modes)."""
    _CACHE.clear()
