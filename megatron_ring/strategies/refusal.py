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
  failing global rank(s); the failing rank raises its own detailed error. A fine rank's code is the call's tag
  (as the ring's, :mod:`megatron_ring.core.status`), so ranks that made different calls are named too.

A value-checking wire codec (FP8 with ``check_finite``, fp16) judges the values ON THE DEVICE
(``KVCodec.encode_flagged``): its verdict joins this rank's code on the device, the refused values travel
as NaN, and only on the failure path does the refusing rank run the host check that names the element.
On CPU the codes are read at once (the host waits there anyway). On CUDA they are read as the ring reads its
own (:class:`~megatron_ring.core.status.PendingChecks`): the forward's stream waits for the gather (the host does
not, :mod:`~megatron_ring.transport.collectives`) and copies the codes to pinned host memory; the layer's backward
reads that copy at its start (a pass-through autograd node), waiting only if the device has not reached the copy
yet (in training it has long since: no host synchronisation). While a CUDA graph is captured the codes are checked
on the device at every replay (a device-side assert). A call whose output needs no gradient reads at the
forward's end where the codec checks values (one read per call, as the ring), and otherwise leaves its check on
the ring for a later call (:func:`~megatron_ring.core.status.defer`, as the ring does).

a2a+p2p quantises on the outer ring the super-blocks that mix the heads of several inner ranks, so a rank
whose own K/V its checking codec would refuse is found before the inner all-to-all (one extra encode of
the local K/V, only with checking codecs; the verdict selects zeros on the device) and sends zeros
instead: the error names the rank the bad values came from.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.wire.codecs import KVCodec
from megatron_ring.errors import WireFiniteError
from megatron_ring.core.autograd import RingAttentionFunction
from megatron_ring.core.plan import RingPlan
from megatron_ring.device import ops_for
from megatron_ring.core.status import (BAD_INPUT, BAD_VALUES, OK, PendingChecks, raise_for, settle_codes,
                                       tag_value)
from megatron_ring.errors import RingInputError, RingPeerError
from megatron_ring.transport.collectives import all_gather

__all__ = ["StrategyStatus", "encode_or_record", "outer_ring", "precheck_kv", "status_of"]


class StrategyStatus:
    """This rank's status during one strategy call, and the end-of-forward agreement on it.

    ``checked``: the pieces a value-checking codec judged on the device (verdict, codec, K, V): the
    verdicts join this rank's code on the device, never read on the host unless some rank failed."""

    def __init__(self, plan: RingPlan, refusal: BaseException | None = None) -> None:
        self.plan = plan
        self.error: BaseException | None = refusal
        self.code = OK if refusal is None else BAD_INPUT
        self.checked: list[tuple[torch.Tensor, KVCodec, torch.Tensor, torch.Tensor]] = []
        self.open = True  # recording until the forward's end (:meth:`settle`); the backward raises as usual

    def record(self, exc: BaseException) -> None:
        if self.error is None:
            self.error, self.code = exc, (BAD_VALUES if isinstance(exc, WireFiniteError) else BAD_INPUT)

    def flag(self, verdict: torch.Tensor, codec: KVCodec, k: torch.Tensor, v: torch.Tensor) -> None:
        """A codec's device verdict on ``k``, ``v`` (True: refused; they travel as NaN)."""
        self.checked.append((verdict, codec, k, v))

    def settle(self, out: torch.Tensor) -> torch.Tensor:
        """All-gather the codes (P numbers); raise on every rank if any is bad (see the module doc)."""
        self.open = False
        ring, codec, ops = self.plan.ring, self.plan.codec, ops_for(out.device)
        fine = tag_value(self.plan.tag, torch.float32)  # the call's tag: ranks that made other calls are named too
        mine = torch.full((1,), float(self.code) if self.code != OK else fine, dtype=torch.float32,
                          device=out.device)
        if self.checked and self.code == OK:  # the device verdicts: BAD_VALUES where any piece was refused
            verdicts = [c[0] for c in self.checked]
            mine.masked_fill_(verdicts[0] if len(verdicts) == 1 else torch.stack(verdicts).any(), BAD_VALUES)
        codes = mine.new_empty(ring.world)
        pending = all_gather(codes, mine, ring, "all-gather of the input status")
        # read now where reads are free, or where this rank already knows it failed (it raises its own error)
        if ops.host_reads_free or self.error is not None:
            self._wait(pending, "forward")
            self._raise(codes)
            return out
        self._wait(pending, "forward")  # the stream waits for the gather; the host does not (collectives.py)
        # as the ring's codes (core/status.py): a host copy read at the start of this layer's backward (long complete
        # by then in training), or by a later call without a backward; read now where no backward will read it and
        # the wire checks values (one read per call); on the device under capture
        checks = PendingChecks() if out.requires_grad else None
        settle_codes(codes, fine, ring, codec, ops, self._explain if self.checked else None,
                     codec.checks_values and not out.requires_grad, checks)
        return out if checks is None else _CheckInBackward.apply(out, checks)

    def _explain(self) -> None:
        """The failure path only: this rank's own K/V were refused on the device; raise the codec's
        host-side error naming the first bad element."""
        for _, codec, k, v in self.checked:
            codec.check_values(k, v)

    def _wait(self, pending: Any, which: str) -> None:
        """The status all-gather's end; where it fails (a peer left the call in its middle, or died) the group's
        collectives are out of step: the transport is marked so (``Transport.abandon``: every later call raises
        ``RingOutOfStepError`` before any exchange)."""
        try:
            pending.wait()
        except RingPeerError as exc:
            self.plan.ring.abandon(exc, which)
            raise

    def _raise(self, codes: torch.Tensor) -> None:
        if self.error is not None:
            raise self.error
        raise_for(codes.tolist(), self.plan.ring, self.plan.codec, self._explain if self.checked else None,
                  tag_value(self.plan.tag, torch.float32))


