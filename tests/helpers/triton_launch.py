"""Compile a Triton kernel for a GPU target exactly as a launch would specialise it, without a GPU.

A launch (``kernel[grid](*args)``) does not compile the kernel for declared types: Triton's JIT binds the
arguments and specialises them first (an int argument equal to 1 becomes a constexpr, a Python int; ints and
pointers get divisibility attributes; an int's type follows its value). A kernel body that treats such an argument
as a tensor (``x.to(...)``) then fails to compile on the GPU for that value only. :class:`CompilingKernel` stands in
for a jitted kernel: ``kernel[grid](*args, **kwargs)`` runs that same binding for ``arch`` (Triton's own
``create_function_from_signature`` and ``JITFunction._pack_args``, Triton 3.6 and 3.7) and compiles to a cubin
instead of launching. CPU tensors do as arguments: only their dtype and address alignment are read.
"""
from __future__ import annotations

from typing import Any


def bind_launch(fn: Any, args: tuple, kwargs: dict, arch: int) -> tuple:
    """Triton's own binding of a launch of ``fn`` for an ``sm_{arch}`` GPU: ``(target, backend, (bound args,
    specialisation, options))``; the specialisation is what Triton's JIT keys the compiled kernel on."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    return target, backend, create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)


def compile_launch(fn: Any, args: tuple, kwargs: dict, arch: int) -> Any:
    """The compiled kernel a launch of ``fn`` with ``args``/``kwargs`` would run on an ``sm_{arch}`` GPU."""
    import triton
    from triton.compiler import ASTSource

    target, backend, (bound, specialization, options) = bind_launch(fn, args, kwargs, arch)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


class CompilingKernel:
    """``kernel[grid](*args, **kwargs)`` compiles ``fn`` for ``arch`` as that launch would (appended to
    ``compiled``: (kernel name, the compiled kernel)), and launches nothing."""

    def __init__(self, fn: Any, arch: int, compiled: list) -> None:
        self.fn, self.arch, self.compiled = fn, arch, compiled

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            self.compiled.append((self.fn.__name__, compile_launch(self.fn, args, kwargs, self.arch)))
        return launch
