"""Online softmax merge of partial attention results in the overflow-free log-sum-exp form.

For one query row, a partial result over key set A is ``(o_A, lse_A)`` with ``o_A = softmax(s_A) v_A``
and ``lse_A = log sum exp(s_A)``. Two partials over disjoint key sets combine exactly as
``lse = m + log(exp(lse_A - m) + exp(lse_B - m))`` with ``m = max(lse_A, lse_B)`` and
``o = o_A exp(lse_A - lse) + o_B exp(lse_B - lse)``: every exponent is <= 0, so nothing overflows.
A row with no keys yet has ``lse = -inf`` and weight 0.

On CUDA the merge of a step is ONE op, ``torch.ops.megatron_ring.merge_`` (``merge_status_`` where it also records
a status code; a Triton kernel,
:mod:`.merge_triton`; Triton is imported at its first launch); it has a fake implementation, so it traces under
FakeTensorMode (and ``torch.compile``) as one op. Its CPU implementation is :func:`merge_reference`, the torch
expression. :func:`merge_into` runs the expression, the kernel directly or the op by
:func:`~megatron_ring.core.launch.route`, the rule the list op (core/foreach.py) follows too.
"""
from __future__ import annotations

import torch

from megatron_ring.core.launch import DIRECT, OP, has_triton, route
from megatron_ring.core.merge_triton import merge_triton  # imports Triton at its first launch only
from megatron_ring.kernels.varlen import no_key_as

__all__ = ["merge_into", "merge_reference"]


def merge_reference(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor,
                    blk_lse: torch.Tensor, fresh: bool = False, posinf_empty: bool = False) -> None:
    """The merge as a torch expression (the CPU path and the fused kernel's reference); see :func:`merge_into`."""
    if posinf_empty:  # the kernel's +inf for a row that sees no key: ours is -inf
        blk_lse = no_key_as(blk_lse, float("-inf"))
    if fresh:
        acc_out.copy_(blk_out)
        acc_lse.copy_(blk_lse)
        return
    # lse is never +inf or NaN, so the max is finite or -inf; both -inf: m = 0 keeps the weights at 0, not NaN
    m = torch.maximum(acc_lse, blk_lse).nan_to_num_(neginf=0.0)
    w_acc = torch.exp(acc_lse - m)
    w_blk = torch.exp(blk_lse - m)
    total = w_acc + w_blk  # 0 (no key yet on either side) or in [1, 2]
    inv = total.reciprocal().nan_to_num_(posinf=0.0)  # 1/0 = inf -> 0: the row stays 0
    acc_out.mul_((w_acc * inv).unsqueeze(-1)).add_(blk_out * (w_blk * inv).unsqueeze(-1))
    acc_lse.copy_(m.add_(torch.log(total)))


def _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, status, kernel: bool) -> None:
    """The merge (and the status copy) as the Triton kernel (``kernel``, where Triton is installed) or the torch
    expression: what both registered ops run."""
    if kernel and has_triton():
        return merge_triton(acc_out, acc_lse, blk_out, blk_lse, fresh, status, posinf_empty)
    merge_reference(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty)
    if status is not None:
        status[0].copy_(status[1])


@torch.library.custom_op("megatron_ring::merge_", mutates_args=("acc_out", "acc_lse"))
def _merge_op(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor,
              fresh: bool, posinf_empty: bool) -> None:
    _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, None, kernel=False)


@_merge_op.register_kernel("cuda")
def _merge_cuda(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty) -> None:
    _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, None, kernel=True)


@_merge_op.register_fake
def _merge_fake(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty) -> None:
    return None


# the merge that also records a status code: an op of its own, every argument required (torch 2.11's in-place
# bookkeeping of a custom op indexes its mutated arguments by position, and a trailing default is dropped)
@torch.library.custom_op("megatron_ring::merge_status_", mutates_args=("acc_out", "acc_lse", "status_dst"))
def _merge_status_op(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor,
                     fresh: bool, posinf_empty: bool, status_dst: torch.Tensor, status_src: torch.Tensor) -> None:
    _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, (status_dst, status_src), kernel=False)


@_merge_status_op.register_kernel("cuda")
def _merge_status_cuda(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, status_dst, status_src) -> None:
    _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, (status_dst, status_src), kernel=True)


@_merge_status_op.register_fake
def _merge_status_fake(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, status_dst, status_src) -> None:
    return None


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor,
               blk_lse: torch.Tensor, fresh: bool = False,
               status: tuple[torch.Tensor, torch.Tensor] | None = None, posinf_empty: bool = False) -> None:
    """Fold a block result into the running accumulator, in place.

    acc_out: ``[b, h, n, d]`` float32 (may be a row-slice view); acc_lse: ``[b, h, n]`` float32.
    blk_out: ``[b, h, n, d]`` any float dtype; blk_lse: ``[b, h, n]`` float32.
    ``fresh``: the accumulator holds nothing yet: the block is copied in (the first result of a ring).
    ``status``: ``(dst, src)``, one element each of one dtype: ``dst.copy_(src)`` in the same launch on CUDA
    (the visiting block's status code recorded, core/status.py).
    ``posinf_empty``: ``blk_lse`` is +inf for a row that sees no key (a variable-length kernel's own lse,
    kernels/varlen.py), read as -inf: the kernel's fix-up is done here, with no launch of its own on CUDA.
    Where it runs: :func:`~megatron_ring.core.launch.route`.
    """
    how = route(acc_out, acc_lse, blk_out, blk_lse)
    if how != OP:
        _merge_any(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, status, kernel=how == DIRECT)
    elif status is None:
        torch.ops.megatron_ring.merge_(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty)
    else:
        torch.ops.megatron_ring.merge_status_(acc_out, acc_lse, blk_out, blk_lse, fresh, posinf_empty, *status)
