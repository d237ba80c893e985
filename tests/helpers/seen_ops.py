"""A dispatch mode that records the ops it sees (to check that a custom op traces as one op)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class SeenOps(TorchDispatchMode):
    """``ops``: the name of every op dispatched under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
