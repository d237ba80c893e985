"""Run a check of a Triton kernel in Triton's interpreter, on CPU tensors."""
from __future__ import annotations

from typing import Callable


def run_interpreted(monkeypatch, kernel_cache, check: Callable[[], None]) -> None:
    """``check()`` with ``TRITON_INTERPRET=1``. ``triton.jit`` reads the variable when it decorates, so the
    kernel (``kernel_cache``: the lru-cached function that makes it) is made afresh under it, and forgotten
    afterwards (a CUDA run compiles its own)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_cache.cache_clear()
    try:
        check()
    finally:
        kernel_cache.cache_clear()
