"""The autograd function of a ring call (:class:`RingAttentionFunction`: forward ring, backward ring, results in the
caller's dtype and memory order) and the head-group loop of a forward (:func:`forward_by_heads`)."""
from __future__ import annotations

from typing import Callable

import torch

from megatron_ring.core.autocast import autocast_off
from megatron_ring.core.engine import query_heads, ring_backward, ring_forward
from megatron_ring.core.foreach import foreach_into
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.views import strides_like
from megatron_ring.kernels.sinks import fold_sink, sink_grad

__all__ = ["RingAttentionFunction", "forward_by_heads", "refuse_double_backward", "saved_tensors"]


def saved_tensors(ctx) -> tuple:
    """``ctx.saved_tensors``, or where an input was changed in place between the call and its backward, an error
    that says so (torch's own names the views the forward made, in no-grad mode, of the caller's tensors)."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        if "inplace" not in str(exc) and "in-place" not in str(exc):
            raise
        raise RuntimeError(
            "ring_attention: q, k or v was modified in place after the call and before its backward, which needs "
            "them as they were: clone the tensor before changing it (or change it out of place).") from exc


def refuse_double_backward() -> None:
    """Raise where a ring call's backward is asked to be differentiable itself (``create_graph=True``: the backward
    then runs with grad mode on), before any exchange of that backward: its in-place accumulation and its
    exchanges record no graph. Every rank asks the same of the same call, so every rank raises here."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "ring_attention: double backward is not supported (a backward with create_graph=True, e.g. "
            "torch.autograd.grad(..., create_graph=True) for a gradient penalty or higher-order derivatives): the "
            "ring's backward is not itself differentiable. Take the gradient without create_graph, or compute "
            "this layer's attention without context parallelism.")


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper. Inputs/outputs are BHSD views; results keep the strides of the inputs."""

    @classmethod
    def apply(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, *args):
        """Whether a backward can follow is known here, outside :meth:`forward` (which runs with grad mode off,
        and whose ``ctx.needs_input_grad`` says what the inputs require, also under ``torch.no_grad()``): it
        decides where the forward ring's status is read (core/status.py)."""
        plan.checks.backward_follows = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return super().apply(q, k, v, plan, *args)

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                sink: torch.Tensor | None = None, perm: tuple[int, ...] | None = None) -> torch.Tensor:
        """``sink``: optional fp32 ``[h]`` softmax offsets (attention sinks), folded into the lse.

        ``perm``: q, k, v come in the caller's layout, ``t.permute(perm)`` is BHSD; the output (and the
        gradients) are returned in the caller's layout. The views are made here, so autograd records no
        view nodes around the call (less host time per call)."""
        ctx.perm = perm
        if perm is not None:
            q, k, v = q.permute(perm), k.permute(perm), v.permute(perm)
        out, lse = forward_by_heads(q, v, [slice(0, k.shape[1])], lambda hs, qs: ring_forward(q, k, v, plan), sink)
        # the BHSD views are saved (views of the inputs, and the output's BHSD form, which shares its
        # version counter: an in-place change of either is still detected), so the backward permutes
        # none of them again
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan = plan
        return out if perm is None else out.permute(_inverse(perm))

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        refuse_double_backward()
        q, k, v, out, lse, sink = saved_tensors(ctx)
        perm = ctx.perm
        with autocast_off(dout.device.type):  # as the forward ran (core/autocast.py)
            if perm is None:
                return RingAttentionFunction._backward(ctx, dout, q, k, v, out, lse, sink)
            inv = _inverse(perm)
            dq, dk, dv, *extra = RingAttentionFunction._backward(ctx, dout.permute(perm), q, k, v, out, lse, sink)
        return (dq.permute(inv), dk.permute(inv), dv.permute(inv), *extra)

    @staticmethod
    def _backward(ctx, dout, q, k, v, out, lse, sink):
        """The backward on BHSD views."""
        if dout.stride() != out.stride():
            dout = torch.empty_like(out).copy_(dout)
        extra = [None] * (len(ctx.needs_input_grad) - 3)  # plan[, sink[, perm]]
        if sink is not None and ctx.needs_input_grad[4]:
            extra[1] = sink_grad(dout, out, lse, sink).to(sink.dtype)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
        return (*_as_results((dq, q, False), (dk, k, True), (dv, v, True)), *extra)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``perm``."""
    got = _INVERSES.get(perm)
    if got is not None:
        return got
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


_INVERSES = {(0, 2, 1, 3): (0, 2, 1, 3), (1, 2, 0, 3): (2, 0, 1, 3)}  # bshd, sbhd -> BHSD and back


def forward_by_heads(q: torch.Tensor, v: torch.Tensor, heads: list[slice],
                     run: Callable[[slice, slice], tuple[torch.Tensor, torch.Tensor]],
                     sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head-group loop of a forward (``all_gather``'s gathered groups; the ring runs one): ``run(hs, qs)`` gives the fp32 ``(out, lse)`` of the K/V heads
    ``hs`` and their query heads ``qs``, one group after another; attention sinks are folded in. Returns
    the output (q's dtype and memory order, v's head dim) and the fp32 lse ``[b, h, s]``.

    One group: its result is returned as is where it already has q's dtype and strides (no copy)."""
    if len(heads) == 1:
        hs = heads[0]
        acc, lse = run(hs, slice(0, q.shape[1]))
        if sink is not None:
            fold_sink(acc, lse, sink)
        return _as_result(acc, q), lse
    shape = (*q.shape[:3], v.shape[-1])  # in q's memory order, as one group's result and torch's kernels have it
    out = torch.empty_strided(shape, strides_like(shape, q), dtype=q.dtype, device=q.device)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for hs, qs in query_heads(heads, q.shape[1] // sum(h.stop - h.start for h in heads)):
        acc, lse_part = run(hs, qs)
        if sink is not None:
            fold_sink(acc, lse_part, sink[qs])
        out[:, qs].copy_(acc)
        lse[:, qs].copy_(lse_part)
        del acc, lse_part
    return out, lse


def _as_result(acc: torch.Tensor, like: torch.Tensor, any_strides: bool = False) -> torch.Tensor:
    """``acc`` itself when it already has ``like``'s dtype (and strides), else a copy shaped like ``like``.

    Avoids one full-size copy per tensor for fp32 inputs (the accumulators are fp32).
    """
    return _as_results((acc, like, any_strides))[0]


def _as_results(*items: tuple[torch.Tensor, torch.Tensor, bool]) -> list[torch.Tensor]:
    """:func:`_as_result` of each ``(acc, like, any_strides)``; the copies made in ONE :func:`foreach_into`
    (one launch on CUDA for up to 4)."""
    got, dsts, srcs = [], [], []
    for acc, like, any_strides in items:
        if acc.dtype == like.dtype and (any_strides or acc.stride() == like.stride()):
            got.append(acc)
            continue
        if acc.shape == like.shape:
            dst = torch.empty_like(like)
        else:  # out with v's head dim
            dst = torch.empty_strided(acc.shape, strides_like(acc.shape, like), dtype=like.dtype, device=like.device)
        got.append(dst)
        dsts.append(dst)
        srcs.append(acc)
    foreach_into(dsts, srcs)
    return got
