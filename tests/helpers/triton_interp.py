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


def loops_interpreted() -> bool:
    """Whether Triton's interpreter runs a kernel loop whose bound is a runtime value (a kernel argument or a
    program id): Triton 3.7 does; 3.6's turns the bound into a one-element array, which numpy 2 refuses to make an
    index ("only 0-dimensional arrays can be converted to Python scalars"). The compiler takes such loops on both."""
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)
