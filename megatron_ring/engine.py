"""The ring attention engine: one forward ring and one backward ring, driven by data.

Everything that varies is a parameter of :class:`RingPlan`: the layout (which sub-blocks each step
computes, with which mask), the wire codec (how K/V are packed), the block kernel, and the ring itself
(a process group, or a loopback for compute-only timing). Tensors are BHSD views:
``q [b, h, s, d]``, ``k, v [b, h_kv, s, d]`` where ``s`` is the local length.

Forward, at step t rank r holds the K/V block of rank ``src = (r - t) mod P``. The exchange that brings
step t+1's block is started before step t's compute (double buffering), so it overlaps compute. Partial
results are merged in fp32 by log-sum-exp (:mod:`.merge`).

Backward, K/V travel the same way and are prefetched likewise; next to them travels an fp32 dK/dV
accumulator for the visiting block. Each rank adds its contribution and passes it on; after P steps plus
one final hop the accumulator of every block is back on its owner. The accumulator hop of step t runs
while step t+1 computes. Nothing computes after the last step, so that step goes in two pieces of key
rows: the first piece's rows travel home while the second piece computes, and only half of the final
hop is left in the open (:func:`_home_pieces`).

Wire and accumulator buffers come from :data:`~megatron_ring.buffers.POOL` and go back to it after the
ring, so steps and calls reuse the same memory (no fresh pages per call on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import breakdown
from .buffers import POOL
from .block_extras import DropoutKernel, DropoutSpec, fold_sink, sink_grad
from .codec import KVCodec, KVSpec
from .comm import Exchange, Ring
from .kernels import BlockKernel, MathKernel, ReversedKernel
from .layouts import BlockTask, Layout, split_kv
from .masks import AttentionMask, needed_steps, schedule
from .merge import merge_into
from .ring_status import RingStatus, check_pending, status_buffers

__all__ = ["RingPlan", "ring_forward", "ring_backward", "RingAttentionFunction", "head_groups"]


@dataclass
class RingPlan:
    """Everything the engine needs besides the tensors."""

    ring: Ring
    layout: Layout
    causal: bool
    scale: float
    kernel: BlockKernel
    codec: KVCodec
    mask: AttentionMask | None = None  # documents / window (None: the layout's causal or full structure)
    dropout: DropoutSpec | None = None  # attention dropout by global positions (see block_extras)

    def tasks(self, step: int, s: int):
        src = (self.ring.rank - step) % self.ring.world
        if self.mask is None:
            return self.layout.block_tasks(self.causal, self.ring.world, self.ring.rank, src, s)
        return schedule(self.layout, self.mask, self.ring.world, self.ring.rank, src, s)

    def steps(self, s: int) -> int:
        """Ring steps to run: fewer than P when no rank needs the K/V of the farther ranks (windows)."""
        return self.ring.world if self.mask is None else needed_steps(self.layout, self.mask, self.ring.world, s)

    def positions(self, task, step: int) -> dict:
        """Global query/key positions of a task (for position-keyed dropout)."""
        world, rank = self.ring.world, self.ring.rank
        pos = lambda r: self.layout.positions(self.dropout.seq_len, world, r)  # noqa: E731
        return {"qpos": pos(rank)[task.q], "kpos": pos((rank - step) % world)[task.kv]}

    def _kernel_for(self, task, step: int | None):
        """The kernel a task runs on, its ``causal`` flag and extra keywords: position-keyed dropout, an
        explicit mask (on a kernel that takes masks, else the math kernel), or the plan's kernel."""
        mask = getattr(task, "mask", None)
        if self.dropout is not None:
            return DropoutKernel(self.dropout), task.causal, dict(mask=mask, **self.positions(task, step))
        if mask is None:
            return self.kernel, task.causal, {}
        if getattr(task, "reversed", False):  # key >= query: top-left causal on reversed rows, unmasked
            return ReversedKernel(self.kernel), True, {}
        return _mask_kernel(self.kernel), False, {"mask": mask}

    def forward_block(self, task, q, k, v, step: int | None = None):
        kernel, causal, kw = self._kernel_for(task, step)
        return kernel.forward(q, k, v, causal, self.scale, **kw)

    def backward_block(self, task, dout, q, k, v, out, lse, step: int | None = None):
        kernel, causal, kw = self._kernel_for(task, step)
        return kernel.backward(dout, q, k, v, out, lse, causal, self.scale, **kw)


