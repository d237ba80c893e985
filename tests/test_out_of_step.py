"""A ring left in its middle: an error raised between a ring's exchanges (after the first was launched, before the
last completed) leaves messages its neighbours sent and it never received, or ones they wait for, and a later
call on the same ring would take them as its own K/V: a silent wrong answer. The transport is marked instead, and
every later call on it raises :class:`RingOutOfStepError` before any exchange. An error raised before a ring's
first exchange (a refused double backward, a rank's refused input) leaves the ring usable.

Each rank is a thread of one ThreadRing (tests/helpers/ring_fakes.py); the error mid-ring is injected into the
forward's block step (every rank, at step 1 of 3). Negative control: without the mark, the next call returns wrong
gradients and no error.

The two misuses of a call's backward that used to fail inside the backward ring with torch's own errors (one of
which left the ring out of step) are refused by name before its first exchange: a double backward
(``create_graph=True``), and q, k or v changed in place between the call and its backward."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_ring import RingOutOfStepError, RingPeerError, ring_attention
from megatron_ring.core import engine
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.ring_fakes import run_threads

P, S = 3, 24


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, S, 4, 8, generator=g) for _ in range(4)]  # q, k, v, dout


POS = [get_layout("zigzag").positions(S, P, r) for r in range(P)]


def _call(rank, ring, seed: int):
    q, k, v, dout = _inputs(seed)
    leaves = [t[:, POS[rank]].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, ring=ring, causal=True)
    out.backward(dout[:, POS[rank]])
    return [out.detach(), *(t.grad for t in leaves)]


def _fails_at_step_1(monkeypatch) -> None:
    """The forward's block step raises at step 1 once on every rank (the next block's exchange is in flight)."""
    step_of = engine._forward_step
    fired: set[int] = set()

    def step(q, kt, vt, plan, step, *a, **kw):
        if step == 1 and plan.ring.rank not in fired:
            fired.add(plan.ring.rank)
            raise RuntimeError("injected failure at step 1")
        return step_of(q, kt, vt, plan, step, *a, **kw)

    monkeypatch.setattr(engine, "_forward_step", step)


def _after(first) -> list:
    """Per rank: the error of ``first(rank, ring)``, then the result (or error) of a clean call on the same ring."""
    def body(rank, ring):
        try:
            first(rank, ring)
            raised = None
        except Exception as exc:  # noqa: BLE001 - reported
            raised = exc
        try:
            return raised, _call(rank, ring, seed=1)
        except Exception as exc:  # noqa: BLE001 - reported
            return raised, exc

    return run_threads(body, P)


def test_a_call_after_an_error_mid_ring_raises_out_of_step(monkeypatch):
    _fails_at_step_1(monkeypatch)
    for rank, (raised, then) in enumerate(_after(lambda rank, ring: _call(rank, ring, seed=0))):
        assert isinstance(raised, RuntimeError) and "injected failure" in str(raised), (rank, raised)
        assert isinstance(then, RingOutOfStepError) and isinstance(then, RingPeerError), (rank, then)
        text = str(then)
        assert "raised in the middle of its forward ring" in text and "injected failure at step 1" in text, text
        assert "Recreate the context-parallel process group" in text


def test_an_error_before_the_first_exchange_leaves_the_ring_usable():
    """A refused double backward raises at its backward's start on every rank: the next call is the clean one."""
    def first(rank, ring):
        q, k, v, dout = _inputs(0)
        leaves = [t[:, POS[rank]].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, ring=ring, causal=True, comm_dtype="bf16")
        torch.autograd.grad(out, leaves, dout[:, POS[rank]], create_graph=True)

    clean = run_threads(lambda rank, ring: _call(rank, ring, seed=1), P)
    for rank, (raised, then) in enumerate(_after(first)):
        assert isinstance(raised, RuntimeError) and "double backward is not supported" in str(raised), raised
        assert not isinstance(then, BaseException), (rank, then)
        assert all(torch.equal(a, b) for a, b in zip(then, clean[rank])), rank


