"""The lab's one patch ledger: every Megatron / torch attribute the lab replaces is recorded here.

A :class:`Scope` applies patches for one owner (who asked for it: ``cpu.core``, ``cpu.training``, ...) and
restores them, newest first, to exactly the objects they replaced (a name the target did not hold itself is
deleted again) when it closes, also on an exception (``with Scope(owner) as s: s.apply(target, name, value)``).
Scopes nest; one closed out of order still restores correctly (a later patch of the same name then restores to
the earlier original). :func:`during` wraps a function so that each call runs with a few more patches, through
the same ledger. :func:`list_patches` returns what is applied now, :func:`during_calls` what the applied
wrappers apply while they run, :func:`describe` both as text (``python -m megatron_ring_lab.cpu --list-patches``).
:func:`snapshot` and :func:`changed_outside` check that nothing changed beside the ledger. All changes to the
ledger and to the patched attributes happen under one lock.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import types
from typing import Any, Callable, Iterable

__all__ = ["ABSENT", "Patch", "Scope", "during", "list_patches", "during_calls", "describe", "snapshot",
           "changed_outside"]

#: the original of a name the target did not hold itself (inherited, module ``__getattr__``, or unbound)
ABSENT = object()

_lock = threading.RLock()
_ledger: list["Patch"] = []  # applied patches, oldest first


def _where(target: Any) -> str:
    if isinstance(target, types.ModuleType):
        return target.__name__
    if isinstance(target, type):
        return f"{target.__module__}.{target.__qualname__}"
    return repr(target)


def _own(target: Any, name: str) -> Any:
    """What ``target`` itself holds under ``name`` (not what it inherits), or :data:`ABSENT`."""
    return vars(target).get(name, ABSENT)


@dataclasses.dataclass(eq=False)
class Patch:
    """One replaced attribute: ``target.name`` is ``replacement`` (was ``original``), asked for by ``owner``,
    for the owner's whole scope or (``during``) while that call runs."""

    target: Any
    name: str
    replacement: Any
    owner: str
    original: Any = ABSENT
    during: str | None = None

    @property
    def where(self) -> str:
        """The target's dotted name (``torch.cuda``, ``megatron.core.utils.GlobalMemoryBuffer``)."""
        return _where(self.target)


def _undo(patch: Patch) -> None:
    at = next(i for i, p in enumerate(_ledger) if p is patch)
    del _ledger[at]
    later = next((p for p in _ledger[at:] if p.target is patch.target and p.name == patch.name), None)
    if later is not None:  # a later patch of this name is still applied: it now restores to this original
        later.original = patch.original
    elif patch.original is not ABSENT:
        setattr(patch.target, patch.name, patch.original)
    elif _own(patch.target, patch.name) is not ABSENT:
        delattr(patch.target, patch.name)


class Scope:
    """Patches applied for one owner and restored together, newest first (a context manager; :meth:`restore`
    may also be called directly, once or more)."""

    def __init__(self, owner: str, during: str | None = None) -> None:
        self.owner, self.during = owner, during
        self._applied: list[Patch] = []

    def apply(self, target: Any, name: str, replacement: Any, owner: str | None = None) -> None:
        """Record ``target.name`` and set it to ``replacement`` (``owner``: who asked, default this scope's)."""
        with _lock:
            patch = Patch(target, name, replacement, owner or self.owner, _own(target, name), self.during)
            setattr(target, name, replacement)
            _ledger.append(patch)
            self._applied.append(patch)

    def patcher(self, owner: str) -> Callable[[Any, str, Any], None]:
        """The ``patch(target, name, value)`` callable a library function takes, recording ``owner``."""
        return functools.partial(self.apply, owner=owner)

    def restore(self) -> None:
        with _lock:
            while self._applied:
                _undo(self._applied.pop())

    def __enter__(self) -> "Scope":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def during(fn: Callable, owner: str, swaps: Callable[[], Iterable[tuple[Any, str, Any]]]) -> Callable:
    """``fn`` wrapped: each call runs with ``swaps()`` (``(target, name, value)`` triples) applied through the
    ledger under ``owner`` and restored when it returns or raises."""
    label = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with Scope(owner, during=label) as scope:
            for target, name, value in swaps():
                scope.apply(target, name, value)
            return fn(*args, **kwargs)

    wrapper.ledger_during = (owner, label, swaps)  # type: ignore[attr-defined]
    return wrapper


def list_patches() -> tuple[Patch, ...]:
    """The patches applied now, oldest first."""
    with _lock:
        return tuple(_ledger)


def during_calls() -> list[Patch]:
    """The patches each applied :func:`during` wrapper applies while it runs (not applied now)."""
    out = []
    for patch in list_patches():
        owner, label, swaps = getattr(patch.replacement, "ledger_during", (None, None, None))
        if owner is not None and patch.during is None:
            out += [Patch(target, name, value, owner, during=label) for target, name, value in swaps()]
    return out


def describe() -> list[str]:
    """One line per patch, applied now and during calls: ``target.attribute  by owner[, during call]``."""
    rows = [(f"{p.where}.{p.name}", p.owner + (f", during {p.during}" if p.during else ""))
            for p in (*list_patches(), *during_calls())]
    width = max((len(r[0]) for r in rows), default=0)
    return [f"{what:<{width}}  by {who}" for what, who in rows]


def snapshot(targets: Iterable[Any]) -> dict[int, tuple[Any, dict[str, Any]]]:
    """The names each target holds itself, for :func:`changed_outside`."""
    return {id(t): (t, dict(vars(t))) for t in targets}


def changed_outside(before: dict[int, tuple[Any, dict[str, Any]]]) -> list[str]:
    """``target.name`` for every name bound, rebound or removed since ``before`` that no applied patch holds."""
    held = {(id(p.target), p.name) for p in list_patches()}
    out = []
    for key, (target, names) in before.items():
        now = vars(target)
        out += [f"{_where(target)}.{n}" for n in names.keys() | now.keys()
                if names.get(n, ABSENT) is not now.get(n, ABSENT) and (key, n) not in held]
    return sorted(out)
