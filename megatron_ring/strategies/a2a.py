"""``a2a`` (Ulysses): all-to-all from sequence shards to head shards, attention over the whole sequence
for a slice of heads, all-to-all back.

After the all-to-all, group rank j holds its query heads ``head_split(h, h_kv, P).q[j]`` (and the K/V
heads they use) for every shard of the sequence, shard i at rows ``[i*s, (i+1)*s)``. Those rows are put in the
sequence's order (:func:`sequence_order`: one ``index_select`` per tensor, none for ``contiguous``), and the
attention over the sequence runs as ONE block of a world-size-1 plan (layout ``contiguous``): one kernel call
forward and one backward, the call's mask (causal, documents, window) over the global positions as they are; the
output goes back to the shards' order.

``a2a+p2p`` does the all-to-all over the inner group and runs the engine's ring over the outer group, with
super-blocks of ``inner`` shards (:class:`~megatron_ring.schedules.views.GroupedView`: for every (query shard i,
key shard j) of two super-blocks the layout's ``block_tasks(causal, P, i, j, s)``, so causal skipping and any
mask a layout puts into its tasks are the ring's) (:mod:`.a2a_p2p`).

Heads (:func:`~megatron_ring.core.heads.head_split`; docs/strategies.md, "Heads"): rank j holds the
contiguous query heads ``split.q[j]``, as even as they go (``h % P`` ranks hold one more: the all-to-alls
then have uneven chunks), and receives exactly the K/V heads those use, ``split.kv[j]``: a K/V head
crosses the wire once per rank that needs it, never more (with ``h_kv < P`` or ``h_kv % P != 0`` some
go to two or more ranks, and their dK/dV are summed in fp32 on the way back). Where a rank's query heads
are not an even GQA grouping of its K/V heads, the K/V heads are repeated locally (not on the wire) and
their gradients summed in fp32. Fewer query heads than ranks is refused
(:class:`~megatron_ring.errors.HeadSplitError`).

Wire codecs: the K/V all-to-all of ``a2a`` carries the codec's format (each block quantised once, by
its owner; a rank's own shard is used as is, as in the ring). Q, O and the gradients travel in the compute dtype (dK/dV in fp32 when replicated).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from megatron_ring.wire.codecs import IdentityCodec, KVCodec, KVSpec
from megatron_ring.transport.ring import LoopbackRing, Ring
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.engine import one_ring
from megatron_ring.core.max_logit import new_row_max
from megatron_ring.core.heads import HeadSplit, check_head_count, head_split
from megatron_ring.transport.collectives import all_to_all
from megatron_ring.schedules.layouts import get_layout
from megatron_ring.schedules.on_device import cached_on
from megatron_ring.schedules.views import GroupedView
from megatron_ring.strategies.refusal import encode_or_record, outer_ring

__all__ = ["run", "run_grouped", "check_heads"]


def check_heads(h: int, world: int, what: str = "comm_type='a2a'") -> None:
    """:class:`~megatron_ring.errors.HeadSplitError` when the ``h`` query heads cannot be split over ``world``."""
    check_head_count(h, world, what)


def _len(sl: slice) -> int:
    return sl.stop - sl.start


class _A2A:
    """The all-to-all group: ``over``, the transport of that group (its ranks, its deadline:
    :mod:`~megatron_ring.transport.collectives`); ``world == 1`` moves nothing."""

    def __init__(self, over: Any, transport: Any = None) -> None:
        self.over, self.world, self.rank = over, over.world, over.rank
        #: the call's transport, marked out of step by an error after a backward's first all-to-all (one_ring)
        self.transport = transport

    def guard(self) -> Any:
        """The backward's :func:`~megatron_ring.core.engine.one_ring` on the call's transport (none: nothing)."""
        return one_ring(self.transport, "backward") if self.transport is not None else contextlib.nullcontext()

    def exchange(self, chunks: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], what: str) -> list[torch.Tensor]:
        """``chunks[j]`` goes to rank j; returns the tensor of ``recv_shapes[i]`` rank i sent (one
        all-to-all of flat chunks, uneven sizes allowed)."""
        if self.world == 1:
            return [chunks[0].reshape(recv_shapes[0])]
        return self.exchange_flat(*_pack(chunks), recv_shapes, what)

    def exchange_split(self, x: torch.Tensor, dim: int, recv_shapes: list[tuple[int, ...]],
                       what: str) -> list[torch.Tensor]:
        """As :meth:`exchange` with chunk j the j-th of ``world`` equal parts of ``x`` along ``dim``, packed in ONE
        copy (a view of ``x`` with the parts leading, made contiguous: none where it is already; a copy per chunk made
        ``world`` launches)."""
        if self.world == 1:
            return [x.reshape(recv_shapes[0])]
        send = x.unflatten(dim, (self.world, x.shape[dim] // self.world)).movedim(dim, 0).contiguous()
        return self.exchange_flat(send.view(-1), [send[0].numel()] * self.world, recv_shapes, what)

    def exchange_flat(self, send: torch.Tensor, in_splits: list[int], recv_shapes: list[tuple[int, ...]],
                      what: str) -> list[torch.Tensor]:
        """As :meth:`exchange`, the chunks already packed one after another in the 1-D ``send``."""
        out_splits = [math.prod(sh) for sh in recv_shapes]
        recv = send.new_empty(sum(out_splits))
        all_to_all(recv, send, self.over, what, in_splits, out_splits).wait()
        return [part.view(sh) for part, sh in zip(recv.split(out_splits), recv_shapes)]


def _pack(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The chunks copied one after another into one 1-D tensor (one copy), and their lengths."""
    sizes = [c.numel() for c in chunks]
    send = chunks[0].new_empty(sum(sizes))
    for c, part in zip(chunks, send.split(sizes)):
        part.view(c.shape).copy_(c)
    return send, sizes