def test_without_the_mark_the_next_call_is_silently_wrong(monkeypatch):
    """Negative control: the ring not marked (one_ring a plain block), the next call takes the stale messages."""
    monkeypatch.setattr(engine, "one_ring", lambda ring, which: contextlib.nullcontext())
    clean = run_threads(lambda rank, ring: _call(rank, ring, seed=1), P)
    _fails_at_step_1(monkeypatch)
    after = _after(lambda rank, ring: _call(rank, ring, seed=0))
    assert all(not isinstance(then, BaseException) for _, then in after), after  # no error ...
    assert any(not torch.allclose(a, b, atol=1e-4) for (_, then), want in zip(after, clean)
               for a, b in zip(then, want))  # ... and wrong results


@pytest.mark.parametrize("world", [1, 2])
def test_double_backward_is_refused_by_name(world):
    """create_graph=True: a named error at the backward's start on every rank (torch's own errors came from the
    middle of the backward ring before, a different one per wire and P); no input gradient is touched."""
    def body(rank, ring):
        q, k, v, dout = _inputs(0)
        leaves = [t[:, :S // world].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, ring=ring if world > 1 else None, causal=True)
        with pytest.raises(RuntimeError, match="double backward is not supported") as info:
            torch.autograd.grad(out, leaves, dout[:, :S // world], create_graph=True)
        return str(info.value)

    results = run_threads(body, world)
    assert all(isinstance(r, str) and "create_graph=True" in r for r in results), results


def test_an_input_changed_in_place_before_the_backward_is_named():
    """q, k or v changed in place between the call and its backward: an error naming it (torch's own names the
    views the forward made in no-grad mode); a clone changed instead is fine."""
    def body(rank, ring):
        q, k, v, dout = _inputs(0)
        leaves = [t[:, POS[rank]].clone().requires_grad_() for t in (q, k, v)]
        ins = [t * 1 for t in leaves]
        out = ring_attention(*ins, ring=ring, causal=True)
        ins[2].mul_(2)
        with pytest.raises(RuntimeError, match="modified in place after the call and before its backward"):
            out.backward(dout[:, POS[rank]])
        return True

    assert run_threads(body, P) == [True] * P


def _collective_worker(rank: int, world: int, comm_type: str, mark: bool) -> list[str]:
    """Three calls; rank 2's kernel raises in the second (after the call's first collective): the names of what
    each call raised on this rank. ``mark`` False: the negative control, the guard left out (no mark)."""
    import time

    from megatron_ring import shard_sequence
    from megatron_ring.kernels.block import MathKernel
    from megatron_ring.strategies import refusal

    if not mark:
        engine.one_ring = lambda ring, which: contextlib.nullcontext()
        import megatron_ring.strategies as strategies

        strategies.one_ring = engine.one_ring
        refusal.StrategyStatus._wait = lambda self, pending, which: pending.wait()
    q = shard_sequence(torch.randn(1, 32, 4, 8, generator=torch.Generator().manual_seed(0)), 1)
    got = []
    for call in range(3):
        if call == 1 and rank == 2:
            MathKernel.forward = lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("injected failure"))
        try:
            ring_attention(q, q, q, causal=True, comm_type=comm_type, kernel="math", timeout_s=4.0)
            got.append("ok")
        except Exception as e:  # noqa: BLE001 - the test reads the type
            got.append(type(e).__name__)
        if call == 1:
            MathKernel.forward = _MATH_FORWARD
            time.sleep(6)  # every rank's second call has ended (the others by their timeout)
    return got


from megatron_ring.kernels.block import MathKernel as _MathKernel  # noqa: E402

_MATH_FORWARD = _MathKernel.forward


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["a2a", "all_gather"])
def test_a_collective_left_in_its_middle_marks_the_group_out_of_step(comm_type):
    """The other comm types: a rank raising after its call's first collective leaves the group's collectives out
    of step (the others wait for it and time out); every later call raises RingOutOfStepError on every rank before
    any collective. Before, the next call's collectives were matched with the stale ones: gloo aborted the
    processes (sizes that differ), or every later call timed out. Negative control: without the mark, the third
    call is not refused by name on every rank."""
    from tests.helpers.launch import run_distributed

    got = run_distributed(_collective_worker, 4, comm_type, True, timeout=120)
    assert all(r[0] == "ok" and r[1] != "ok" and r[2] == "RingOutOfStepError" for r in got), got
    control = run_distributed(_collective_worker, 4, comm_type, False, timeout=120, return_exceptions=True)
    assert not all(isinstance(r, list) and r[2] == "RingOutOfStepError" for r in control), control
