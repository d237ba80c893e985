"""Wall-clock timing of calls: ``comm_type="auto"``'s probe and measurement, and the benchmark tools.

A leaf (imports nothing of the package). ``fn`` ends with its own device synchronisation where it launches
device work (:func:`sync_device`); ``before`` runs untimed before each call (a barrier, a synchronisation).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["sync_device", "seconds", "timed", "median_seconds"]


def sync_device(device: Any) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA, where every op is synchronous)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    """Seconds one call of ``fn`` takes (``before()`` runs first, untimed)."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any], iters: int, before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of each of ``iters`` calls."""
    return [seconds(fn, before) for _ in range(iters)]


def median_seconds(fn: Callable[[], Any], iters: int = 5) -> float:
    """Median of ``iters`` timed calls after one untimed warm-up call (a median, not a minimum: on a busy
    machine the real calls see the same contention as the typical timed call)."""
    fn()
    return statistics.median(timed(fn, iters))
