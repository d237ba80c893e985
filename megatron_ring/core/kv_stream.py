"""The visiting K/V blocks of a ring (:class:`KVStream`): the local block written into its wire slot, the pieces
passed on and received through :class:`~megatron_ring.core.rotation.Rotation`, decoded, and the ranks' status
carried beside them (:mod:`.status`)."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

import torch

from megatron_ring import breakdown
from megatron_ring.core.buffers import POOL
from megatron_ring.core.foreach import foreach_into
from megatron_ring.core.heads import head_groups
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.rotation import Rotation
from megatron_ring.core.backward_check import BackwardTag
from megatron_ring.core.status import RingStatus, payload_of, status_buffers, status_elem
from megatron_ring.core.views import covers
from megatron_ring.wire.codecs import KVCodec, KVSpec

__all__ = ["KVStream"]


class KVStream:
    """The visiting K/V blocks, in ``n`` pieces of K/V heads, with the next block's pieces in flight
    (:class:`~megatron_ring.core.rotation.Rotation`: ``n + 1`` piece slots instead of two whole blocks).

    ``refusal``: this rank's input was refused; its pieces go out marked with a failing status
    (:class:`~megatron_ring.core.status.RingStatus`), the same messages in the same order.
    ``status``: whether this stream carries the ranks' status codes (the forward ring); the backward
    ring's K/V are the ones its forward ring checked, so it sends them without; ``backward``: this is a backward
    ring, whose first piece's status element says which call's backward it is (``backward``, a
    :class:`~megatron_ring.core.backward_check.BackwardTag`, where the call is checked across ranks), recorded
    from every visiting block.

    The slots are one :class:`~megatron_ring.core.buffers.SlotSet` from the pool: the views made of a slot
    (decoded K, V where decoding makes views; the status element) are made once per set, not per ring."""

    def __init__(self, plan: RingPlan, k: torch.Tensor, v: torch.Tensor, channel: str, n: int,
                 steps: int, refusal: BaseException | None = None, status: bool = True,
                 flips: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (), backward: bool = False) -> None:
        """``flips``: ``(dst, src)`` pairs also copied, -inf made +inf, by the launch that writes the K/V into the
        wire (a variable-length kernel's lse); ``flipped`` says whether it did (else the caller copies them)."""
        self.plan, self.k, self.v, self.steps = plan, k, v, steps
        self.flipped = False
        self.heads = head_groups(k.shape[1], n)
        b, h_kv, s, d = k.shape
        hj = h_kv // n
        self.spec = KVSpec((b, hj, s, d), (b, hj, s, v.shape[-1]), k.dtype, k.device)
        #: the local block's pieces (step 0)
        self.local = [(k, v) if covers(hs, h_kv) else (k[:, hs], v[:, hs]) for hs in self.heads]
        self.rot: Rotation | None = None
        self.status: RingStatus | None = None
        #: the backward ring's check of which call each rank backpropagates (``backward``: a backward ring; a call
        #: checked across ranks, numbered by its forward)
        self.backward: BackwardTag | None = None
        self._receipts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._exact = False
        if plan.ring.world > 1:
            self.slots = status_buffers(plan.codec, self.spec, n + 1)
            self._views = self.slots.views
            self.rot = Rotation(plan.ring, self.slots.buffers, channel)
            # decoding makes views of the slot (the identity wire): they follow its contents, made once per set
            self._exact = _decodes_to_views(plan.codec, self.spec)
            cur = self.rot.cur[:n]
            raws = [self.rot.slots[slot] for slot in cur]
            fused = self._exact and not plan.codec.checks_values  # K/V written by one foreach_into
            if status:
                self.status = RingStatus(plan.ring, plan.codec, k.device, raws[0].dtype, refusal=refusal,
                                         backward_follows=plan.checks.backward_follows, tag=plan.tag)
                elems = [self._elem(slot) for slot in cur]
                # the same launch writes the status elements and the codes (the status where every piece is OK)
                start = [self.status.codes, *elems]
                start = list(zip(start, self.status.sources(n) if self.status.pattern is not None
                                 else [None] * len(start)))
                writes = self._writes(cur, start) if fused else [None] * n
                # an error is raised after the ring, on every rank
                self.status.encode_pieces(self.local, raws, writes, elems, zeroed=fused)
            else:
                # the first piece's status element says which call's backward this is (written with the K/V)
                if backward and plan.tag and plan.number >= 0:
                    self.backward = BackwardTag(plan.ring, plan.tag, plan.number, raws[0].dtype, k.device,
                                                shortened=steps < plan.ring.world)
                tagged = [(self._elem(cur[0]), self.backward.source)] if self.backward is not None else []
                writes = self._writes(cur, tagged, flips=flips) if fused else [None] * n
                self.flipped = fused and bool(flips)
                for (kj, vj), raw, w in zip(self.local, raws, writes):
                    if w is None:
                        plan.codec.encode_flagged(kj, vj, payload_of(raw))  # checked by the forward: verdict unused
                    else:
                        w(kj, vj)
                if tagged and not fused:
                    tagged[0][0].copy_(tagged[0][1])

    def _writes(self, cur: list[int], status: tuple | list = (), flips: tuple = ()
                ) -> list[Callable[[torch.Tensor, torch.Tensor], None]]:
        """Per piece, its writer for :meth:`RingStatus.encode` where the wire is the identity: the first
        copies EVERY piece's K and V into the decoded views of its slot (the bytes :meth:`KVCodec.encode`
        writes, through views made once), writes the ``status`` pairs ``(dst, src)`` (the codes and the status
        elements; ``src`` None: zeroed) and copies the ``flips`` pairs (-inf made +inf) in one :func:`foreach_into`
        (one launch on CUDA for 4 tensors: one piece and its status), the others do nothing. A failing copy is
        still caught and sent as the status."""
        dsts = [t for slot in cur for t in self._decoded(0, slot)] + [d for d, _ in status] + [d for d, _ in flips]
        srcs = [t for kv in self.local for t in kv] + [x for _, x in status] + [x for _, x in flips]
        flip = [False] * (len(dsts) - len(flips)) + [True] * len(flips)

        def write_all(k: torch.Tensor, v: torch.Tensor) -> None:
            foreach_into(dsts, srcs, flip=flip)

        return [write_all] + [_write_nothing] * (len(cur) - 1)

    def _elem(self, slot: int) -> torch.Tensor:
        """The status element of ``slot`` (its first element; a view made once per set)."""
        key = ("status", slot)
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = status_elem(self.rot.slots[slot])
        return got

    def block(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece ``j`` of the K, V visiting at ``step`` (local tensors at step 0, decoded wire data after).
        Unless this is the last step, the piece is first passed on to the next rank, so that exchange
        overlaps this piece's compute."""
        if self.rot is not None and step + 1 < self.steps:
            self.rot.pass_on(j, step)
        if step == 0:
            # the local piece: as encoded in its slot where that is exact (a view of the slot: the identity
            # wire), as the kernels prefer (dense [b, h, s, d]; a [b, s, h, d] caller's K/V are strided:
            # ~3% slower per CPU flash call, measured), else the caller's K/V
            if self._exact:
                return self._decoded(step, self.rot.cur[j])
            return self.local[j]
        self.rot.arrived(j, step)
        slot = self.rot.cur[j]
        src = (self.plan.ring.rank - step) % self.plan.ring.world
        if self.status is not None:  # recorded by the step's first merge (:meth:`take_receipt`)
            self._receipts[j] = self.status.receipt(src, self._elem(slot))
        elif self.backward is not None and j == 0:  # recorded by the step's gradient adds
            self._receipts[j] = self.backward.receipt(src, self._elem(slot))
        return self._decoded(step, slot)

    def take_receipt(self, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The status of piece ``j``'s visiting block still to record, ``(codes element, status element)``
        (see :meth:`RingStatus.receipt`, :meth:`BackwardTag.receipt`): the caller copies it, in its first merge (or
        its gradient adds) where it has one."""
        return self._receipts.pop(j, None)

    def _decoded(self, step: int, slot: int):
        """K, V decoded from ``slot``; made once per set where decoding makes views of it (the identity
        wire: they follow its contents)."""
        got = self._views.get(slot)
        if got is not None:
            return got
        buf = self.rot.slots[slot]
        with breakdown.section(step, "decode"):
            got = self.plan.codec.decode(payload_of(buf), self.spec)
        if self._exact:
            self._views[slot] = got
        return got

    def advance(self) -> None:
        """The step is over: the next block becomes the visiting one."""
        if self.rot is not None:
            self.rot.advance()

    def release(self, step: int) -> None:
        """Wait for what is in flight, then give the slots back to the pool."""
        if self.rot is not None:
            self.rot.drain(step)
            POOL.give_set(self.slots)
            self.rot = None


@functools.lru_cache(maxsize=64)
def _decodes_to_views(codec: KVCodec, spec: KVSpec) -> bool:
    """Whether ``codec`` decodes a wire buffer of ``spec`` into views of it (decoding changes nothing: the
    identity wire), found once per signature on a meta buffer."""
    meta = replace(spec, device=torch.device("meta"))
    buf = codec.new_buffer(meta)
    return all(t._base is buf for t in codec.decode(buf, meta))


def _write_nothing(k: torch.Tensor, v: torch.Tensor) -> None:
    """A piece's writer where the first piece's writer wrote every piece (:meth:`KVStream._writes`)."""
