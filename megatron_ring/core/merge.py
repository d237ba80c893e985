"""Online softmax merge of partial attention results in the overflow-free log-sum-exp form.

For one query row, a partial result over key set A is ``(o_A, lse_A)`` with ``o_A = softmax(s_A) v_A``
and ``lse_A = log sum exp(s_A)``. Two partials over disjoint key sets combine exactly as
``lse = m + log(exp(lse_A - m) + exp(lse_B - m))`` with ``m = max(lse_A, lse_B)`` and
``o = o_A exp(lse_A - lse) + o_B exp(lse_B - lse)``: every exponent is <= 0, so nothing overflows.
A row with no keys yet has ``lse = -inf`` and weight 0.
"""
from __future__ import annotations

import torch

__all__ = ["merge_into"]


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, blk_out: torch.Tensor,
               blk_lse: torch.Tensor) -> None:
    """Fold a block result into the running accumulator, in place.

    acc_out: ``[b, h, n, d]`` float32 (may be a row-slice view); acc_lse: ``[b, h, n]`` float32.
    blk_out: ``[b, h, n, d]`` any float dtype; blk_lse: ``[b, h, n]`` float32.
    """
    # lse is never +inf or NaN, so the max is finite or -inf; both -inf: m = 0 keeps the weights at 0, not NaN
    m = torch.maximum(acc_lse, blk_lse).nan_to_num_(neginf=0.0)
    w_acc = torch.exp(acc_lse - m)
    w_blk = torch.exp(blk_lse - m)
    total = w_acc + w_blk  # 0 (no key yet on either side) or in [1, 2]
    inv = total.reciprocal().nan_to_num_(posinf=0.0)  # 1/0 = inf -> 0: the row stays 0
    acc_out.mul_((w_acc * inv).unsqueeze(-1)).add_(blk_out * (w_blk * inv).unsqueeze(-1))
    acc_lse.copy_(m.add_(torch.log(total)))
