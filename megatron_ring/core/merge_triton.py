"""The merge of :mod:`.merge` as one Triton kernel (CUDA; Triton is imported at the first launch,
so this module imports without it).

One program per query row ``(b, h, n)``: it reads the row's two lse values and its two output rows (any
strides: row-slice views of the accumulator are passed as they are; ``blk_out`` in any float dtype, loaded
and widened to fp32), and writes the merged row and lse in place, computing exactly the terms of
:func:`~megatron_ring.core.merge.merge_reference` in fp32: ``m = max`` (0 where both are -inf), the weights
``exp(lse - m)``, ``inv = 1 / total`` (0 where ``total`` is 0: the row stays 0, its lse -inf). ``fresh``: the
block is copied in (widened to fp32). ``status``: the visiting block's status code is copied into the ring's
codes by the first program (core/status.py), so recording it costs no launch of its own. ``posinf_empty``: a
block lse of +inf (a variable-length kernel's own value for a row that sees no key) reads as -inf.
"""
from __future__ import annotations

import functools

import torch

from megatron_ring.triton_launch import Launcher

__all__ = ["merge_triton"]


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel (Triton imported here, once; ``TRITON_INTERPRET`` is read now)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_kernel(acc_ptr, acc_lse_ptr, blk_ptr, blk_lse_ptr, H, N, D,
                      sa0, sa1, sa2, sa3, sl0, sl1, sl2, sb0, sb1, sb2, sb3, sm0, sm1, sm2, st_dst, st_src,
                      FRESH: tl.constexpr, STATUS: tl.constexpr, POSINF: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: accumulators over 2**31 elements
        if STATUS:
            if row == 0:  # the block's status code, recorded by the first program
                tl.store(st_dst, tl.load(st_src))
        n = row % N
        h = (row // N) % H
        b = row // (N * H)
        cols = tl.arange(0, BLOCK_D)
        keep = cols < D
        acc_row = acc_ptr + b * sa0 + h * sa1 + n * sa2 + cols * sa3
        blk = tl.load(blk_ptr + b * sb0 + h * sb1 + n * sb2 + cols * sb3, mask=keep, other=0.0).to(tl.float32)
        lse_at = acc_lse_ptr + b * sl0 + h * sl1 + n * sl2
        lb = tl.load(blk_lse_ptr + b * sm0 + h * sm1 + n * sm2)
        if POSINF:  # the kernel's +inf for a row that sees no key: ours is -inf
            lb = tl.where(lb == float("inf"), float("-inf"), lb)
        if FRESH:
            tl.store(acc_row, blk, mask=keep)
            tl.store(lse_at, lb)
        else:
            la = tl.load(lse_at)
            m = tl.maximum(la, lb)
            m = tl.where(m == float("-inf"), 0.0, m)
            wa = tl.exp(la - m)
            wb = tl.exp(lb - m)
            total = wa + wb
            inv = tl.where(total == 0.0, 0.0, 1.0 / total)
            acc = tl.load(acc_row, mask=keep, other=0.0)
            tl.store(acc_row, acc * (wa * inv) + blk * (wb * inv), mask=keep)
            tl.store(lse_at, m + tl.log(total))

    return _merge_kernel


_launch = Launcher(lambda: _kernel())  # looked up at each launch (tests replace it)


def merge_triton(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor,
                 fresh: bool, status: tuple[torch.Tensor, torch.Tensor] | None = None,
                 posinf_empty: bool = False) -> None:
    """Launch the kernel over every row (see the module doc; shapes as in :func:`.merge.merge_into`);
    ``status``: ``(dst, src)``, one element each of one dtype, copied by the first program; ``posinf_empty``:
    a block lse of +inf reads as -inf."""
    b, h, n, d = acc_out.shape
    rows = b * h * n
    if rows == 0 or d == 0:
        if status is not None:
            status[0].copy_(status[1])
        return
    import triton

    st_dst, st_src = status if status is not None else (acc_lse, acc_lse)
    _launch((rows,), acc_out, acc_lse, blk_out, blk_lse, h, n, d,
            *acc_out.stride(), *acc_lse.stride(), *blk_out.stride(), *blk_lse.stride(), st_dst, st_src,
            FRESH=bool(fresh), STATUS=status is not None, POSINF=bool(posinf_empty), BLOCK_D=triton.next_power_of_2(d))
