"""The element-wise list op of :mod:`.foreach` as ONE Triton launch (CUDA; Triton is imported at the first
launch, so this module imports without it).

Up to :data:`ENTRIES` pairs ``(dst, src)`` per launch, each of any shape (up to 4 dims), any strides and any
float dtypes, each with its mode (:data:`COPY`, :data:`ADD`, :data:`ZERO`): ``dst = src`` (cast to dst's dtype),
``dst = dst + src`` (both loaded, widened to fp32, added once, stored in dst's dtype: the one rounding of torch's
``dst.add_(src)`` for an fp32 ``dst``), ``dst = 0`` (``src`` unused) or ``dst = src`` with -inf made +inf (:data:`FLIP`:
an lse in a variable-length kernel's convention, kernels/varlen.py). A pair is seen as rows of its last dim:
a program takes a tile of rows by a chunk of columns, finds the rows' offsets once per row (the divisions by the
other sizes are per row, not per element) and runs along the last dim (stride 1 in every tensor the engine
passes: coalesced). The grid is
every pair's programs one after another; a program finds its pair by the ends.
"""
from __future__ import annotations

import functools

import torch

from megatron_ring.triton_launch import Launcher

__all__ = ["ADD", "COPY", "ENTRIES", "FLIP", "ZERO", "foreach_triton"]

#: pairs per launch (a longer list takes more launches)
ENTRIES = 4
#: elements per program, and at most this many columns (of the last dim) at a time
TILE, COLUMNS = 4096, 128
COPY, ADD, ZERO, FLIP = 0, 1, 2, 3


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel: its module is imported (again, after a cache clear) here, so Triton is imported at
    the first launch and ``TRITON_INTERPRET`` is read then."""
    import importlib

    from megatron_ring.core import _foreach_kernels

    return importlib.reload(_foreach_kernels).foreach_kernel


_kernel_launch = Launcher(lambda: _kernel())  # looked up at each launch (tests replace it)


def _as4(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """``t``'s sizes and strides as 4 dims (leading size-1 dims added)."""
    pad = 4 - t.dim()
    return [1] * pad + list(t.shape), [0] * pad + list(t.stride())


def foreach_triton(dsts: list[torch.Tensor], srcs: list[torch.Tensor | None], modes: list[int]) -> None:
    """Launch the kernel over every pair (see the module doc), :data:`ENTRIES` pairs per launch; ``src`` is
    None where the mode is :data:`ZERO`."""
    pairs = [p for p in zip(dsts, srcs, modes) if p[0].numel()]
    for dst, src, _ in pairs:
        if dst.dim() > 4 or (src is not None and src.shape != dst.shape):
            raise ValueError(f"foreach_triton: pairs of equal shapes of at most 4 dims, got {tuple(dst.shape)} and "
                             f"{None if src is None else tuple(src.shape)}")
    for at in range(0, len(pairs), ENTRIES):
        _launch(pairs[at:at + ENTRIES])


def _launch(pairs: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> None:
    """One launch: each pair as rows of its last dim (a program takes ``BLOCK_R`` rows; see the kernel)."""
    widest = max(p[0].shape[-1] if p[0].dim() else 1 for p in pairs)
    block_c = min(COLUMNS, 1 << max(0, (widest - 1).bit_length()))
    block_r = max(1, TILE // block_c)
    args: list = []
    end = 0
    for dst, src, mode in pairs:
        sizes, a = _as4(dst)
        b = [0, 0, 0, 0] if src is None else _as4(src)[1]
        rows = sizes[0] * sizes[1] * sizes[2]
        end += -(-rows // block_r) * -(-sizes[3] // block_c)  # row tiles x column chunks
        args += [dst, dst if src is None else src, mode, rows, end, sizes[3], sizes[1], sizes[2], *a, *b]
    used = len(pairs)
    args += args[:16] * (ENTRIES - used)  # unused slots: never read (N is constexpr)
    _kernel_launch((end,), *args, N=used, BLOCK_R=block_r, BLOCK_C=block_c)