def _mask_kernel(kernel: BlockKernel) -> BlockKernel:
    """The kernel for tasks with an explicit mask: ``kernel`` if it takes masks, else the math kernel."""
    return kernel if kernel.supports_mask else MathKernel()


class _KVStream:
    """The visiting K/V blocks, step by step, with the next block's exchange already in flight."""

    def __init__(self, plan: RingPlan, k: torch.Tensor, v: torch.Tensor, channel: str,
                 free_idle_at_last: bool = False) -> None:
        self.plan, self.k, self.v, self.channel = plan, k, v, channel
        self.free_idle_at_last = free_idle_at_last
        self.spec = KVSpec(tuple(k.shape), tuple(v.shape), k.dtype, k.device)
        self.bufs: list[torch.Tensor | None] = []  # wire payload + one status element (see ring_status)
        self.status = RingStatus(plan.ring, plan.codec, k.device)
        if plan.ring.world > 1:
            self.bufs = status_buffers(plan.codec, self.spec)
            self.status.encode(k, v, self.bufs[0])  # an error is raised after the ring, on every rank
        self.pending: Exchange | None = None

    def start(self, step: int, steps: int) -> None:
        """Begin fetching the block for ``step + 1`` (if there is one)."""
        if step + 1 < steps:
            self.pending = self.plan.ring.exchange(self.bufs[step % 2], self.bufs[(step + 1) % 2],
                                                   self.channel, step)
        elif self.free_idle_at_last and len(self.bufs) == 2:
            # nothing left to receive: free the idle buffer (not back to the pool) so the last step's
            # kernel outputs can use its memory; it lowers the backward peak where the last step is the
            # peak (P=2), for one fresh allocation per call
            self.bufs[(step + 1) % 2] = None

    def block(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V visiting at ``step`` (the local tensors at step 0, decoded wire data after)."""
        if step == 0:
            return self.k, self.v
        buf = self.bufs[step % 2]
        self.status.received((self.plan.ring.rank - step) % self.plan.ring.world, buf)
        with breakdown.timed(step, "decode"):
            return self.plan.codec.decode(buf[:-1], self.spec)

    def finish(self, step: int = 0) -> None:
        """Wait for the exchange started in this step."""
        if self.pending is not None:
            with breakdown.timed(step, "wait"):
                self.pending.wait()
            self.pending = None

    def release(self) -> None:
        """Give the wire buffers back to the pool (the ring is over; nothing is in flight)."""
        POOL.give(*(buf for buf in self.bufs if buf is not None))
        self.bufs = []


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward. Returns ``(out [b,h,s,d] float32, lse [b,h,s] float32)``."""
    breakdown.set_phase("fwd")
    with breakdown.timed(0, "copies"):
        kv = _KVStream(plan, k, v, "fwd_kv")
    acc: list[torch.Tensor] = []  # [out, lse] once the first block result exists
    steps = plan.steps(q.shape[2])
    for step in range(steps):
        kv.start(step, steps)
        _forward_step(q, *kv.block(step), plan, step, acc)
        kv.finish(step)
    if plan.ring.world > 1:
        kv.release()
        kv.status.settle(plan)  # every rank raises if any rank's K/V (or input) was refused
    if not acc:  # no local query sees any key (all padding, or masked away): out 0, lse -inf
        _new_acc(q, v, acc)
    return acc[0], acc[1]


def _new_acc(q: torch.Tensor, v: torch.Tensor, acc: list[torch.Tensor]) -> None:
    b, h, s, _ = q.shape
    acc += [q.new_zeros((b, h, s, v.shape[-1]), dtype=torch.float32),
            q.new_full((b, h, s), float("-inf"), dtype=torch.float32)]


def _forward_step(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, plan: RingPlan, step: int,
                  acc: list[torch.Tensor]) -> None:
    """Fold one visiting block into ``acc``; a function so its temporaries die before the next step."""
    b, h, s, _ = q.shape
    for task in plan.tasks(step, s):
        with breakdown.timed(step, "kernel"):
            out, lse = plan.forward_block(task, q[:, :, task.q], kt[:, :, task.kv], vt[:, :, task.kv], step)
        if not acc and task.q == slice(0, s):  # first result covering every row: adopt it
            acc += [out.float(), lse.float()]
            continue
        if not acc:
            _new_acc(q, vt, acc)
        with breakdown.timed(step, "merge"):
            merge_into(acc[0][:, :, task.q], acc[1][:, :, task.q], out, lse)


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor,
                  plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward. Returns fp32 ``(dq [b,h,s,d], dk, dv [b,h_kv,s,d])``.

    ``out`` and ``lse`` are the forward's final (global) output and log-sum-exp for the local queries.
    """
    check_pending(plan)
    s = q.shape[2]
    world = plan.ring.world
    breakdown.set_phase("bwd")
    with breakdown.timed(0, "copies"):
        kv = _KVStream(plan, k, v, "bwd_kv", free_idle_at_last=True)
    dq = torch.zeros_like(q, dtype=torch.float32)  # q's strides: returned as is for fp32 inputs
    nk = k.numel()
    # dK/dV accumulators travel as one fp32 buffer: [dK.flatten(), dV.flatten()]
    dkv = [POOL.take(nk + v.numel(), torch.float32, q.device).zero_()]
    if world > 1:
        dkv.append(POOL.take(nk + v.numel(), torch.float32, q.device))
    dkv_pending: list[Exchange] = []
    steps = plan.steps(s)
    for step in range(steps):
        kv.start(step, steps)
        acc, nxt = dkv[step % len(dkv)], dkv[(step + 1) % len(dkv)]
        kt, vt = kv.block(step)
        tasks = plan.tasks(step, s)
        if world > 1 and step == world - 1:
            pieces = _home_pieces(tasks, k, v, s)
        elif world > 1 and step == 0:  # own block: no accumulator to wait for, so halves only shrink
            parts = _split_tasks(tasks, s)  # the kernel outputs (about one K/V block less at the peak)
            pieces = [(part, []) for part in parts[:-1]] + [(parts[-1], [(0, acc.numel())])]
        else:
            pieces = [(tasks, [(0, acc.numel())] if world > 1 else [])]
        arrived = _Arrival(dkv_pending, step)
        dkv_pending = []
        for part, ranges in pieces:
            _backward_step(dout, q, kt, vt, out, lse, plan, step, dq, arrived,
                           _view_like(acc[:nk], k), _view_like(acc[nk:], v), part)
            # pass it on; after the last step these hops return each block to its owner
            for a, b in ranges:
                arrived()  # (a piece without tasks: its rows are only forwarded)
                dkv_pending.append(plan.ring.exchange(acc[a:b], nxt[a:b], "bwd_dkv", step))
        kv.finish(step)
    for step in range(steps, world):  # a shortened ring: carry the accumulators home, nothing to add
        _Arrival(dkv_pending, step)()
        dkv_pending = [plan.ring.exchange(dkv[step % 2], dkv[(step + 1) % 2], "bwd_dkv", step)]
    _Arrival(dkv_pending, world)()
    kv.release()
    mine = dkv[world % len(dkv)]  # P=1: the local accumulator; else where the last hop landed
    POOL.give(*(buf for buf in dkv if buf is not mine))
    return dq, _view_like(mine[:nk], k), _view_like(mine[nk:], v)


class _Arrival:
    """Waits (once, when first called) for the dK/dV hops that bring this step's accumulator."""

    def __init__(self, pending: list[Exchange], step: int) -> None:
        self.pending, self.step = pending, step

    def __call__(self) -> None:
        for p in self.pending:
            _wait(p, self.step)
        self.pending = []


def _split_tasks(tasks, s: int) -> list[list]:
    """``tasks`` cut at key row ``s/2``: ``[tasks on rows < s/2, tasks on rows >= s/2]`` (exact for full
    and top-left causal tasks, :func:`~megatron_ring.layouts.split_kv`); ``[tasks]`` when a task carries
    an explicit mask."""
    if any(type(t) is not BlockTask for t in tasks):
        return [list(tasks)]
    lo, hi = [], []
    for t in tasks:
        a, b = split_kv(t, s // 2)
        lo += [a] if a is not None else []
        hi += [b] if b is not None else []
    return [lo, hi]


def _home_pieces(tasks, k: torch.Tensor, v: torch.Tensor, s: int) -> list[tuple[list, list[tuple[int, int]]]]:
    """The last backward step in two pieces of key rows, ``[0, s/2)`` then ``[s/2, s)``: each piece's
    tasks and the ranges of the flat dK/dV buffer that hold its rows, so the first piece's rows travel
    home while the second piece computes.

    The final hop is always these four messages (dK and dV of each half; the same on every rank, as
    they depend only on shapes). The compute is split only where that is exact and the rows are
    contiguous in the buffer; otherwise (a batch dimension outside the sequence one, tasks with explicit
    masks) the step computes in one piece and then sends the four messages."""
    at, nk = s // 2, k.numel()
    rk, rv = nk // s, v.numel() // s
    lo_ranges = [r for r in ((0, at * rk), (nk, nk + at * rv)) if r[1] > r[0]]
    hi_ranges = [(at * rk, nk), (nk + at * rv, nk + v.numel())]
    parts = _split_tasks(tasks, s)
    if len(parts) == 1 or not (_rows_outermost(k) and _rows_outermost(v)):
        return [(list(tasks), lo_ranges + hi_ranges)]
    return [(parts[0], lo_ranges), (parts[1], hi_ranges)]


def _rows_outermost(x: torch.Tensor) -> bool:
    """True when a row range of the BHSD view ``x`` is one contiguous range of its memory order."""
    order = _memory_order(x)
    return all(x.shape[i] == 1 for i in order[:order.index(2)])


def _wait(pending: Exchange | None, step: int) -> None:
    if pending is not None:
        with breakdown.timed(step, "wait"):
            pending.wait()


def _backward_step(dout: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: RingPlan, step: int, dq: torch.Tensor,
                   wait_for_acc, dk_acc: torch.Tensor, dv_acc: torch.Tensor, tasks) -> None:
    """``tasks`` of one visiting block: dQ into ``dq``; dK/dV into the travelling accumulator, after
    ``wait_for_acc()`` says it has arrived (so that hop overlaps this step's compute)."""
    partial = []
    for task in tasks:
        rows = task.q
        with breakdown.timed(step, "kernel"):
            dq_b, dk_b, dv_b = plan.backward_block(
                task, dout[:, :, rows], q[:, :, rows], kt[:, :, task.kv], vt[:, :, task.kv],
                out[:, :, rows], lse[:, :, rows].contiguous(), step)
        with breakdown.timed(step, "copies"):
            dq[:, :, rows] += dq_b
        del dq_b
        partial.append((task.kv, dk_b, dv_b))
    wait_for_acc()
    with breakdown.timed(step, "copies"):
        for cols, dk_b, dv_b in partial:
            dk_acc[:, :, cols] += dk_b
            dv_acc[:, :, cols] += dv_b


def _view_like(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``flat`` viewed with ``like``'s shape AND memory order (e.g. BHSD view of BSHD memory).

    Gradients laid out like their inputs need no re-layout copy downstream (autograd, Megatron).
    """
    order = _memory_order(like)
    physical = flat.view([like.shape[i] for i in order])
    return physical.permute([order.index(i) for i in range(like.ndim)])


def _memory_order(like: torch.Tensor) -> list[int]:
    """``like``'s dimensions from outermost to innermost in memory."""
    return sorted(range(like.ndim), key=lambda i: like.stride(i), reverse=True)


def head_groups(h_kv: int, groups: int) -> list[slice]:
    """Split K/V heads ``[0, h_kv)`` into ``groups`` near-equal slices (at most one slice per head)."""
    n = max(1, min(int(groups), h_kv))
    bounds = [round(i * h_kv / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper. Inputs/outputs are BHSD views; results keep the strides of the inputs.

    ``heads`` lists K/V head slices that run through the ring one after another (query heads follow
    their K/V group): with n slices every per-ring buffer (wire, dK/dV, accumulators, temporaries) is
    n times smaller, for n times the ring steps; bytes sent and compute are unchanged.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                heads: list[slice], sink: torch.Tensor | None = None) -> torch.Tensor:
        """``sink``: optional fp32 ``[h]`` softmax offsets (attention sinks), folded into the lse."""
        g = q.shape[1] // k.shape[1]
        if len(heads) == 1:
            acc, lse = ring_forward(q, k, v, plan)
            if sink is not None:
                fold_sink(acc, lse, sink)
            out = _as_result(acc, q)
        else:
            out = q.new_empty((*q.shape[:3], v.shape[-1]))
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            for hs in heads:
                qs = slice(hs.start * g, hs.stop * g)
                acc, lse_part = ring_forward(q[:, qs], k[:, hs], v[:, hs], _for_heads(plan, qs))
                if sink is not None:
                    fold_sink(acc, lse_part, sink[qs])
                out[:, qs].copy_(acc)
                lse[:, qs].copy_(lse_part)
                del acc, lse_part
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.plan, ctx.heads = plan, heads
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, sink = ctx.saved_tensors
        if dout.stride() != out.stride():
            dout = torch.empty_like(out).copy_(dout)
        extra = [None] * (len(ctx.needs_input_grad) - 3)  # plan, heads[, sink]
        if sink is not None and ctx.needs_input_grad[5]:
            extra[2] = sink_grad(dout, out, lse, sink).to(sink.dtype)
        if len(ctx.heads) == 1:
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
            return (_as_result(dq, q), _as_result(dk, k, any_strides=True),
                    _as_result(dv, v, any_strides=True), *extra)
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for hs in ctx.heads:
            qs = slice(hs.start * g, hs.stop * g)
            parts = ring_backward(dout[:, qs], q[:, qs], k[:, hs], v[:, hs], out[:, qs], lse[:, qs],
                                  _for_heads(ctx.plan, qs))
            for whole, part, sl in zip((dq, dk, dv), parts, (qs, hs, hs)):
                whole[:, sl].copy_(part)
            del parts
        return (dq, dk, dv, *extra)


def _for_heads(plan: RingPlan, qs: slice) -> RingPlan:
    """The plan for the query heads ``qs`` of a head-chunked call (dropout keys on global heads)."""
    if plan.dropout is None:
        return plan
    return replace(plan, dropout=plan.dropout.shifted(plan.dropout.head_offset + qs.start))


def _as_result(acc: torch.Tensor, like: torch.Tensor, any_strides: bool = False) -> torch.Tensor:
    """``acc`` itself when it already has ``like``'s dtype (and strides), else a copy shaped like ``like``.

    Avoids one full-size copy per tensor for fp32 inputs (the accumulators are fp32).
    """
    if acc.dtype == like.dtype and (any_strides or acc.stride() == like.stride()):
        return acc
    if acc.shape == like.shape:
        return torch.empty_like(like).copy_(acc)
    return torch.empty_strided(acc.shape, _strides_like(acc, like), dtype=like.dtype,  # out with v's head dim
                               device=like.device).copy_(acc)


def _strides_like(acc: torch.Tensor, like: torch.Tensor) -> list[int]:
    """Dense strides for ``acc``'s shape in ``like``'s memory order."""
    order = sorted(range(like.ndim), key=lambda i: like.stride(i), reverse=True)
    strides, step = [0] * like.ndim, 1
    for i in reversed(order):
        strides[i], step = step, step * acc.shape[i]
    return strides
