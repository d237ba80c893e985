"""Which call's backward each rank runs, compared on the backward ring (:class:`BackwardTag`).

Ranks whose forwards were alike (the forward ring's status compares them, :mod:`.status`) may run their
backward passes in another order (rank 0 backpropagates call A while rank 1 backpropagates B, both of one signature:
two alike layers), and the ring would then add one call's gradients with another's K/V, silently. Each forward ring
is numbered on its transport (``Transport.forward_rings``, alike on every rank whose calls are in step), and the
backward ring's K/V carry, in the status element of their first piece, a value of the call's tag and that number
(one of :data:`BACKWARD_CYCLE` values per tag, :func:`backward_values`: copied from a device pattern made once per
signature, by the launch that writes the K/V into the wire). Each rank records the element of every block that
visits it (by the step's gradient adds, on CUDA in the same launch) and compares them with its own value: at the
end of the backward ring where host reads are free (every rank raises there), else (CUDA) by a host copy read with
the NEXT forward ring's codes (at the start of its backward; no synchronisation of its own), so every rank raises
there, one step late (the wrong gradients may have been applied by then: the error says so). Not compared: a
backward captured in a CUDA graph, and calls whose forward numbers differ by a multiple of :data:`BACKWARD_CYCLE`
(and agree in tag). A ring that a window shortens carries the values the remaining hops (:meth:`BackwardTag.spread`,
one small exchange per dropped step, as the forward's codes). Not caught here: reentrant activation checkpointing,
whose backward recomputes the forward in a NEW forward ring (numbered alike on every rank), so ranks recomputing
different calls agree in number; their tags differ only where the calls carry a ``call_id`` (the Megatron layers
pass their layer numbers), and then that forward ring's status raises (docs/design.md, "Cross-rank consistency").
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_ring.core.status import OK, defer, spread_codes, tag_value, values_of
from megatron_ring.device import ops_for
from megatron_ring.errors import RingInputError
from megatron_ring.schedules.on_device import cached_on

__all__ = ["BACKWARD_CYCLE", "BackwardTag", "backward_pattern", "backward_values", "raise_for_backward"]


#: a backward ring's status takes one of this many values per call tag, by its forward ring's number
BACKWARD_CYCLE = 64


@functools.lru_cache(maxsize=64)
def backward_values(tag: int, dtype: torch.dtype) -> tuple[float, ...]:
    """The values a backward ring's status element of ``dtype`` takes for a call tagged ``tag`` (non-zero), by its
    forward ring's number modulo :data:`BACKWARD_CYCLE`: ``tag_value(tag + 1 + i)`` for number ``i`` (distinct)."""
    return tuple(tag_value(tag + 1 + i, dtype) for i in range(BACKWARD_CYCLE))


def backward_pattern(tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`backward_values` on the device, made there once per (tag, dtype, device) by integer arithmetic (four
    launches, no host-to-device copy: it may be made under CUDA-graph capture) and kept."""
    lo, count, bits = values_of(dtype)

    def make() -> torch.Tensor:
        start = (tag + 1) % count
        t = torch.arange(start, start + BACKWARD_CYCLE, dtype=torch.int64, device=device)
        t = t.remainder_(count).add_(lo)
        return t.to(dtype) if bits is None else t.to(bits).view(dtype)

    return cached_on(("backward status", tag, dtype), make, device)  # under capture: held for the process


class BackwardTag:
    """The backward ring's check that every rank runs the backward of the same call (see the module doc).

    ``tag``: the call's (non-zero); ``number``: its forward ring's on the transport; ``dtype``: the wire elements'.
    ``source``: what the status element of the local block's first piece is copied from (a view of the pattern,
    made once per signature); :meth:`receipt` records a visiting block's; :meth:`settle` judges them after the
    ring."""

    def __init__(self, ring: Any, tag: int, number: int, dtype: torch.dtype, device: torch.device,
                 shortened: bool = False) -> None:
        """``shortened``: a window shortens the ring (fewer steps than ranks): the values are carried the remaining
        hops after it (:meth:`spread`), so the vector starts as zeros (unknown) with this rank's own value."""
        self.ring = ring
        i = number % BACKWARD_CYCLE
        self.fine = tag_value(tag + 1 + i, dtype)  # backward_values(tag, dtype)[i], without making the other 63
        self.source = backward_pattern(tag, dtype, device)[i:i + 1]
        self.codes = torch.empty(ring.world, dtype=dtype, device=device)
        self.received: list[int] = []
        if shortened:
            self.codes.zero_()
            self.codes[ring.rank:ring.rank + 1].copy_(self.source)

    def receipt(self, src: int, elem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dst, elem)`` to copy (:meth:`~.status.RingStatus.receipt`): the status element ``elem`` of the block
        of group rank ``src``; on CUDA copied by the step's gradient adds (core/accumulators.py: ``add_all``)."""
        self.received.append(src)
        return self.codes[src:src + 1], elem

    def spread(self, steps: int) -> None:
        """After a backward ring of ``steps < P`` steps (a window dropped the others): carry the values the
        ``P - steps`` hops the K/V did not travel, as :meth:`~.status.RingStatus.spread` does the forward's
        codes (channel ``bwd_status``; each entry is one rank's own value or 0, so the maximum merges what two
        ranks know), so every rank compares every rank's. Without it a rank out of a diverged rank's reach got
        that rank's wrong dK/dV back, silently (found by randomized testing)."""
        spread_codes(self.ring, self.codes, steps, "bwd_status")
        self.received = [r for r in range(self.ring.world) if r != self.ring.rank]

    def settle(self) -> None:
        """After the backward ring (complete: an error here leaves it in step): raise where host reads are free;
        on CUDA leave a host copy to the next forward ring's check (:meth:`~.status.PendingChecks.adopt`). A
        backward captured in a CUDA graph is not checked (a host decision would not replay)."""
        if not self.received:
            return
        ops = ops_for(self.codes.device)
        if ops.capturing(self.codes.device):
            return
        judge = functools.partial(raise_for_backward, ring=self.ring, received=tuple(self.received), fine=self.fine)
        if ops.host_reads_free:
            judge(self.codes.tolist())
            return
        host, event = ops.to_host(self.codes)
        defer(self.ring, (host, event, ops, judge))


def raise_for_backward(codes: list[float], ring: Any, received: tuple[int, ...], fine: float) -> None:
    """Raise :class:`RingInputError` on a rank whose backward ring brought the K/V of another call than its own
    (``codes``: per group rank, the status value its block carried, read at ``received``). A code 0 is not
    compared (as in :func:`~.status.raise_for`; a host copy of a fake device's codes reads 0)."""
    other = sorted(ring.members[src] for src in received if codes[src] not in (fine, OK))
    if other:
        raise RingInputError(
            f"ring_attention: the ranks of the ring ran the backward of different calls (their forwards were alike, "
            f"their backward passes in another order): global rank(s) {', '.join(map(str, other))} backpropagated "
            f"another call than this rank (global rank {ring.my_global}). The gradients of that backward are wrong on "
            "every rank it reached, and where this is raised after it (CUDA: at the backward of the next call on "
            "this group) anything updated with them is too. Every rank must run the backward passes of its ring "
            "calls in the same order: look for losses or autograd.grad/backward calls that differ between ranks.")
