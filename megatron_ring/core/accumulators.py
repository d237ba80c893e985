"""The backward ring's travelling fp32 dK/dV accumulators (:class:`Accumulators`) and the adds of one step into
them (:func:`add_all`)."""
from __future__ import annotations

import torch

from megatron_ring.core.foreach import foreach_into
from megatron_ring.core.foreach_triton import ENTRIES
from megatron_ring.core.rotation import Rotation, start_for
from megatron_ring.transport.ring import Transport

__all__ = ["Accumulators", "add_all"]


class Accumulators:
    """The travelling fp32 dK/dV accumulators: ``n`` pieces (groups of K/V heads) in ``n + 1`` slots of
    ONE tensor ``[slots, h_kv / n, b, s, d_k + d_v]`` (one message per piece: ``[dK | dV]``).

    The slots start where the last hop leaves the pieces in slots ``0..n-1`` in order, so the returned
    dK and dV are views of this tensor (heads outermost), never copies."""

    def __init__(self, ring: Transport, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        b, h_kv, s, self.dk = k.shape
        self.n, self.hj = n, h_kv // n
        #: what the caller zeroes before the first add (with dQ, in one op)
        self.to_zero: list[torch.Tensor] = []
        if ring.world == 1:
            self.all = k.new_empty((1, self.hj, b, s, self.dk + v.shape[-1]), dtype=torch.float32)
            self.rot = None
            self.to_zero.append(self.all)
        else:
            self.all = k.new_empty((n + 1, self.hj, b, s, self.dk + v.shape[-1]), dtype=torch.float32)
            self.rot = Rotation(ring, list(self.all.unbind(0)), "bwd_dkv", start_for(n, ring.world))
            # the own block's pieces start at zero; the free slot is first written by a receive: not zeroed
            spare = self.rot.spare
            self.to_zero += [part for part in (self.all[:spare], self.all[spare + 1:]) if part.shape[0]]
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def views(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """dK, dV of piece ``j`` of the visiting block, as BHSD views ``[b, h_kv / n, s, d]`` (made once
        per slot)."""
        at = self.rot.cur[j] if self.rot is not None else 0
        got = self._views.get(at)
        if got is None:
            slot = self.all[at].permute(1, 0, 2, 3)
            got = self._views[at] = (slot[..., :self.dk], slot[..., self.dk:])
        return got

    def arrived(self, j: int, step: int) -> None:
        if self.rot is not None:
            self.rot.arrived(j, step)

    def pass_on(self, j: int, step: int) -> None:
        if self.rot is not None:
            self.rot.pass_on(j, step)

    def advance(self) -> None:
        if self.rot is not None:
            self.rot.advance()

    def result(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own dK, dV (``[b, h_kv, s, d]`` views), once the last hop is in."""
        if self.rot is not None:
            self.rot.drain(step)
            assert self.rot.cur == list(range(self.n)), self.rot.cur
        whole = self.all[:self.n].reshape(self.n * self.hj, *self.all.shape[2:]).permute(1, 0, 2, 3)
        return whole[..., :self.dk], whole[..., self.dk:]


def add_all(adds: list[tuple[str, slice, torch.Tensor, torch.Tensor]], add: bool = True,
            copies: list[tuple[torch.Tensor, torch.Tensor]] | tuple = ()) -> None:
    """``view.add_(block)`` (``view.copy_(block)`` where not ``add``) for each entry, in as few
    :func:`foreach_into` calls as can be: one, unless two entries overlap in the same accumulator (the pairs of
    one call are updated in parallel, so overlapping ones go to the next call, which keeps each accumulator's
    additions in their order: the same result). ``copies``: ``(dst, src)`` pairs copied too (a backward ring's
    status receipt), in a call with room for them (a launch takes ``ENTRIES`` pairs), else in one of their own."""
    batches: list[list[tuple[torch.Tensor, torch.Tensor, bool]]] = []
    batch: list[tuple[str, slice, torch.Tensor, torch.Tensor]] = []
    for entry in adds:
        name, sl = entry[0], entry[1]
        if any(n == name and sl.start < o.stop and o.start < sl.stop for n, o, _, _ in batch):
            batches.append([(e[2], e[3], add) for e in batch])
            batch = []
        batch.append(entry)
    if batch:
        batches.append([(e[2], e[3], add) for e in batch])
    for dst, src in copies:
        room = next((b for b in batches if len(b) % ENTRIES), None)
        if room is None:
            batches.append(room := [])
        room.append((dst, src, False))
    for b in batches:
        foreach_into([d for d, _, _ in b], [x for _, x, _ in b], add=[a for _, _, a in b])
