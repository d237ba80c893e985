"""``a2a`` (Ulysses): all-to-all from sequence shards to head shards, attention over the whole sequence
for a slice of heads, all-to-all back.

After the all-to-all, group rank j holds query heads ``[j*h/P, (j+1)*h/P)`` (and the K/V heads they
use) for every shard of the sequence, shard i at rows ``[i*s, (i+1)*s)``. The attention over that
sequence is the SAME schedule as the ring: for every (query shard i, key shard j) the layout's
``block_tasks(causal, P, i, j, s)`` (:class:`~megatron_ring.schedules.views.GroupedView`), run by the engine as a
world-size-1 plan; so causal skipping, and any mask a layout puts into its tasks, is the ring's.

``a2a+p2p`` is the same with the all-to-all over the inner group and the engine's ring, with
super-blocks of ``inner`` shards, over the outer group (:mod:`.a2a_p2p`).

Heads: ``h`` must divide by the all-to-all size P. K/V heads are split the same way; when ``h_kv % P``
is not 0 (e.g. ``h_kv < P``) every K/V head is first repeated ``e`` times (``e`` the smallest divisor
of ``h/h_kv`` with ``h_kv*e % P == 0``; GQA grouping is preserved), so the K/V all-to-all moves ``e``
times the bytes; dK/dV of the copies are summed in fp32 on the way back.

Wire codecs: the K/V all-to-all of ``a2a`` carries the codec's format (each block quantised once, by
its owner; a rank's own shard is used as is, as in the ring). Q, O and the gradients travel in the compute dtype (dK/dV in fp32 when replicated).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.wire.codecs import IdentityCodec, KVCodec, KVSpec
from megatron_ring.transport.ring import LoopbackRing, Ring
from megatron_ring.core.engine import RingPlan
from megatron_ring.core.heads import head_groups, kv_replication
from megatron_ring.transport.collectives import all_to_all
from megatron_ring.transport.deadline import timeout_seconds
from megatron_ring.schedules.views import GroupedView
from megatron_ring.strategies.refusal import encode_or_record, outer_ring

__all__ = ["run", "run_grouped", "check_heads"]


def check_heads(h: int, world: int, what: str = "comm_type='a2a'") -> None:
    if h % world:
        raise ValueError(f"{what} splits the {h} attention heads over {world} ranks, but {h} is not divisible "
                         f"by {world}; use comm_type='p2p' or 'all_gather' (or 'a2a+p2p' with an inner "
                         "group size that divides the number of heads)")


class _A2A:
    """The all-to-all group: ``world`` ranks, ``timeout_s``; ``world == 1`` moves nothing."""

    def __init__(self, group: Any, world: int, timeout_s: float | None) -> None:
        self.group, self.world, self.timeout_s = group, world, timeout_s
        self.rank = dist.get_rank(group) if world > 1 else 0

    def exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        if self.world == 1:
            return send
        recv = torch.empty_like(send)
        all_to_all(recv, send, self.group, self.timeout_s, what).wait()
        return recv


def _seq_to_head(x: torch.Tensor, a2a: _A2A, what: str) -> torch.Tensor:
    """``[b, H, s, d]`` (sequence shard, all heads) -> ``[b, H/P, P*s, d]`` (all shards, head slice)."""
    b, hh, s, d = x.shape
    p = a2a.world
    send = x.reshape(b, p, hh // p, s, d).transpose(0, 1).contiguous()  # chunk j: head slice j
    recv = a2a.exchange(send, what)  # chunk i: rank i's shard of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, hh // p, p * s, d)


def _head_to_seq(y: torch.Tensor, a2a: _A2A, what: str) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`: ``[b, H/P, P*s, d]`` -> ``[b, H, s, d]``."""
    b, hp, ps, d = y.shape
    p = a2a.world
    s = ps // p
    send = y.reshape(b, hp, p, s, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk i: shard i
    recv = a2a.exchange(send, what)  # chunk j: head slice j of my shard
    return recv.transpose(0, 1).reshape(b, p * hp, s, d)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a2a: _A2A):
        ctx.a2a = a2a
        return _seq_to_head(x, a2a, "all-to-all of Q")

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.a2a, "all-to-all of dQ"), None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, a2a: _A2A):
        ctx.a2a = a2a
        return _head_to_seq(y, a2a, "all-to-all of O")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.a2a, "all-to-all of dO"), None


