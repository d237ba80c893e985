"""In-band refusal of bad input for the collective strategies (all_gather, a2a, a2a+p2p).

The ring (p2p) carries a status element with every K/V block (:mod:`megatron_ring.core.status`). The
other exchange patterns cannot: a2a+p2p's ring runs over the outer group only and its blocks are mixtures
of several ranks' heads. They share one rule instead:

* a rank whose input fails after the cross-rank check does NOT raise at once. K/V its wire codec refuses
  (:class:`~megatron_ring.wire.codecs.WireFiniteError`) are recorded where they are encoded
  (:func:`encode_or_record`) and the forward goes on; a rank-local input error makes the rank run the
  same strategy forward on zeros (:func:`megatron_ring.strategies.refuse`), so it takes part in every
  collective the other ranks issue;
* at the end of the forward every rank all-gathers one status code over the context-parallel group
  (:class:`StrategyStatus`: P numbers, issued after the output all-to-all or the last gather, i.e. where
  the forward already waits for a collective) and every rank raises the same error type naming the
  failing global rank(s); the failing rank raises its own detailed error.

On CPU and with a value-checking wire codec the codes are read at once (the host waits there anyway).
On CUDA otherwise the gather is waited for at the start of the layer's backward (a pass-through autograd
node), so the forward adds no host synchronisation; as with the ring, a forward-only (inference) call on
CUDA then leaves the check undone.

a2a+p2p quantises on the outer ring the super-blocks that mix the heads of several inner ranks, so a rank
whose own K/V its checking codec would refuse is found before the inner all-to-all (one extra encode of
the local K/V, only with checking codecs) and sends zeros instead: the error names the rank the bad
values came from.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.wire.codecs import KVCodec
from megatron_ring.errors import WireFiniteError
from megatron_ring.core.engine import RingAttentionFunction, RingPlan
from megatron_ring.device import ops_for
from megatron_ring.core.status import BAD_INPUT, BAD_VALUES, OK, raise_for
from megatron_ring.errors import RingInputError
from megatron_ring.transport.deadline import timeout_seconds
from megatron_ring.transport.collectives import all_gather

__all__ = ["StrategyStatus", "encode_or_record", "outer_ring", "precheck_kv", "status_of"]


class StrategyStatus:
    """This rank's status during one strategy call, and the end-of-forward agreement on it."""

    def __init__(self, plan: RingPlan, refusal: BaseException | None = None) -> None:
        self.plan = plan
        self.error: BaseException | None = refusal
        self.code = OK if refusal is None else BAD_INPUT
        self.open = True  # recording until the forward's end (:meth:`settle`); the backward raises as usual

    def record(self, exc: BaseException) -> None:
        if self.error is None:
            self.error, self.code = exc, (BAD_VALUES if isinstance(exc, WireFiniteError) else BAD_INPUT)

    def settle(self, out: torch.Tensor) -> torch.Tensor:
        """All-gather the codes (P numbers); raise on every rank if any is bad (see the module doc)."""
        self.open = False
        ring = self.plan.ring
        mine = torch.full((1,), float(self.code), dtype=torch.float32, device=out.device)
        codes = mine.new_empty(ring.world)
        pending = all_gather(codes, mine, ring.group, timeout_seconds(ring), "all-gather of the input status")
        if ops_for(out.device).host_reads_free or self.plan.codec.checks_values or self.error is not None:
            pending.wait()
            self._raise(codes)
            return out
        return _CheckInBackward.apply(out, (self, pending, codes))

    def _raise(self, codes: torch.Tensor) -> None:
        if self.error is not None:
            raise self.error
        raise_for(codes.tolist(), self.plan.ring, self.plan.codec)


class _CheckInBackward(torch.autograd.Function):
    """Identity; its backward (the first step of this layer's backward) checks the gathered codes."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, check: Any) -> torch.Tensor:
        ctx.check = check
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        status, pending, codes = ctx.check
        pending.wait()
        status._raise(codes)
        return grad, None


def status_of(plan: RingPlan | None) -> StrategyStatus | None:
    """The strategy call's status (``plan.strategy_status``, set by ``run_strategy``) while its forward
    runs, else None."""
    status = plan.strategy_status if plan is not None else None
    return status if status is not None and status.open else None


def encode_or_record(plan: RingPlan | None, codec: KVCodec, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> None:
    """``codec.encode``; in a strategy call a refusal is recorded (raised on every rank after the forward)."""
    status = status_of(plan)
    if status is None:
        codec.encode(k, v, out)
        return
    try:
        codec.encode(k, v, out)
    except (ValueError, RuntimeError) as exc:
        status.record(exc)


def precheck_kv(plan: RingPlan, codec: KVCodec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a2a+p2p: K/V, or zeros when this rank's checking ``codec`` refuses them (recorded; see module doc)."""
    status = status_of(plan)
    if status is None or not codec.checks_values:
        return k, v
    from megatron_ring.wire.codecs import KVSpec  # noqa: PLC0415

    before = status.error
    with torch.no_grad():
        encode_or_record(plan, codec, k, v, codec.new_buffer(KVSpec(tuple(k.shape), tuple(v.shape), k.dtype,
                                                                     k.device)))
    if status.error is not before:
        return torch.zeros_like(k), torch.zeros_like(v)
    return k, v


def outer_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, heads: list[slice],
               sink: torch.Tensor | None, caller: RingPlan) -> torch.Tensor:
    """The engine over a2a's head slice; a refusal its ring reports (after the whole forward ring, on every
    rank of that ring) is recorded, so the output all-to-all still runs on every rank."""
    status = status_of(caller)
    if status is None or plan.ring.world == 1:
        return RingAttentionFunction.apply(q, k, v, plan, heads, sink)
    try:
        return RingAttentionFunction.apply(q, k, v, plan, heads, sink)
    except (WireFiniteError, RingInputError) as exc:
        status.record(exc)
        return q.new_zeros((*q.shape[:3], v.shape[-1]))
