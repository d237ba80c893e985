"""Dispatch modes that record what they see: the ops (to check that a custom op traces as one op), the largest
result (to check a memory bound)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SeenOps(TorchDispatchMode):
    """``ops``: the name of every op dispatched under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class LargestResult(TorchDispatchMode):
    """The largest tensor any op returns under it: ``bytes`` and ``elements`` (each its own max), and ``op`` (the
    op and shape of the largest in bytes). Views return no new memory and are not counted; ``device_type``: only
    results on that device (None: all)."""

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.bytes = self.elements = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and self.device_type in (None, t.device.type):
                    self.elements = max(self.elements, t.numel())
                    if t.numel() * t.element_size() > self.bytes:
                        self.bytes, self.op = t.numel() * t.element_size(), f"{func} {tuple(t.shape)} {t.dtype}"
        return out
