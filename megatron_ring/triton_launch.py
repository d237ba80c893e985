"""Launching the engine's jitted Triton kernels with little host time (CUDA).

``kernel[grid](*args)`` re-binds every argument in Python at every launch: Triton specialises each (an int's value
equal to 1, divisible by 16, its width; a pointer's dtype and 16-byte alignment), hashes the whole specialisation
and looks it up. Measured on an H200 (Triton 3.6), that was most of a ring step's host time on the list op's 64
arguments. :class:`Launcher` keys a launch on what Triton specialises on, computed from the arguments directly
(an int by its value, which determines every int attribute; a tensor by its dtype and whether its address is
16-byte aligned; a constexpr by its value; the current device). The first launch of a key goes through Triton's
own ``kernel[grid](...)``, which compiles and launches; its compiled kernel is kept and later launches of that key
call it (``compiled[grid](*args)``: the kernel's own launcher, no re-binding). An argument of any other type, a
kernel whose launch does not return a compiled kernel (Triton's interpreter) or a call that leaves a parameter to
its default always takes Triton's path.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Launcher", "launch_key"]

#: compiled kernels kept per launcher (keys vary with shapes: packed batches): cleared when full
KEPT = 1024


def launch_key(args: tuple, constexprs: dict[str, Any]) -> tuple | None:
    """The key of a launch: equal keys give Triton's JIT the same specialisation (None: an argument whose
    specialisation is not derived here; the launch takes Triton's path)."""
    key, cuda = [], False
    for a in args:
        cls = a.__class__
        if cls is int:
            key.append(a)
        elif cls is torch.Tensor:
            key.append((a.dtype, not a.data_ptr() & 15))
            cuda = cuda or a.is_cuda
        else:
            return None
    # the device Triton compiles and launches for: the current one (CPU tensors: Triton's interpreter)
    return (torch.cuda.current_device() if cuda else None, tuple(key), tuple(constexprs.items()))


class Launcher:
    """``launcher(grid, *args, **constexprs)`` launches ``kernel()`` (a getter of the jitted kernel) as
    ``kernel()[grid](*args, **constexprs)`` does (see the module doc)."""

    def __init__(self, kernel: Callable[[], Any]) -> None:
        self._kernel = kernel
        self._compiled: dict[tuple, tuple[Any, Any]] = {}  # key -> (jitted kernel, its compiled kernel)

    def __call__(self, grid: tuple, *args: Any, **constexprs: Any) -> None:
        fn = self._kernel()
        key = launch_key(args, constexprs)
        if key is not None:
            kept = self._compiled.get(key)
            # the kernel it was compiled from, held: a getter whose cache was cleared gives a new jitted kernel
            if kept is not None and kept[0] is fn:
                kept[1][(*grid, 1, 1)[:3]](*args, *constexprs.values())  # its launcher reads three grid dims
                return
        got = fn[grid](*args, **constexprs)
        if key is not None and _keeps(fn, got, len(args), constexprs):
            if len(self._compiled) >= KEPT:
                self._compiled.clear()
            self._compiled[key] = (fn, got)


def _keeps(fn: Any, got: Any, positional: int, constexprs: dict[str, Any]) -> bool:
    """Whether a launch's result can be called for the later launches of its key: a compiled kernel, and every
    parameter was passed (positionally, then the constexprs in the kernel's order)."""
    from triton.compiler.compiler import CompiledKernel

    return isinstance(got, CompiledKernel) and list(getattr(fn, "arg_names", ()))[positional:] == list(constexprs)