def _seq_to_head(x: torch.Tensor, a2a: _A2A, parts: tuple[slice, ...], what: str) -> torch.Tensor:
    """``[b, H, s, d]`` (sequence shard, all heads) -> ``[b, |parts[me]|, P*s, d]`` (all shards, my heads)."""
    b, h, s, d = x.shape
    mine = _len(parts[a2a.rank])
    shapes = [(b, mine, s, d)] * a2a.world  # i: rank i's shard
    even = all(sl == slice(j * mine, (j + 1) * mine) for j, sl in enumerate(parts)) and h == mine * a2a.world
    recv = (a2a.exchange_split(x, 1, shapes, what) if even
            else a2a.exchange([x[:, sl] for sl in parts], shapes, what))
    return torch.cat(recv, dim=2)


def _head_to_seq(y: torch.Tensor, a2a: _A2A, parts: tuple[slice, ...], what: str) -> list[torch.Tensor]:
    """Inverse of :func:`_seq_to_head`: ``[b, |parts[me]|, P*s, d]`` -> per rank j, this shard of ``parts[j]``."""
    b, _, ps, d = y.shape
    p = a2a.world
    s = ps // p
    return a2a.exchange_split(y, 2, [(b, _len(sl), s, d) for sl in parts], what)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a2a: _A2A, parts: tuple[slice, ...]):
        ctx.a2a, ctx.parts = a2a, parts
        return _seq_to_head(x, a2a, parts, "all-to-all of Q")

    @staticmethod
    def backward(ctx, grad):
        with ctx.a2a.guard():
            return torch.cat(_head_to_seq(grad, ctx.a2a, ctx.parts, "all-to-all of dQ"), dim=1), None, None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, a2a: _A2A, parts: tuple[slice, ...]):
        ctx.a2a, ctx.parts = a2a, parts
        return torch.cat(_head_to_seq(y, a2a, parts, "all-to-all of O"), dim=1)

    @staticmethod
    def backward(ctx, grad):
        with ctx.a2a.guard():
            return _seq_to_head(grad.contiguous(), ctx.a2a, ctx.parts, "all-to-all of dO"), None, None


class KVSeqToHead(torch.autograd.Function):
    """K and V in ONE all-to-all in the codec's wire format: rank j gets the K/V heads ``split.kv[j]``."""

    @staticmethod
    def forward(ctx, k, v, a2a: _A2A, codec: KVCodec, split: HeadSplit, plan: RingPlan | None = None):
        me = a2a.rank
        ctx.a2a, ctx.split = a2a, split
        b, _, s, d = k.shape

        def spec(sl: slice) -> KVSpec:
            return KVSpec((b, _len(sl), s, d), (b, _len(sl), s, v.shape[-1]), k.dtype, k.device)

        sizes = [codec.new_buffer(spec(sl)).numel() for sl in split.kv]  # uninitialised: no cost
        send = codec.new_buffer(spec(split.kv[0])).new_empty(sum(sizes))
        for sl, buf in zip(split.kv, send.split(sizes)):
            encode_or_record(plan, codec, k[:, sl], v[:, sl], buf)  # refused: every rank raises after fwd
        mine = spec(split.kv[me])
        recv = (a2a.exchange_flat(send, sizes, [(sizes[me],)] * a2a.world, "all-to-all of K/V") if a2a.world > 1
                else [send])
        own = split.kv[me]
        blocks = [(k[:, own], v[:, own]) if i == me else codec.decode(recv[i], mine)
                  for i in range(a2a.world)]  # this rank's own shard as is (never through the codec), like p2p
        return torch.cat([x[0] for x in blocks], dim=2), torch.cat([x[1] for x in blocks], dim=2)

    @staticmethod
    def backward(ctx, dk, dv):
        a2a, split = ctx.a2a, ctx.split
        wire = torch.float32 if split.shared else dk.dtype  # a head's gradients from several ranks: fp32 sum
        d = dk.shape[-1]
        both = torch.cat([dk.to(wire), dv.to(wire)], dim=-1)  # one message: [dK | dV] per head (MLA: d_v != d)
        with a2a.guard():
            parts = _head_to_seq(both, a2a, split.kv, "all-to-all of dK/dV")  # per rank j: my shard of kv[j]
        if split.shared:
            back = parts[0].new_zeros((parts[0].shape[0], split.h_kv, *parts[0].shape[2:]))
            for sl, part in zip(split.kv, parts):
                back[:, sl] += part
        else:
            back = torch.cat(parts, dim=1)
        return back[..., :d].to(dk.dtype), back[..., d:].to(dv.dtype), None, None, None, None