class KVSeqToHead(torch.autograd.Function):
    """K and V in ONE all-to-all in the codec's wire format (heads repeated ``rep`` times first)."""

    @staticmethod
    def forward(ctx, k, v, a2a: _A2A, codec: KVCodec, rep: int, plan: RingPlan | None = None):
        ctx.a2a, ctx.rep = a2a, rep
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        b, hk, s, d = k.shape
        p = a2a.world
        spec = KVSpec((b, hk // p, s, d), (b, hk // p, s, v.shape[-1]), k.dtype, k.device)
        one = codec.new_buffer(spec)
        send = one.new_empty(p, one.numel())
        for j in range(p):
            sl = slice(j * hk // p, (j + 1) * hk // p)
            encode_or_record(plan, codec, k[:, sl], v[:, sl], send[j])  # refused: every rank raises after fwd
        recv = a2a.exchange(send, "all-to-all of K/V")
        me = slice(a2a.rank * hk // p, (a2a.rank + 1) * hk // p)
        blocks = [(k[:, me], v[:, me]) if i == a2a.rank else codec.decode(recv[i], spec)
                  for i in range(p)]  # this rank's own shard as is (never through the codec), like p2p
        return torch.cat([x[0] for x in blocks], dim=2), torch.cat([x[1] for x in blocks], dim=2)

    @staticmethod
    def backward(ctx, dk, dv):
        a2a, rep = ctx.a2a, ctx.rep
        wire = torch.float32 if rep > 1 else dk.dtype  # copies of a head are summed in fp32
        d = dk.shape[-1]
        both = torch.cat([dk.to(wire), dv.to(wire)], dim=-1)  # one message: [dK | dV] per head (MLA: d_v != d)
        back = _head_to_seq(both, a2a, "all-to-all of dK/dV")  # [b, h_kv, s, d + d_v]
        dk_s, dv_s = back[..., :d], back[..., d:]
        if rep > 1:
            b, hk, s, _ = back.shape
            dk_s = dk_s.reshape(b, hk // rep, rep, s, d).sum(2).to(dk.dtype)
            dv_s = dv_s.reshape(b, hk // rep, rep, s, dv.shape[-1]).sum(2).to(dv.dtype)
        return dk_s, dv_s, None, None, None, None


def run_grouped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, inner: _A2A,
                outer: Ring, a2a_codec: KVCodec, ring_codec: KVCodec, head_chunks: int,
                sink: torch.Tensor | None = None) -> torch.Tensor:
    """All-to-all over ``inner``, then the engine over ``outer`` with super-blocks of ``inner.world`` shards.

    After the all-to-all this rank holds the query heads ``mine`` (inner rank j: ``[j h/n, (j+1) h/n)``):
    the sink slice and the dropout head numbers follow that slice (the sink's gradient flows back to
    those heads through the slice), and dropout keys on the super-blocks' global positions
    (:meth:`GroupedView.positions`), so the keep/drop decisions are the ring's."""
    rep = kv_replication(qh.shape[1], kh.shape[1], inner.world)
    hp = qh.shape[1] // inner.world
    mine = slice(inner.rank * hp, (inner.rank + 1) * hp)
    q_h = SeqToHead.apply(qh, inner)
    k_h, v_h = KVSeqToHead.apply(kh, vh, inner, a2a_codec, rep, plan)
    drop = plan.heads_dropout(mine.start)
    heads_plan = RingPlan(ring=outer, layout=GroupedView(plan.layout, inner.world), causal=plan.causal,
                          scale=plan.scale, kernel=plan.kernel, codec=ring_codec, mask=plan.mask, dropout=drop,
                          pieces=plan.pieces)
    out_h = outer_ring(q_h, k_h, v_h, heads_plan, head_groups(k_h.shape[1], head_chunks),
                       sink[mine] if sink is not None else None, plan)
    return HeadToSeq.apply(out_h, inner)


def run(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, head_chunks: int = 1,
        hierarchical_groups=None, sink: torch.Tensor | None = None) -> torch.Tensor:
    ring = plan.ring
    check_heads(qh.shape[1], ring.world)
    timeout = timeout_seconds(ring)
    return run_grouped(qh, kh, vh, plan, inner=_A2A(ring.group, ring.world, timeout),
                       outer=LoopbackRing(1, 0, qh.device), a2a_codec=plan.codec, ring_codec=IdentityCodec(),
                       head_chunks=head_chunks, sink=sink)
