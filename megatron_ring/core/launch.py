"""Where a fused op of the engine runs (the merge, core/merge.py; the list op, core/foreach.py): ONE routing
rule for both.

* :data:`REFERENCE`: its torch expression, on CPU tensors, or on CUDA where Triton is not installed (the same
  results, more launches);
* :data:`DIRECT`: its Triton kernel launched directly, on plain eager CUDA tensors where nothing would see the op
  (no dispatch or torch-function mode, no compiler trace): the custom op's Python dispatch cost ~0.2 ms of host
  time per call on an H200, more than the kernel itself at 2K tokens per rank;
* :data:`OP`: its registered ``torch.ops.megatron_ring`` op, wherever a mode, a fake tensor or a compiler would
  see it (it traces as one op).

Beside it, :func:`gathers_adds`: whether the backward gathers a step's gradient adds into list ops (CUDA) or adds
each dQ as soon as its task is done (CPU).
"""
from __future__ import annotations

import functools
import importlib.util

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["REFERENCE", "DIRECT", "OP", "route", "has_triton", "direct_launch_ok", "gathers_adds"]

REFERENCE, DIRECT, OP = "reference", "direct", "op"


@functools.lru_cache(maxsize=1)
def has_triton() -> bool:
    """Whether Triton is installed (torch's CUDA wheels bring it)."""
    return importlib.util.find_spec("triton") is not None


def direct_launch_ok(*tensors: torch.Tensor) -> bool:
    """Plain tensors, no dispatch or torch-function mode, no compiler trace: nothing would see the op."""
    return (all(type(t) is torch.Tensor for t in tensors) and _get_current_dispatch_mode() is None
            and not torch._C._is_torch_function_mode_enabled() and not torch.compiler.is_compiling())


def route(first: torch.Tensor, *tensors: torch.Tensor) -> str:
    """How a fused op on ``first`` (which gives the device) and ``tensors`` runs (see the module doc)."""
    if first.device.type != "cuda" or not has_triton():
        return REFERENCE
    return DIRECT if direct_launch_ok(first, *tensors) else OP


def gathers_adds(t: torch.Tensor) -> bool:
    """Whether the backward gathers a step's gradient adds into list ops (core/accumulators.py ``add_all``) for
    tensors like ``t``: on CUDA, where each op is a launch; on CPU each dQ is added as soon as its task is done."""
    return t.device.type == "cuda"
