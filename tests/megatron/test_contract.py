"""The Megatron contract (``megatron_ring/megatron/contract.py``) against the installed megatron-core.

Each entry is checked without building a model: its module imported, its target looked up, a signature's
parameters read with ``inspect.signature``, a class's fields from its dataclass fields / attributes / the
``self.<name> =`` of its methods, Megatron-LM's argument names from its parser. A failure names the entry and
what is missing. Entries for ``megatron.training`` where this megatron-core has none (the 0.16.1 wheel), for a
Megatron-LM script module, for another release, or whose module needs a package this install lacks are skipped
saying why. A renamed entry fails by name (the negative controls at the end). Every attribute the lab's CPU
harness replaces is an entry.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import re
import sys
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron_ring.megatron import compat  # noqa: E402
from megatron_ring.megatron.contract import CONTRACT, INTERFACE, KINDS, Entry, counts  # noqa: E402

_USERS = ("glue: ", "lab-cpu: ", "doctor: ")


class Unavailable(Exception):
    """The entry cannot be checked on this install (the reason is the message)."""


def _skip_reason(entry: Entry) -> str | None:
    if entry.releases:
        m = re.fullmatch(r"(<|>=)(\d+)\.(\d+)", entry.releases)
        have = compat.mcore_version()[:2]
        if (have < (int(m[2]), int(m[3]))) != (m[1] == "<"):
            return f"{entry.name}: only on megatron-core {entry.releases} (this is {'.'.join(map(str, have))})"
    root = entry.target.split(".")[0]
    if entry.target.startswith("megatron.training") and not compat.has_megatron_training():
        return f"{entry.name}: this megatron-core has no megatron.training (the 0.16.1 wheel ships none)"
    if root not in ("megatron", "torch") and root not in sys.modules:
        return f"{entry.name}: {root} is a Megatron-LM script module, not loaded here (the glue never imports it)"
    return None


def resolve(target: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                continue  # not a module (or the module is gone): try the shorter prefix
            raise Unavailable(f"{module} needs {e.name}, which this install lacks") from e
        for k, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                raise LookupError(f"{'.'.join(parts[:i + k])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module of {target} can be imported")


def _parameters(obj: Any) -> set[str]:
    params = inspect.signature(obj).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _class_fields(cls: type) -> set[str]:
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in cls.__mro__:
        if klass.__module__.startswith("megatron"):
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=", inspect.getsource(klass)))
    return names


@functools.lru_cache(maxsize=None)
def _argument_names(target: str) -> frozenset[str]:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = resolve(target)(parser) or parser
    return frozenset(a.dest for a in parser._actions)


def check(entry: Entry) -> None:
    """Raise AssertionError naming ``entry`` and what this megatron-core lacks; Unavailable if it cannot tell."""
    try:
        obj = resolve(entry.target)
    except LookupError as e:
        raise AssertionError(f"contract entry {entry.name!r}: {entry.target} not found ({e})") from None
    if entry.kind == "attribute":
        have = {n for n in entry.names if hasattr(obj, n)}
    elif entry.kind in ("callable", "hook-arguments"):
        have = _parameters(obj)
    elif entry.kind == "class-field":
        have = _class_fields(obj)
    else:
        have = _argument_names(entry.target)
    missing = [n for n in entry.names if n not in have]
    assert not missing, f"contract entry {entry.name!r}: {entry.target} ({entry.kind}) lacks {', '.join(missing)}"


def test_table_is_well_formed():
    names = [e.name for e in CONTRACT]
    assert len(names) == len(set(names)), "contract entry names repeat"
    for e in CONTRACT:
        assert e.kind in KINDS, f"{e.name}: kind {e.kind!r}"
        assert e.users and all(u.startswith(_USERS) for u in e.users), f"{e.name}: users {e.users}"
        assert e.releases == "" or re.fullmatch(r"(<|>=)\d+\.\d+", e.releases), f"{e.name}: {e.releases!r}"
        assert e.names or e.kind in ("callable", "hook-arguments"), f"{e.name}: names nothing"


@pytest.mark.parametrize("entry", CONTRACT, ids=[e.name for e in CONTRACT])
def test_entry_holds(entry: Entry):
    reason = _skip_reason(entry)
    if reason:
        pytest.skip(reason)
    try:
        check(entry)
    except Unavailable as e:
        pytest.skip(f"{entry.name}: {e}")


def _named(where: str, name: str) -> bool:
    return any(e.target == f"{where}.{name}" or (e.target == where and name in e.names) for e in CONTRACT)


def test_every_patch_of_the_cpu_harness_is_an_entry():
    """What the CPU harness replaces (its ledger while ``megatron_cpu`` is open, with the swaps its wrappers make
    during calls, and the training scope's list) is named by the contract."""
    patches = pytest.importorskip("megatron_ring_lab.patches", reason="the lab is not installed")
    from megatron_ring_lab.cpu import megatron_cpu
    from megatron_ring_lab.cpu.training import REPLACED

    with megatron_cpu():
        applied = [(p.where, p.name) for p in (*patches.list_patches(), *patches.during_calls())]
    assert applied, "the CPU harness applied nothing"
    missing = sorted({f"{w}.{n}" for w, n in (*applied, *REPLACED) if not _named(w, n)})
    assert not missing, "replaced by the CPU harness but not in the contract: " + ", ".join(missing)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _replaced_by_the_glue() -> set[tuple[str, str]]:
    """(module, attribute) pairs the glue replaces: the MTP ``roll_tensor`` wrappers, the THD partitioner's
    stand-in (compat's lists)."""
    out = {(m, "roll_tensor") for m in compat.MTP_ROLL_TENSOR_USERS}
    out |= {(m, n) for m in compat.THD_PARTITIONER_USERS for n in ("tex", "is_te_min_version")}
    return out


def _touches(entry: Entry, where: str, name: str) -> bool:
    return entry.target == f"{where}.{name}" or (entry.target == where and name in entry.names)


def test_interface_entries_are_not_internals():
    """An entry counted as Megatron's interface names nothing private, replaces nothing (neither the glue's
    wrappers nor the CPU harness's ledger), and is no hook; every name of :data:`INTERFACE` is an entry."""
    known = {e.name for e in CONTRACT}
    assert INTERFACE <= known, f"INTERFACE names no entry: {sorted(INTERFACE - known)}"
    replaced = _replaced_by_the_glue()
    patches = None
    try:
        from megatron_ring_lab import patches  # noqa: F811
        from megatron_ring_lab.cpu import megatron_cpu
        from megatron_ring_lab.cpu.training import REPLACED

        with megatron_cpu():
            replaced |= {(p.where, p.name) for p in (*patches.list_patches(), *patches.during_calls())}
        replaced |= set(REPLACED)
    except ImportError:  # the lab is not installed: the glue's own replacements only
        pass
    bad = []
    for e in CONTRACT:
        if e.name not in INTERFACE:
            continue
        private = [p for p in (*e.target.split("."), *e.names) if _private(p)]
        if private:
            bad.append(f"{e.name}: private {', '.join(private)}")
        if e.kind == "hook-arguments":
            bad.append(f"{e.name}: a hook")
        hit = sorted(f"{w}.{n}" for w, n in replaced if _touches(e, w, n))
        if hit:
            bad.append(f"{e.name}: replaces {', '.join(hit)}")
    assert not bad, "contract entries counted as interface but internal:\n" + "\n".join(bad)


def test_interface_rule_can_fail():
    """Negative control: an internal entry put in INTERFACE is caught by the rules above."""
    entry = next(e for e in CONTRACT if e.name == "mtp-roll-tensor")
    where, name = entry.target.rsplit(".", 1)
    assert (where, name) in _replaced_by_the_glue() and _touches(entry, where, name)
    assert _private("_GLOBAL_ARGS") and not _private("__init__")


def test_library_glue_touches_fewer_than_40_internals():
    """Issue 36's target: Megatron internals the library glue relies on, counted as contract entries (a
    function, class, module attribute group or record), under 40. The figures go to docs/design.md."""
    glue = counts("glue")
    print("contract counts:", {u: counts(u) for u in ("glue", "lab-cpu", "doctor")})
    assert glue["internal_entries"] < 40, glue


#: a deliberately renamed copy of one entry per kind: the check must fail naming it
_RENAMED = {
    "attribute": ("rng-tracker", lambda e: e._replace(names=("get_cuda_rng_trackr",))),
    "callable": ("core-attention-init", lambda e: e._replace(names=(*e.names, "attention_dropout_p"))),
    "class-field": ("packed-seq-params", lambda e: e._replace(names=("cu_seqlens_q_padd",))),
    "hook-arguments": ("doctor-model-forward", lambda e: e._replace(names=("input_id",))),
    "target": ("window-attention", lambda e: e._replace(target=e.target + "s")),
}


@pytest.mark.parametrize("what", sorted(_RENAMED))
def test_renamed_entry_fails_by_name(what: str):
    source, rename = _RENAMED[what]
    entry = rename(next(e for e in CONTRACT if e.name == source))._replace(name=f"renamed-{source}")
    with pytest.raises(AssertionError, match=f"contract entry 'renamed-{source}'"):
        check(entry)
