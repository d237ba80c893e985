"""Views and strides of the engine's BHSD tensors: row / column slices that are the tensor itself where they
cover it, and dense strides in another tensor's memory order."""
from __future__ import annotations

import torch

__all__ = ["covers", "block_cols", "memory_order", "strides_like"]


def covers(sl: slice, n: int) -> bool:
    """Whether the row slice ``sl`` is all ``n`` rows (then the tensor itself is used, no view made)."""
    return sl.start == 0 and sl.stop == n and sl.step is None


def block_cols(k: torch.Tensor, v: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V rows ``cols`` (the tensors themselves when that is all of them)."""
    if covers(cols, k.shape[2]):
        return k, v
    return k[:, :, cols], v[:, :, cols]


def memory_order(like: torch.Tensor) -> list[int]:
    """``like``'s dimensions from outermost to innermost in memory."""
    strides = like.stride()
    return sorted(range(like.ndim), key=strides.__getitem__, reverse=True)


def strides_like(shape, like: torch.Tensor) -> list[int]:
    """Dense strides for ``shape`` in ``like``'s memory order."""
    strides, step = [0] * like.ndim, 1
    for i in reversed(memory_order(like)):
        strides[i], step = step, step * shape[i]
    return strides
