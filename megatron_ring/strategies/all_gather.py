"""``all_gather``: every rank gathers all K/V (in groups of K/V heads) and computes its queries against
them; dK/dV are reduce-scattered back to their owners.

Schedule: the layout's tasks for (this rank, every source) against the gathered K/V
(:class:`~megatron_ring.schedules.views.GatheredView`), run by the engine as a world-size-1 plan — so under a causal
mask a rank computes only the sub-blocks it can see, exactly as the ring does.

Overlap and memory: K/V are gathered in :data:`GROUPS` groups (slices of K/V heads, fewer where there are fewer
K/V heads); the gather of group i+1 is in
flight while group i computes (forward and backward), and in backward the reduce-scatter of group i's
dK/dV runs while group i+1 computes. Nothing is kept from forward to backward beyond what the ring
keeps (q, k, v, out, lse): K/V are gathered again in backward. Peak extra memory per rank is about two
gathered groups (2 x P x local K/V / groups, wire dtype) plus one group's fp32 dK/dV for all P shards.
Wire codecs apply to the gathered K/V (each block is quantised once, by its owner); dK/dV travel fp32.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ring.kernels.sinks import sink_grad
from megatron_ring.wire.codecs import KVSpec
from megatron_ring.transport.ring import LoopbackRing
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.autocast import autocast_off
from megatron_ring.core.autograd import forward_by_heads, refuse_double_backward, saved_tensors
from megatron_ring.core.engine import one_ring, query_heads, ring_backward, ring_forward
from megatron_ring.core.heads import head_groups
from megatron_ring.transport.collectives import Pending, all_gather, reduce_scatter
from megatron_ring.schedules.on_device import cached_on, positions_on
from megatron_ring.schedules.views import GatheredView
from megatron_ring.strategies.refusal import encode_or_record

__all__ = ["run", "AllGatherAttention"]



@dataclasses.dataclass
class GatheredRingPlan(RingPlan):
    """The world-size-1 plan over a :class:`GatheredView`: its keys are every shard (position-keyed
    dropout needs their true global positions, which differ from the queries')."""

    def positions(self, task, step: int, device: torch.device) -> dict:
        view, n = self.layout, self.dropout.seq_len
        keys = cached_on(("key_positions", type(view), view.name, n), lambda: view.key_positions(n), device)
        return {"qpos": positions_on(view, n, 1, 0, device)[task.q], "kpos": keys[task.kv]}


def _local_plan(plan: RingPlan, device: torch.device, qs: slice) -> RingPlan:
    """The world-size-1 plan for the query heads ``qs`` against the gathered K/V (dropout keyed on the
    global head numbers and the gathered keys' global positions; the max logit of this rank's own query
    rows, as the ring's)."""
    drop = plan.heads_dropout(qs.start)
    return GatheredRingPlan(ring=LoopbackRing(1, 0, device), layout=GatheredView(plan.layout, plan.ring.world,
                        plan.ring.rank), causal=plan.causal, scale=plan.scale, kernel=plan.kernel, codec=plan.codec,
                        mask=plan.mask, dropout=drop, row_max=None if plan.row_max is None else plan.row_max[qs])


class _Gatherer:
    """Gathers K/V head groups one ahead of use: ``get(i)`` returns group i and starts group i+1."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, groups: list[slice], what: str) -> None:
        self.k, self.v, self.plan, self.groups, self.what = k, v, plan, groups, what
        self.inflight: dict[int, tuple[Pending, torch.Tensor, KVSpec]] = {}

    def _start(self, i: int) -> None:
        if i >= len(self.groups) or i in self.inflight:
            return
        hs, codec, ring = self.groups[i], self.plan.codec, self.plan.ring
        k, v = self.k[:, hs], self.v[:, hs]
        spec = KVSpec(tuple(k.shape), tuple(v.shape), k.dtype, k.device)
        mine = codec.new_buffer(spec)
        encode_or_record(self.plan, codec, k, v, mine)  # refused K/V: every rank raises after the forward
        everyone = mine.new_empty(ring.world * mine.numel())
        self.inflight[i] = (all_gather(everyone, mine, ring, self.what), everyone, spec)

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._start(i)
        pending, everyone, spec = self.inflight.pop(i)
        self._start(i + 1)  # next group's gather overlaps this group's compute
        pending.wait()
        me, hs = self.plan.ring.rank, self.groups[i]
        blocks = [(self.k[:, hs], self.v[:, hs]) if j == me else self.plan.codec.decode(chunk, spec)
                  for j, chunk in enumerate(everyone.chunk(self.plan.ring.world))]  # own block as is, like p2p
        return torch.cat([b[0] for b in blocks], dim=2), torch.cat([b[1] for b in blocks], dim=2)


class AllGatherAttention(torch.autograd.Function):
    """BHSD views in, q-shaped output; gradients shaped like the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, groups: list[slice], sink: torch.Tensor | None = None):
        kv = _Gatherer(k, v, plan, groups, "all_gather of K/V (forward)")
        index = {hs.start: i for i, hs in enumerate(groups)}

        def run(hs: slice, qs: slice):
            return ring_forward(q[:, qs], *kv.get(index[hs.start]), _local_plan(plan, q.device, qs))

        out, lse = forward_by_heads(q, v, groups, run, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan, ctx.groups = plan, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward()
        # as the forward ran (core/autocast.py); an error after its first collective leaves the group out of step
        with autocast_off(dout.device.type), one_ring(ctx.plan.ring, "backward"):
            return AllGatherAttention._backward(ctx, dout, *saved_tensors(ctx))

    @staticmethod
    def _backward(ctx, dout, q, k, v, out, lse, sink):
        plan, groups = ctx.plan, ctx.groups
        world, g, s = plan.ring.world, q.shape[1] // k.shape[1], q.shape[2]
        if dout.stride() != out.stride():
            dout = torch.empty_like(out).copy_(dout)
        dsink = sink_grad(dout, out, lse, sink).to(sink.dtype) if sink is not None and ctx.needs_input_grad[5] else None
        dq, dk, dv = torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
        kv = _Gatherer(k, v, plan, groups, "all_gather of K/V (backward)")
        scatters: list[tuple[Pending, torch.Tensor, slice]] = []
        for i, (hs, qs) in enumerate(query_heads(groups, g)):
            k_all, v_all = kv.get(i)
            dq_p, dk_all, dv_all = ring_backward(dout[:, qs], q[:, qs], k_all, v_all, out[:, qs],
                                                 lse[:, qs], _local_plan(plan, q.device, qs))
            dq[:, qs].copy_(dq_p)
            b, hk, _, d = dk_all.shape
            dvd = dv_all.shape[-1]  # V's head dim (MLA: may differ from d)
            # rank-major [P, (dK_j, dV_j)] fp32 so that chunk j of the reduce-scatter goes to rank j
            n_k, n_v = b * hk * s * d, b * hk * s * dvd
            send = dk_all.new_empty(world, n_k + n_v)
            send[:, :n_k].view(world, b, hk, s, d).copy_(dk_all.reshape(b, hk, world, s, d).permute(2, 0, 1, 3, 4))
            send[:, n_k:].view(world, b, hk, s, dvd).copy_(dv_all.reshape(b, hk, world, s, dvd).permute(2, 0, 1, 3, 4))
            del dq_p, dk_all, dv_all, k_all, v_all
            mine = send.new_empty(n_k + n_v)
            scatters.append((reduce_scatter(mine.view(-1), send.view(-1), plan.ring, "reduce-scatter of dK/dV"),
                             mine, hs))
            if len(scatters) > 1:  # the previous group's reduce-scatter ran during this group's compute
                _land(scatters.pop(0), dk, dv)
        for item in scatters:
            _land(item, dk, dv)
        return dq, dk, dv, None, None, dsink


def _land(item, dk: torch.Tensor, dv: torch.Tensor) -> None:
    pending, mine, hs = item
    pending.wait()
    part_k, part_v = dk[:, hs], dv[:, hs]
    n_k = part_k.numel()
    part_k.copy_(mine[:n_k].view(part_k.shape))
    part_v.copy_(mine[n_k:].view(part_v.shape))


#: K/V head groups gathered one after another (the next group's gather overlaps this one's compute)
GROUPS = 2


def run(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, hierarchical_groups=None,
        sink: torch.Tensor | None = None) -> torch.Tensor:
    return AllGatherAttention.apply(qh, kh, vh, plan, head_groups(kh.shape[1], GROUPS), sink)
