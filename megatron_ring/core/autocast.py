"""A ring call under ``torch.autocast``, as torch's own attention behaves there.

``scaled_dot_product_attention`` is a lower-precision op of torch's autocast lists: under autocast for its
device, its floating inputs (float64 aside) go to the autocast dtype and it computes in that dtype. A ring call
does the same (:func:`autocast_inputs`): q, k and v in the autocast dtype (so fp32 q and k from an fp32 rotary
embedding beside a bf16 v are accepted, as SDPA accepts them), the output in that dtype, fp32 gradients for fp32
inputs through the casts. The call itself then runs with autocast off (:func:`autocast_off`), forward and
backward: autocast would otherwise turn the matmuls of the fp32-accumulating kernels (``math``, dropout, the
max-logit pass) to the lower precision in the forward only, and the backward, called inside an autocast region
(on CPU on the calling thread, on CUDA through autograd's thread-local state), would recompute scores the
forward's log-sum-exp does not match."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_inputs", "autocast_off"]


def autocast_inputs(device_type: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``tensors`` in the autocast dtype of ``device_type`` where autocast is on there (floating tensors other
    than float64, as torch's lower-precision autocast policy casts them), else None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t
                 for t in tensors)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device_type`` where it is on, else a null context."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
