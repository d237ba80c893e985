"""Launching the engine's jitted Triton kernels with little host time (CUDA).

``kernel[grid](*args)`` re-binds every argument in Python at every launch: Triton specialises each (an int's value
equal to 1, divisible by 16, its width; a pointer's dtype and 16-byte alignment), hashes the whole specialisation
and looks it up. Profiled on an H200 (Triton 3.6, cProfile), the list op's launches, 64 arguments each, were most
of a backward ring step's host time. :class:`Launcher` keys a launch on what Triton specialises on, computed from the arguments directly:
an int by its value (which determines every int attribute), or only by its width where the kernel does not
specialise it (``do_not_specialize``: Triton's i32 / i64 / u64); a float and a bool by their type (Triton takes
them as fp32 / u1 whatever the value); a tensor by its dtype and whether its address is 16-byte aligned; the
keyword arguments (constexprs and launch options such as ``num_warps``) by value; the current device. The first
launch of a key goes through Triton's own ``kernel[grid](...)``, which compiles and launches; the compiled kernel
it returns is kept with the jitted kernel it came from, and later launches of that key by that kernel call it
(``compiled[grid](*args)``: the kernel's own launcher, no re-binding). An argument of any other type, a launch
that returns no compiled kernel (Triton's interpreter) or one that leaves a parameter to its default always takes
Triton's path.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["Launcher", "launch_key"]

#: compiled kernels kept per launcher (keys vary with shapes: packed batches): cleared when full
KEPT = 1024
_I32, _I64 = 1 << 31, 1 << 63


def launch_key(args: tuple, kwargs: dict[str, Any], loose: frozenset = frozenset()) -> tuple | None:
    """The key of a launch: equal keys give Triton's JIT the same specialisation (None: an argument whose
    specialisation is not derived here; the launch takes Triton's path). ``loose``: the positions of the int
    arguments the kernel does not specialise (keyed by their width only)."""
    key, cuda = [], False
    for i, a in enumerate(args):
        cls = a.__class__
        if cls is int:
            key.append((-_I32 <= a < _I32, a < _I64) if loose and i in loose else a)
        elif cls is torch.Tensor:
            key.append((a.dtype, not a.data_ptr() & 15))
            cuda = cuda or a.is_cuda
        elif cls is float or cls is bool:
            key.append(cls)
        else:
            return None
    # the device Triton compiles and launches for: the current one (CPU tensors: Triton's interpreter)
    return (torch.cuda.current_device() if cuda else None, tuple(key), tuple(kwargs.items()))


class Launcher:
    """``launcher(grid, *args, **kwargs)`` launches ``kernel()`` (a getter of the jitted kernel) as
    ``kernel()[grid](*args, **kwargs)`` does (see the module doc)."""

    def __init__(self, kernel: Callable[[], Any]) -> None:
        self._kernel = kernel
        # key -> (the jitted kernel, its compiled kernel, the names of the constexprs passed after the args)
        self._compiled: dict[tuple, tuple[Any, Any, tuple[str, ...]]] = {}
        self._loose: tuple[Any, frozenset] = (None, frozenset())  # (jitted kernel, its unspecialised positions)

    def __call__(self, grid: tuple, *args: Any, **kwargs: Any) -> None:
        fn = self._kernel()
        key = launch_key(args, kwargs, self._unspecialised(fn))
        if key is not None:
            kept = self._compiled.get(key)
            # held with the kernel it was compiled from: a getter whose cache was cleared gives a new jitted kernel
            if kept is not None and kept[0] is fn:
                # its launcher reads three grid dims and every parameter in the kernel's order
                kept[1][(*grid, 1, 1)[:3]](*args, *(kwargs[name] for name in kept[2]))
                return
        got = fn[grid](*args, **kwargs)
        if key is not None and (names := _rest(fn, got, len(args), kwargs)) is not None:
            if len(self._compiled) >= KEPT:
                self._compiled.clear()
            self._compiled[key] = (fn, got, names)

    def _unspecialised(self, fn: Any) -> frozenset:
        """The positions of ``fn``'s parameters that Triton does not specialise (``do_not_specialize``)."""
        if self._loose[0] is not fn:
            self._loose = (fn, frozenset(i for i, p in enumerate(getattr(fn, "params", ()))
                                         if getattr(p, "do_not_specialize", False)))
        return self._loose[1]


def _rest(fn: Any, got: Any, positional: int, kwargs: dict[str, Any]) -> tuple[str, ...] | None:
    """The parameters after the positional ones, in the kernel's order, where a launch's result can be called for
    the later launches of its key: a compiled kernel, and every parameter was passed (None: it cannot)."""
    from triton.compiler.compiler import CompiledKernel

    names = tuple(getattr(fn, "arg_names", ()))[positional:]
    return names if isinstance(got, CompiledKernel) and all(n in kwargs for n in names) else None
