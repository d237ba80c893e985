"""The CPU harness through the lab's patch ledger: inside ``megatron_cpu()`` exactly the ledger's attributes differ
from Megatron's (nothing changed beside it), on exit every one is Megatron's own object again (also on an
exception, and when the opt-in fails half-way), the enable/disable pairs nest, a swap made beside the ledger is
found (the negative control), and ``python -m megatron_ring_lab.cpu --list-patches`` prints the ledger."""
from __future__ import annotations

import pytest

from megatron_ring_lab import patches
from megatron_ring_lab.cpu import cpu_support_enabled, disable_cpu_support, enable_cpu_support, megatron_cpu


def _harness():
    return [p for p in patches.list_patches() if p.owner.startswith("cpu.")]


@pytest.fixture(scope="module")
def targets():
    """Every object the opt-in patches on this install (entered once, so its imports are done)."""
    with megatron_cpu():
        found = {id(p.target): p.target for p in _harness()}
    assert found and not _harness()
    return list(found.values())


def _changed(before):
    return {(key, name) for key, (target, names) in before.items() for name in names.keys() | vars(target).keys()
            if names.get(name, patches.ABSENT) is not vars(target).get(name, patches.ABSENT)}


def test_inside_exactly_the_ledger_differs_and_on_exit_everything_is_megatrons_again(targets):
    before = patches.snapshot(targets)
    with megatron_cpu():
        applied = _harness()
        held = {(id(p.target), p.name) for p in applied}
        assert _changed(before) <= held and patches.changed_outside(before) == []
        # the list matches what was applied: each entry's attribute holds its replacement (Megatron's RNG
        # tracker state is the ledger's to restore; Megatron itself built the CPU tracker into it)
        state = {"_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"}
        assert all(getattr(p.target, p.name) is p.replacement for p in applied if p.name not in state)
        assert {p.owner for p in applied} >= {"cpu.core", "cpu.thd_partitioner"}
    assert not _changed(before), sorted(_changed(before))
    for p in applied:  # each recorded original is what the attribute holds again
        assert vars(p.target).get(p.name, patches.ABSENT) is p.original, (p.where, p.name)


def test_a_swap_beside_the_ledger_is_found(targets):
    """The negative control: an attribute of a patched module rebound without the ledger is reported by name."""
    from megatron.core.tensor_parallel import random as mrandom

    before = patches.snapshot(targets)
    with megatron_cpu():
        own = mrandom.get_cuda_rng_tracker
        mrandom.get_cuda_rng_tracker = lambda: None  # deliberately unrecorded
        try:
            assert patches.changed_outside(before) == ["megatron.core.tensor_parallel.random.get_cuda_rng_tracker"]
        finally:
            mrandom.get_cuda_rng_tracker = own
        assert patches.changed_outside(before) == []


def test_enable_disable_pairs_nest_on_one_ledger_scope(targets):
    before = patches.snapshot(targets)
    enable_cpu_support()
    first = _harness()
    enable_cpu_support()
    with megatron_cpu():
        assert _harness() == first  # nested opt-ins apply nothing more
    disable_cpu_support()
    assert cpu_support_enabled() and _harness() == first
    disable_cpu_support()
    assert not cpu_support_enabled() and not _harness() and not _changed(before)
    with pytest.raises(RuntimeError, match="without a matching"):
        disable_cpu_support()


def test_restored_on_an_exception_and_when_the_opt_in_fails_half_way(targets, monkeypatch):
    before = patches.snapshot(targets)
    with pytest.raises(KeyError):
        with megatron_cpu():
            raise KeyError("inside")
    assert not cpu_support_enabled() and not _harness() and not _changed(before)

    from megatron_ring_lab.cpu import ssm

    def broken(patch):
        raise RuntimeError("half-way")

    monkeypatch.setattr(ssm, "install", broken)  # after the core's and the THD partitioner's patches
    with pytest.raises(RuntimeError, match="half-way"):
        enable_cpu_support()
    assert not cpu_support_enabled() and not _harness() and not _changed(before)


def test_list_patches_cli_prints_the_ledger_and_leaves_nothing_applied(capsys):
    from megatron_ring_lab.cpu.cli import main

    main(["--list-patches"])
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0], lines[1:]
    applied, during = (int(w) for w in header.split() if w.isdigit())
    assert len(rows) == applied + during > 0
    assert all(" by cpu." in row for row in rows), rows
    assert any(row.split()[:3] == ["megatron.core.utils.GlobalMemoryBuffer.get_tensor", "by", "cpu.core"]
               for row in rows)
    assert not _harness() and not cpu_support_enabled()