def run_grouped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, inner: _A2A,
                outer: Ring, a2a_codec: KVCodec, ring_codec: KVCodec, sink: torch.Tensor | None = None, what: str = "comm_type='a2a'") -> torch.Tensor:
    """All-to-all over ``inner``, then the engine over ``outer`` with super-blocks of ``inner.world`` shards.

    After the all-to-all this rank holds the query heads ``mine`` (inner rank j: ``head_split(...).q[j]``):
    the sink slice and the dropout head numbers follow that slice (the sink's gradient flows back to
    those heads through the slice), and dropout keys on the super-blocks' global positions
    (:meth:`GroupedView.positions`), so the keep/drop decisions are the ring's."""
    split = head_split(qh.shape[1], kh.shape[1], inner.world, what)
    mine = split.q[inner.rank]
    q_h = SeqToHead.apply(qh, inner, split.q)
    k_h, v_h = KVSeqToHead.apply(kh, vh, inner, a2a_codec, split, plan)
    view = GroupedView(plan.layout, inner.world)
    layout, order = view, None
    if outer.world == 1:  # a2a: the whole sequence, as one block in its own order
        layout, order = get_layout("contiguous"), sequence_order(view, q_h.shape[2], qh.device)
        if order is not None:
            q_h, k_h, v_h = (x.index_select(2, order[0]) for x in (q_h, k_h, v_h))
    rows = new_row_max(_len(mine), q_h.shape[2], qh.device) if plan.row_max is not None else None
    outs = []
    for qs, ks in split.runs(inner.rank):  # even GQA groupings of this rank's heads (one, usually)
        heads_plan = RingPlan(ring=outer, layout=layout, causal=plan.causal,
                              scale=plan.scale, kernel=plan.kernel, codec=ring_codec, mask=plan.mask,
                              dropout=plan.heads_dropout(mine.start + qs.start), pieces=plan.pieces,
                              row_max=None if rows is None else rows[qs])
        sink_run = sink[mine][qs] if sink is not None else None
        outs.append(outer_ring(q_h[:, qs], k_h[:, ks], v_h[:, ks], heads_plan, sink_run, plan))
    out_h = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if order is not None:  # back to the shards' order
        out_h = out_h.index_select(2, order[1])
        rows = rows.index_select(1, order[1]) if rows is not None else None
    if rows is not None:
        _rows_home(rows, inner, split, plan.row_max)
    return HeadToSeq.apply(out_h, inner, split.q)


def sequence_order(view: GroupedView, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """a2a: after the all-to-all a rank holds the ``n`` rows of the whole sequence, every shard's one after another;
    ``(order, back)`` on ``device`` (:meth:`GroupedView.sequence_order`): ``x.index_select(2, order)`` puts them in the
    sequence's order, where the attention of a rank's heads is ONE block (one kernel call forward, one backward; before,
    the blocks of every pair of shards, each with its merge: ``P * P``), and ``y.index_select(2, back)`` puts them
    back. None where the shards are in order already (``contiguous``)."""
    host = view.sequence_order(n)
    if host is None:
        return None
    return tuple(cached_on(("sequence_order", i, type(view.base), view.base.name, view.inner, n), lambda t=t: t, device)
                 for i, t in enumerate(host))


def _rows_home(rows: torch.Tensor, inner: _A2A, split: HeadSplit, acc: torch.Tensor) -> None:
    """QK-clip: the max logits of this rank's heads, per row of the inner group's shards ``[h_mine, n*s]``, sent
    home like the output (shard i's rows to inner rank i) and folded into the caller's ``acc [h, s]`` (every
    query head of the caller's own rows): each rank then holds the max over its own queries, as on the ring."""
    with torch.no_grad():
        back = torch.cat(_head_to_seq(rows.view(1, *rows.shape, 1), inner, split.q, "all-to-all of the max logits"),
                         dim=1)
        torch.maximum(acc, back.view(acc.shape), out=acc)


def run(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, hierarchical_groups=None,
        sink: torch.Tensor | None = None) -> torch.Tensor:
    ring = plan.ring
    check_heads(qh.shape[1], ring.world)
    return run_grouped(qh, kh, vh, plan, inner=_A2A(ring, ring),
                       outer=LoopbackRing(1, 0, qh.device), a2a_codec=plan.codec, ring_codec=IdentityCodec(),
                       sink=sink)
