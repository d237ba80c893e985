"""Where ring time goes: an opt-in per-step timer the engine reports into (``benchmark --breakdown``).

Categories: ``kernel`` (block attention calls), ``merge`` (log-sum-exp merges, sink folding),
``decode`` (wire buffer -> K/V), ``copies`` (encode, gradient accumulation adds, result casts),
``launch`` (starting an exchange: on gloo, where the receiver is already waiting, the calling thread
writes into the socket what its buffer takes: the part of the transfer's CPU cost the main thread pays), ``wait``
(blocking on the ring: K/V prefetch and dK/dV hops not hidden by compute). Disabled (the
default) it costs one ``None`` check per timed region. Times are wall-clock seconds per
``(phase, step, category)``; on CPU every op is synchronous, on CUDA a region's time is only its launch
unless the caller synchronises (the benchmark's breakdown is a CPU tool).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

__all__ = ["record", "section", "set_phase", "CATEGORIES"]

CATEGORIES = ("kernel", "merge", "decode", "copies", "launch", "wait")

_current: "defaultdict[tuple[str, int, str], float] | None" = None
_phase = "fwd"


@contextlib.contextmanager
def record() -> Iterator["defaultdict[tuple[str, int, str], float]"]:
    """Collect timings of the ring calls made inside the block into the yielded dict."""
    global _current
    prev, _current = _current, defaultdict(float)
    try:
        yield _current
    finally:
        _current = prev


def set_phase(phase: str) -> None:
    global _phase
    _phase = phase


@contextlib.contextmanager
def _timer(step: int, category: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if _current is not None:
            _current[(_phase, step, category)] += time.perf_counter() - t0


_NULL = contextlib.nullcontext()


def section(step: int, category: str):
    """Context manager timing one region (a shared no-op when not recording)."""
    return _NULL if _current is None else _timer(step, category)
