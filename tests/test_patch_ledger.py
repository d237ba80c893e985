"""The lab's patch ledger (lab/megatron_ring_lab/patches.py) on stand-in modules and classes: every patch is
restored to the original object, newest first, also on an exception; scopes nest and may close out of order; the
list is what was applied; a swap made beside the ledger is found (the negative control)."""
from __future__ import annotations

import threading
import types

import pytest

from megatron_ring_lab import patches


def original(*args):
    return "original"


def replaced(*args):
    return "replaced"


class Base:
    def method(self):
        return "base"


class Child(Base):
    pass


@pytest.fixture
def mod():
    m = types.ModuleType("ledger_target")
    m.fn, m.flag, m.Child = original, False, Child
    yield m
    assert not [p for p in patches.list_patches() if p.target in (m, Child)], "a test left a patch applied"


def _keys(records):
    return [(p.target, p.name) for p in records]


def test_every_patch_is_restored_to_the_original_object(mod):
    before = patches.snapshot([mod, Child])
    with patches.Scope("test") as scope:
        scope.apply(mod, "fn", replaced)
        scope.apply(mod, "flag", True)
        scope.apply(mod, "added", 1)  # a name the module did not have
        scope.apply(Child, "method", replaced)  # inherited: Child did not hold it itself
        assert mod.fn is replaced and mod.flag is True and mod.added == 1 and Child().method() == "replaced"
    assert mod.fn is original and mod.flag is False and not hasattr(mod, "added")
    assert "method" not in vars(Child) and Child().method() == "base"
    assert patches.changed_outside(before) == []
    assert {n: v for n, v in vars(mod).items()} == before[id(mod)][1]


def test_restore_on_exception_newest_first(mod):
    order = []

    class Recording(types.ModuleType):
        def __setattr__(self, name, value):
            order.append((name, value))
            super().__setattr__(name, value)

    rec = Recording("recording")
    rec.a = "a0"
    order.clear()
    with pytest.raises(KeyError):
        with patches.Scope("test") as scope:
            scope.apply(rec, "a", "a1")
            scope.apply(rec, "a", "a2")
            scope.apply(mod, "fn", replaced)
            raise KeyError("boom")
    assert mod.fn is original and rec.a == "a0"
    assert order == [("a", "a1"), ("a", "a2"), ("a", "a1"), ("a", "a0")]  # applied, then undone newest first


def test_scopes_nest_and_may_close_out_of_order(mod):
    outer, inner = patches.Scope("outer"), patches.Scope("inner")
    outer.apply(mod, "fn", replaced)
    inner.apply(mod, "fn", Base)
    assert mod.fn is Base and [p.owner for p in patches.list_patches() if p.target is mod] == ["outer", "inner"]
    outer.restore()  # closed first although opened first: the inner patch now restores to the true original
    assert mod.fn is Base
    inner.restore()
    assert mod.fn is original
    inner.restore()  # restoring twice is harmless
    assert mod.fn is original


def test_list_matches_what_was_applied_and_who_asked(mod):
    with patches.Scope("owner") as scope:
        scope.apply(mod, "fn", replaced)
        patch = scope.patcher("library function")  # what a library function that takes `patch` is handed
        patch(mod, "flag", True)
        mine = [p for p in patches.list_patches() if p.target is mod]
        assert _keys(mine) == [(mod, "fn"), (mod, "flag")]
        assert [(p.replacement, p.original, p.owner, p.where) for p in mine] == [
            (replaced, original, "owner", "ledger_target"), (True, False, "library function", "ledger_target")]
        assert any(line.split() == ["ledger_target.flag", "by", "library", "function"] for line in patches.describe())
    assert not [p for p in patches.list_patches() if p.target is mod]


def test_during_applies_only_while_the_call_runs(mod):
    seen = []

    def call(x):
        seen.append((mod.fn, [p.during for p in patches.list_patches() if p.target is mod]))
        if x < 0:
            raise ValueError(x)
        return x

    wrapped = patches.during(call, "test", lambda: [(mod, "fn", replaced)])
    with patches.Scope("outer") as scope:
        scope.apply(mod, "call", wrapped)
        assert [(p.target, p.name, p.during) for p in patches.during_calls() if p.target is mod] == [
            (mod, "fn", call.__qualname__)]
        assert wrapped(1) == 1 and mod.fn is original
        with pytest.raises(ValueError):
            wrapped(-1)
        assert mod.fn is original
    assert seen == [(replaced, [None, call.__qualname__])] * 2  # mod.call for the scope, mod.fn for the call


def test_a_swap_beside_the_ledger_is_found(mod):
    """The negative control: rebinding a name without the ledger is reported; the ledger's own are not."""
    before = patches.snapshot([mod, Child])
    with patches.Scope("test") as scope:
        scope.apply(mod, "fn", replaced)
        assert patches.changed_outside(before) == []
        mod.flag = True  # deliberately unrecorded
        Child.extra = 1
        assert patches.changed_outside(before) == ["ledger_target.flag", f"{__name__}.Child.extra"]
        mod.flag = False
        del Child.extra
    assert patches.changed_outside(before) == []


def test_threads_patching_side_by_side(mod):
    names = [f"n{i}" for i in range(8)]
    barrier = threading.Barrier(len(names))

    def worker(name):  # every thread rebinds mod.fn too: scopes on one name close in any order
        barrier.wait()
        for _ in range(200):
            with patches.Scope(name) as scope:
                scope.apply(mod, name, name)
                scope.apply(mod, "fn", name)
    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mod.fn is original and not any(hasattr(mod, n) for n in names)