class _CheckInBackward(torch.autograd.Function):
    """Identity; its backward (the first step of this layer's backward) reads the gathered codes' host copy
    (:class:`~megatron_ring.core.status.PendingChecks`: waits only if the device has not reached the copy)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, checks: PendingChecks) -> torch.Tensor:
        ctx.checks = checks
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.checks.check()
        return grad, None


def status_of(plan: RingPlan | None) -> StrategyStatus | None:
    """The strategy call's status (``plan.strategy_status``, set by ``run_strategy``) while its forward
    runs, else None."""
    status = plan.strategy_status if plan is not None else None
    return status if status is not None and status.open else None


def encode_or_record(plan: RingPlan | None, codec: KVCodec, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> None:
    """Encode ``k``, ``v`` into ``out``. In a strategy call's forward a refusal is recorded (raised on every
    rank after the forward), and a value-checking codec's verdict stays on the device (no host read); in
    its backward the K/V are the ones the forward checked (encoded without a check); outside a strategy
    call (``plan`` None) ``codec.encode`` checks on the host."""
    status = status_of(plan)
    if status is None:
        if plan is not None and plan.strategy_status is not None:  # the backward: checked by the forward
            codec.encode_flagged(k, v, out)
        else:
            codec.encode(k, v, out)
        return
    try:
        verdict = codec.encode_flagged(k, v, out)
    except (ValueError, RuntimeError) as exc:
        status.record(exc)
        return
    if verdict is not None:
        status.flag(verdict, codec, k, v)


def precheck_kv(plan: RingPlan, codec: KVCodec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a2a+p2p: K/V, or zeros when this rank's checking ``codec`` refuses them (decided on the device, no host
    read; recorded, see module doc)."""
    status = status_of(plan)
    if status is None or not codec.checks_values:
        return k, v
    from megatron_ring.wire.codecs import KVSpec  # noqa: PLC0415

    before, seen = status.error, len(status.checked)
    with torch.no_grad():
        encode_or_record(plan, codec, k, v, codec.new_buffer(KVSpec(tuple(k.shape), tuple(v.shape), k.dtype,
                                                                     k.device)))
    if status.error is not before:
        return torch.zeros_like(k), torch.zeros_like(v)
    if len(status.checked) == seen:
        return k, v
    refused = status.checked[-1][0]
    zero = k.new_zeros(())
    return torch.where(refused, zero, k), torch.where(refused, zero, v)


def outer_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, sink: torch.Tensor | None,
               caller: RingPlan) -> torch.Tensor:
    """The engine over a2a's head slice; a refusal its ring reports (after the whole forward ring, on every
    rank of that ring) is recorded, so the output all-to-all still runs on every rank."""
    status = status_of(caller)
    if status is None or plan.ring.world == 1:
        return RingAttentionFunction.apply(q, k, v, plan, sink)
    try:
        return RingAttentionFunction.apply(q, k, v, plan, sink)
    except (WireFiniteError, RingInputError) as exc:
        status.record(exc)
        return q.new_zeros((*q.shape[:3], v.shape[-1]))
