"""Process groups: their members, and the one context the library keeps per group.

Everything the library learns about a process group lives in its :class:`GroupContext`: the rings built over
it, the hierarchical groups every rank agreed are usable, the call signatures every rank agreed on, and
``comm_type="auto"``'s machine numbers and choices. :func:`context` makes it on first use; :func:`forget`
drops it (or all of them: a test, a re-initialised job).

A cache keyed by ``id(group)`` can hand a destroyed group's entry to a new group that Python happens to
place at the same address. The contexts are keyed on the group object itself and hold it weakly
(``torch`` process groups accept weak references): a context goes when its group is garbage-collected.
What a context holds must not hold its group strongly or the context keeps the group alive: a ``Ring`` holds
its group weakly (:attr:`~megatron_ring.transport.ring.Transport.group`), so a group that torch.distributed
destroyed and its caller dropped goes with its context. As a second net, contexts whose group was destroyed
(``torch.distributed.destroy_process_group``) but is still referenced elsewhere are dropped whenever a new
group gets one. ``None`` (no process group: one process) has a context too; ``auto`` reads a machine set
there as the one for every group.
"""
from __future__ import annotations

import weakref
from typing import Any, Hashable

import torch
import torch.distributed as dist

from megatron_ring.transport.ring import Ring

__all__ = ["group_ranks", "is_live", "GroupContext", "context", "contexts", "forget", "ring_over"]


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def is_live(group: Any) -> bool:
    """False once ``group`` has been destroyed (or was never a registered process group)."""
    try:
        dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - torch raises KeyError for a destroyed group; other objects fail otherwise
        return False
    return True


class GroupContext:
    """What the library keeps for one process group (see the module doc); every field starts empty."""

    __slots__ = ("rings", "outer_rings", "agreed", "signatures", "machines", "choices")

    def __init__(self) -> None:
        #: ``(device, timeout_s)`` -> the Ring over this group (``ring_attention``)
        self.rings: dict[Hashable, Any] = {}
        #: ``(device, timeout_s)`` -> the Ring over this group as ``a2a+p2p``'s outer group
        self.outer_rings: dict[Hashable, Any] = {}
        #: ``(hierarchical groups, required)`` -> whether they are usable on every rank (``strategies``)
        self.agreed: dict[Hashable, bool] = {}
        #: call signatures every rank of the group agreed on (``core/validation.py``)
        self.signatures: set[tuple] = set()
        #: ``auto``'s machine numbers: ``("set", device type or None)`` from ``set_machine``,
        #: ``("probed", ...)`` from its probes -> Machine
        self.machines: dict[Hashable, Any] = {}
        #: ``auto``'s choices: call signature -> comm type
        self.choices: dict[Hashable, str] = {}

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in self.__slots__)


_contexts: weakref.WeakKeyDictionary[Any, GroupContext] = weakref.WeakKeyDictionary()
_no_group = GroupContext()


def context(group: Any) -> GroupContext:
    """``group``'s context (made on first use; ``None``: the context of no process group)."""
    if group is None:
        return _no_group
    ctx = _contexts.get(group)
    if ctx is None:
        for old in [g for g in _contexts.keys() if not is_live(g)]:
            del _contexts[old]
        ctx = _contexts[group] = GroupContext()
    return ctx


def ring_over(group: Any, device: torch.device, timeout_s: float | None, *, outer: bool = False) -> Ring:
    """The Ring over ``group`` kept in its context, one per device and timeout (``outer``: ``group`` as
    ``a2a+p2p``'s outer group, kept apart)."""
    ctx = context(group)
    rings = ctx.outer_rings if outer else ctx.rings
    ring = rings.get((device, timeout_s))
    if ring is None:
        ring = rings[(device, timeout_s)] = Ring(group, device, timeout_s)
    return ring


def contexts() -> list[tuple[Any, GroupContext]]:
    """``(group, context)`` for every group with a context that holds something (``None`` first)."""
    found = [(None, _no_group)] if _no_group else []
    return found + [(g, c) for g, c in list(_contexts.items()) if c]


def forget(*groups: Any) -> None:
    """Drop the contexts of ``groups`` (``None``: the no-group one); with no argument, every context."""
    global _no_group
    for group in groups or (None, *list(_contexts.keys())):
        if group is None:
            _no_group = GroupContext()
        else:
            _contexts.pop(group, None)
