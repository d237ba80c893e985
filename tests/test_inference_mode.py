"""``torch.inference_mode()`` calls beside training calls on the same ring (an evaluation loop inside training).

Tensors made under inference mode are inference tensors, which torch lets nothing write outside that mode; the
engine keeps wire buffers across calls (core/buffers.py), so a buffer made by an inference call and handed to a
later training call would fail the training call's first write ("Inplace update to inference tensor outside
InferenceMode"). The pool keeps no inference tensor: the training call after an evaluation gives the same bytes
as one without it (outputs and gradients), and the evaluation's output is the training call's output. The
negative control keeps them, as the pool did, and the training call fails."""
from __future__ import annotations

import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.core.buffers import POOL, BufferPool
from megatron_ring.schedules.layouts import get_layout
from tests.helpers.ring_fakes import run_threads

P, S = 3, 24


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, S, 2, 8, generator=g) for _ in range(4)]  # q, k, v, dout


def _run(evaluate_first: bool, kw: dict):
    q, k, v, dout = _inputs()
    POOL.clear()  # the evaluation makes the ring's buffers (the pool would otherwise hand it earlier calls' ones)
    pos = [get_layout("zigzag").positions(S, P, r) for r in range(P)]

    def body(rank, ring):
        evaluated = None
        if evaluate_first:
            with torch.inference_mode():
                evaluated = ring_attention(q[:, pos[rank]], k[:, pos[rank]], v[:, pos[rank]], ring=ring, **kw)
        leaves = [t[:, pos[rank]].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, ring=ring, **kw)
        out.backward(dout[:, pos[rank]])
        return evaluated, out.detach(), *(t.grad for t in leaves)

    return run_threads(body, P)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False, comm_dtype="bf16", kv_pieces=2)],
                         ids=["causal", "bf16-wire-pieces"])
def test_training_after_an_inference_call_on_the_same_ring(kw):
    plain = _run(False, kw)
    after = _run(True, kw)
    for rank, (want, got) in enumerate(zip(plain, after)):
        assert not isinstance(got, BaseException), (rank, got)
        evaluated, *results = got
        assert torch.equal(evaluated, want[1]), rank  # the evaluation's output is the training call's
        for name, a, b in zip(("out", "dq", "dk", "dv"), want[1:], results):
            assert torch.equal(a, b), (rank, name)


def test_a_pool_that_keeps_inference_tensors_fails_the_training_call(monkeypatch):
    """Negative control: the pool as it was, keeping every buffer given back."""
    keep = BufferPool._keep
    monkeypatch.setattr(BufferPool, "give_set", lambda self, slots: keep(self, slots.key, slots, 16))
    after = _run(True, dict(causal=True))
    assert all(isinstance(r, RuntimeError) and "inference tensor" in str(r) for r in after), after
