"""Process groups: their members, and state kept per group that cannot outlive it.

A cache keyed by ``id(group)`` can hand a destroyed group's entry to a new group that Python happens to
place at the same address. :class:`PerGroup` keys on the group object itself and holds it weakly
(``torch`` process groups accept weak references): an entry goes when its group is garbage-collected.
A value must not hold its group strongly or the entry keeps the group alive: a ``Ring`` holds its group
weakly (:attr:`~megatron_ring.transport.ring.Transport.group`), so a group that torch.distributed destroyed
and its caller dropped goes with its Ring. As a second net, entries whose group was destroyed
(``torch.distributed.destroy_process_group``) but is still referenced elsewhere are dropped whenever a new
group is added.
``None`` (no process group: one process) is a key like any other.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Iterator

import torch.distributed as dist

__all__ = ["group_ranks", "is_live", "PerGroup"]


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


class PerGroup:
    """A table ``(group, key) -> value`` that holds each group weakly (see the module doc)."""

    def __init__(self) -> None:
        self._tables: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
        self._no_group: dict[Hashable, Any] = {}

    def _table(self, group: Any, create: bool) -> dict[Hashable, Any] | None:
        if group is None:
            return self._no_group
        table = self._tables.get(group)
        if table is None and create:
            for old in [g for g in self._tables.keys() if not is_live(g)]:
                del self._tables[old]
            table = self._tables[group] = {}
        return table

    def get(self, group: Any, key: Hashable, default: Any = None) -> Any:
        table = self._table(group, create=False)
        return default if table is None else table.get(key, default)

    def __contains__(self, group_and_key: tuple[Any, Hashable]) -> bool:
        group, key = group_and_key
        table = self._table(group, create=False)
        return table is not None and key in table

    def set(self, group: Any, key: Hashable, value: Any) -> Any:
        self._table(group, create=True)[key] = value  # type: ignore[index]
        return value

    def setdefault(self, group: Any, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value for ``(group, key)``, made by ``make()`` the first time."""
        table = self._table(group, create=True)
        assert table is not None
        if key not in table:
            table[key] = make()
        return table[key]

    def groups(self) -> list[Any]:
        """The groups with entries (``None`` first when it has any)."""
        return ([None] if self._no_group else []) + list(self._tables.keys())

    def values(self) -> Iterator[Any]:
        yield from self._no_group.values()
        for table in list(self._tables.values()):
            yield from table.values()

    def __len__(self) -> int:
        return len(self._no_group) + sum(len(t) for t in list(self._tables.values()))

    def clear(self) -> None:
        self._tables.clear()
        self._no_group.clear()
