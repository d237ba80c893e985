"""Element-wise copies, adds and zeroings over lists of tensors in as few launches as can be: the backward's
dQ/dK/dV adds of a step, the results' conversion to the caller's dtype, the local K/V written into a wire slot
with its status element zeroed.

On CUDA a call is ONE op, ``torch.ops.megatron_ring.foreach_`` (a Triton kernel, :mod:`.foreach_triton`, up to
4 pairs per launch): torch's own ``_foreach_add_`` / ``_foreach_copy_`` launch once only when every tensor is
dense, of one dtype (per list, for a copy) and strided alike pair by pair (``aten/src/ATen/native/ForeachUtils.h``),
and otherwise loop one launch per pair; an fp32 accumulator plus a bf16 block, a row-slice view or a caller's
``[s, b, h, d]`` K/V are each such a case. The op has a fake implementation (it traces under FakeTensorMode and
``torch.compile`` as one op); its CPU implementation is :func:`foreach_reference`, ``dst.add_(src)`` /
``dst.copy_(src)`` / ``dst.zero_()`` pair by pair. :func:`foreach_into` runs the reference, the kernel directly
or the op by :func:`~megatron_ring.core.launch.route`, as :func:`~.merge.merge_into` does.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_ring.core.foreach_triton import ADD, COPY, FLIP, ZERO, foreach_triton  # Triton at its first launch only
from megatron_ring.core.launch import DIRECT, REFERENCE, has_triton, route
from megatron_ring.kernels.varlen import no_key_as

__all__ = ["foreach_into", "foreach_reference"]


def foreach_reference(dsts: list[torch.Tensor], srcs: list[torch.Tensor | None], modes: list[int]) -> None:
    """Pair by pair ``dst.copy_(src)``, ``dst.add_(src)``, ``dst.zero_()`` or the copy with -inf made +inf (by its
    mode: ``COPY``, ``ADD``, ``ZERO``, ``FLIP`` of :mod:`.foreach_triton`): the CPU path and the kernel's
    reference."""
    for dst, src, mode in zip(dsts, srcs, modes):
        if mode == ADD:
            dst.add_(src)
        elif mode == COPY:
            dst.copy_(src)
        elif mode == FLIP:
            dst.copy_(no_key_as(src, float("inf")))  # a variable-length kernel's lse convention
        else:
            dst.zero_()


@torch.library.custom_op("megatron_ring::foreach_", mutates_args=("dsts",))
def _foreach_op(dsts: list[torch.Tensor], srcs: list[Optional[torch.Tensor]], modes: list[int]) -> None:
    foreach_reference(dsts, srcs, modes)


@_foreach_op.register_kernel("cuda")
def _foreach_cuda(dsts, srcs, modes) -> None:
    (foreach_triton if has_triton() else foreach_reference)(dsts, srcs, modes)


@_foreach_op.register_fake
def _foreach_fake(dsts, srcs, modes) -> None:
    return None


def foreach_into(dsts: list[torch.Tensor], srcs: list[torch.Tensor | None], add: bool | list[bool] = False,
                 flip: bool | list[bool] = False) -> None:
    """For each pair, in place: ``dst.zero_()`` where ``src`` is None, else ``dst.add_(src)`` where ``add`` (one
    flag for all pairs, or one per pair), else ``dst.copy_(src)``, with -inf made +inf where ``flip`` (an lse in a
    variable-length kernel's convention).

    Pairs have equal shapes (at most 4 dims, any strides, any float dtypes; uint8 for a copy, the FP8 wire's status
    elements); no two ``dst`` may overlap, and no
    ``dst`` may overlap a ``src`` (the pairs run in parallel on CUDA). The sum is computed in fp32 (the
    accumulators are fp32); a float64 ``dst`` takes torch's ops (the kernel computes in fp32)."""
    if not dsts:
        return
    adds = add if isinstance(add, list) else [add] * len(dsts)
    flips = flip if isinstance(flip, list) else [flip] * len(dsts)
    modes = [ZERO if s is None else ADD if a else FLIP if f else COPY for s, a, f in zip(srcs, adds, flips)]
    how = route(*dsts, *(s for s in srcs if s is not None))
    if how != REFERENCE and any(d.dtype == torch.float64 for d in dsts):  # the kernel's arithmetic is fp32
        how = REFERENCE
    if how == REFERENCE:
        foreach_reference(dsts, srcs, modes)
    elif how == DIRECT:
        foreach_triton(dsts, srcs, modes)
    else:
        torch.ops.megatron_ring.foreach_(dsts, srcs, modes)
