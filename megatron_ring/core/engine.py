"""The ring attention engine: one forward ring and one backward ring, driven by data.

Everything that varies is a parameter of :class:`~megatron_ring.core.plan.RingPlan`: the layout (which sub-blocks each step
computes, with which mask), the wire codec (how K/V are packed), the block kernel, and the ring itself
(a process group, or a loopback for compute-only timing). Tensors are BHSD views:
``q [b, h, s, d]``, ``k, v [b, h_kv, s, d]`` where ``s`` is the local length.

Forward, at step t rank r holds the K/V block of rank ``src = (r - t) mod P``. The block travels in
pieces of K/V heads through n + 1 slots (:mod:`.rotation`): the exchange bringing piece j of step t+1's
block starts before piece j of step t computes, so it overlaps that compute. Partial results are merged
in fp32 by log-sum-exp (:mod:`.merge`).

Backward, K/V travel the same way; next to them travels the fp32 dK/dV accumulator of the visiting
block, in the same pieces. Each rank adds its contribution to a piece and passes it on while the next
piece computes; after P hops every piece is back on its owner, in slots that make the returned dK/dV
views of the accumulator (:class:`~megatron_ring.core.accumulators.Accumulators`). Only the last piece's hop home is left in the open.

K/V slots come from :data:`~megatron_ring.core.buffers.POOL` and go back to it after the ring, so steps and
calls reuse the same memory (no fresh pages per call on CPU).

A rank whose input is refused after the cross-rank check still runs the forward ring's K/V stream
(:func:`refuse_on_ring`: the same :class:`~megatron_ring.core.kv_stream.KVStream`, zeros marked with a failing status, no compute), so
the other ranks see the status and raise instead of waiting (:mod:`.status`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, NoReturn

import torch

from megatron_ring import breakdown
from megatron_ring.core.accumulators import Accumulators, add_all
from megatron_ring.core.foreach import foreach_into
from megatron_ring.core.kv_stream import KVStream
from megatron_ring.core.launch import gathers_adds
from megatron_ring.core.max_logit import fold_task_max
from megatron_ring.core.merge import merge_into
from megatron_ring.core.plan import RingPlan, for_heads
from megatron_ring.core.rotation import divisor_at_most
from megatron_ring.core.views import block_cols, covers, strides_like
from megatron_ring.kernels.head_dim import RingPads
from megatron_ring.transport.collectives import launched

__all__ = ["ring_forward", "ring_backward", "refuse_on_ring", "query_heads", "one_ring"]


def _pieces(plan: RingPlan, k: torch.Tensor) -> int:
    """Pieces per K/V block on this ring: the largest divisor of the K/V heads within ``plan.pieces``."""
    return 1 if plan.ring.world == 1 else divisor_at_most(k.shape[1], plan.pieces)


def query_heads(heads: list[slice], g: int) -> list[tuple[slice, slice]]:
    """Per group of K/V heads ``hs``: ``(hs, qs)``, ``qs`` its query heads (``g`` per K/V head)."""
    return [(hs, slice(hs.start * g, hs.stop * g)) for hs in heads]


def _piece_plans(plan: RingPlan, heads: list[slice], g: int) -> list[tuple[slice, RingPlan]]:
    """Per piece: its query heads and its plan (dropout keyed on the global head numbers)."""
    return [(qs, for_heads(plan, qs)) for _, qs in query_heads(heads, g)]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, *,
                 refusal: BaseException | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward. Returns ``(out [b,h,s,d] float32, lse [b,h,s] float32)``; ``out`` has q's
    memory order.

    ``refusal``: this rank's input was refused (see :func:`refuse_on_ring`): the K/V stream runs with a
    failing status and nothing is computed."""
    breakdown.set_phase("fwd")
    b, h, s, _ = q.shape
    steps = plan.steps(s)
    if plan.ring.world > 1:  # numbered alike on every rank in step: the backward ring's status says which call
        plan.number = plan.ring.forward_rings
        plan.ring.forward_rings += 1
    with one_ring(plan.ring, "forward"):
        with breakdown.section(0, "copies"):
            kv = KVStream(plan, k, v, "fwd_kv", _pieces(plan, k), steps, refusal)
        out = torch.empty_strided((b, h, s, v.shape[-1]), strides_like((b, h, s, v.shape[-1]), q),
                                  dtype=torch.float32, device=q.device)
        lse = q.new_empty((b, h, s), dtype=torch.float32)
        pieces = _piece_plans(plan, kv.heads, h // k.shape[1])
        views = [_heads(qs, h, q, out, lse) for qs, _ in pieces]  # made once, not per step
        pads = _pads(plan, refusal)
        padded = None if pads is None else (pads.once(q),)  # q as the kernel takes it, padded once for the ring
        padded_views = [None if padded is None else _heads(qs, h, *padded) for qs, _ in pieces]
        fresh = [True] * len(pieces)  # piece's accumulator rows not written yet
        whole = plan.runs_whole_blocks(q)
        for step in range(steps):
            tasks = plan.tasks(step, s, whole) if refusal is None else ()  # refused: the stream only, no compute
            for j, (_, piece_plan) in enumerate(pieces):
                q_j, out_j, lse_j = views[j]
                kt, vt = kv.block(step, j)
                fresh[j], receipt = _forward_step(q_j, kt, vt, piece_plan, step, tasks, out_j, lse_j, fresh[j],
                                                  kv.take_receipt(j), padded_views[j],
                                                  None if pads is None else _padded_block(pads, kt, vt))
                if receipt is not None:  # no merge this step (nothing computed): recorded by a copy of its own
                    receipt[0].copy_(receipt[1])
            kv.advance()
        kv.release(steps)
        if plan.ring.world > 1:
            kv.status.spread(steps)  # a window-shortened ring: the codes travel the remaining hops
    if plan.ring.world > 1:
        kv.status.settle(plan.checks)  # every rank raises if any rank's K/V (or input) was refused
    for j, (qs, _) in enumerate(pieces):
        if fresh[j]:  # no local query sees any key (all padding, or masked away): out 0, lse -inf
            _init_acc(out[:, qs], lse[:, qs])
    return out, lse


def _init_acc(out: torch.Tensor, lse: torch.Tensor) -> None:
    out.zero_()
    lse.fill_(float("-inf"))


def _pads(plan: RingPlan, refusal: BaseException | None = None) -> RingPads | None:
    """The ring's padded operands (kernels/head_dim.py: :class:`RingPads`) where the call's kernel pads them;
    None: it does not, or nothing is computed (``refusal``)."""
    d = plan.operand_pad
    return None if d is None or refusal is not None else RingPads(d)


def _padded_block(pads: RingPads, kt: torch.Tensor, vt: torch.Tensor):
    """A function giving the visiting block ``kt``, ``vt`` padded, made at the first task that asks (a masked task
    on the math kernel does not) and shared by the step's later tasks."""
    return functools.cache(lambda: (pads.block(kt, "k"), pads.block(vt, "v")))


def _forward_step(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, plan: RingPlan, step: int, tasks,
                  out: torch.Tensor, lse: torch.Tensor, fresh: bool,
                  receipt: tuple[torch.Tensor, torch.Tensor] | None = None,
                  padded: tuple[torch.Tensor] | None = None, kv_padded=None,
                  ) -> tuple[bool, tuple[torch.Tensor, torch.Tensor] | None]:
    """Fold one visiting block (piece) into ``out``/``lse``; a function so its temporaries die before the
    next step. ``receipt``: the block's status to record, copied by the first merge (no launch of its own on
    CUDA). ``padded``, ``kv_padded``: ``(q,)`` padded and a function giving the block padded
    (:func:`_padded_block`), for the tasks whose kernel pads; None: none does. Returns whether the accumulator is
    still unwritten, and the receipt if no merge took it."""
    s = q.shape[2]
    for task in tasks:
        rows, cols = task.q, task.kv
        whole = covers(rows, s)
        padded_of = None if padded is None else functools.partial(_padded_task, padded, kv_padded, task, s)
        with breakdown.section(step, "kernel"):
            o, l, posinf = plan.forward_block(task, q if whole else q[:, :, rows], *block_cols(kt, vt, cols), step,
                                              padded_of)
        if plan.row_max is not None:
            with breakdown.section(step, "kernel"):  # the max-logit pass is block compute too
                fold_task_max(plan.row_max, task, q, kt, plan.scale)
        if fresh and not whole:  # the rows this task leaves out start empty
            _init_acc(out, lse)
        with breakdown.section(step, "merge"):  # first result covering every row: copied in (one op on CUDA)
            if whole:
                merge_into(out, lse, o, l, fresh=fresh, status=receipt, posinf_empty=posinf)
            else:
                merge_into(out[:, :, rows], lse[:, :, rows], o, l, status=receipt, posinf_empty=posinf)
        fresh, receipt = False, None
        del o, l
    return fresh, receipt


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor,
                  plan: RingPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward. Returns fp32 ``(dq [b,h,s,d], dk, dv [b,h_kv,s,d])``.

    ``out`` and ``lse`` are the forward's final (global) output and log-sum-exp for the local queries.
    """
    s = q.shape[2]
    world = plan.ring.world
    breakdown.set_phase("bwd")
    n = _pieces(plan, k)
    steps = plan.steps(s)
    whole = plan.runs_whole_blocks(q)
    # a variable-length kernel takes the lse with +inf where a row sees no key; a row sees none only where there
    # is padding: then that lse is made once, by the launch that writes the K/V into the wire
    lse_own = torch.empty_like(lse, memory_format=torch.contiguous_format) \
        if whole and plan.rows_may_see_nothing(s) else None
    with one_ring(plan.ring, "backward"):
        with breakdown.section(0, "copies"):
            kv = KVStream(plan, k, v, "bwd_kv", n, steps, status=False,
                           flips=((lse_own, lse),) if lse_own is not None else (), backward=True)
            if lse_own is not None and not kv.flipped:
                foreach_into([lse_own], [lse], flip=True)
            dkv = Accumulators(plan.ring, k, v, n)
            dq = torch.empty_like(q, dtype=torch.float32)  # q's strides: returned as is for fp32 inputs
        # one task of step 0 (the local block) covering every row and column writes each accumulator whole: its
        # results are copied in, nothing is zeroed; else the accumulators are zeroed in one launch on CUDA (fp32,
        # dense: torch's fast route)
        first = plan.tasks(0, s, whole) if steps else ()
        fresh = len(first) == 1 and covers(first[0].q, s) and covers(first[0].kv, k.shape[2])
        if not fresh:
            torch._foreach_zero_([dq, *dkv.to_zero])
        pieces = _piece_plans(plan, kv.heads, q.shape[1] // k.shape[1])
        # per piece, made once: its query heads' views, lse contiguous (as the kernels take it), and as a
        # variable-length kernel takes it (None: the same)
        views = [(dout_j, q_j, out_j, lse_j.contiguous(), dq_j)
                 for dout_j, q_j, out_j, lse_j, dq_j in (_heads(qs, q.shape[1], dout, q, out, lse, dq)
                                                         for qs, _ in pieces)]
        pads = _pads(plan)  # dO, q and O as the kernel takes them, padded once for the ring
        padded = None if pads is None else (pads.once(dout), pads.once(q), pads.once(out))
        padded_views = [None if padded is None else _heads(qs, q.shape[1], *padded) for qs, _ in pieces]
        owns = [None if lse_own is None else _heads(qs, q.shape[1], lse_own)[0].contiguous() for qs, _ in pieces]
        lse_rows: list[dict] = [{} for _ in pieces]  # per piece: its lse row slices, made contiguous once
        # the forward ring's status codes (CUDA; raises if a rank refused: it is not on this ring), read before the
        # first exchange and after the set-up above, so that a backward following its forward at once (activation
        # recomputation, a one-call benchmark) has that work launched while the host waits for the forward's end
        plan.checks.check()
        for step in range(steps):
            tasks = first if step == 0 else plan.tasks(step, s, whole)
            for j, (_, piece_plan) in enumerate(pieces):
                kt, vt = kv.block(step, j)
                dout_j, q_j, out_j, lse_j, dq_j = views[j]
                _backward_step(dout_j, q_j, kt, vt, out_j, lse_j, piece_plan, step, dq_j,
                               lambda: dkv.arrived(j, step), *dkv.views(j), tasks, lse_rows[j],
                               fresh and step == 0, owns[j], kv.take_receipt(j), padded_views[j],
                               None if pads is None else _padded_block(pads, kt, vt))
                dkv.pass_on(j, step)  # after the last step this hop returns each piece to its owner
            kv.advance()
            dkv.advance()
        for step in range(steps, world):  # a shortened ring: carry the accumulators home, nothing to add
            for j in range(n):
                dkv.arrived(j, step)
                dkv.pass_on(j, step)
            dkv.advance()
        kv.release(world)
        dk, dv = dkv.result(world)  # the last hop home waited for: the ring is complete
        if kv.backward is not None and steps < world:
            kv.backward.spread(steps)  # a window-shortened ring: the values travel the remaining hops
    if kv.backward is not None:  # which call's backward each rank ran (core/status.py): an error here leaves the
        kv.backward.settle()     # ring in step
    return dq, dk, dv


@contextlib.contextmanager
def one_ring(ring, which: str) -> Iterator[None]:
    """One ring of this rank (``which``: ``forward`` or ``backward``) from its first exchange to its last: an
    earlier call that left a ring of this transport in its middle raises here, before any exchange
    (:class:`~megatron_ring.errors.RingOutOfStepError`), and an error raised inside after an exchange was launched
    marks the transport so (:meth:`~megatron_ring.transport.ring.Transport.abandon`): its messages no longer
    match the calls that sent them. An error raised before the first exchange leaves the ring as it was."""
    ring.raise_if_failed()
    sent = (ring.sent_bytes(), launched())  # the ring's exchanges, and the collectives of the other comm types
    try:
        yield
    except BaseException as exc:
        if (ring.sent_bytes(), launched()) != sent:
            ring.abandon(exc, which)
        raise


def _backward_step(dout: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: RingPlan, step: int, dq: torch.Tensor,
                   wait_for_acc, dk_acc: torch.Tensor, dv_acc: torch.Tensor, tasks, lse_rows: dict,
                   fresh: bool = False, lse_own: torch.Tensor | None = None,
                   receipt: tuple[torch.Tensor, torch.Tensor] | None = None,
                   padded: tuple[torch.Tensor, ...] | None = None, kv_padded=None) -> None:
    """``tasks`` of one visiting block: dQ into ``dq``; dK/dV into the travelling accumulator, after
    ``wait_for_acc()`` says it has arrived (so that hop overlaps this step's compute).

    ``lse_rows``: the contiguous lse row slices of earlier steps (the same rows recur every step), filled here.
    ``fresh``: the accumulators hold nothing yet and the one task covers them whole: its results are copied in.
    ``lse_own``: ``lse`` as a variable-length kernel takes it, +inf where a row sees no key at all (None: no row
    can, :meth:`RingPlan.rows_may_see_nothing`; ``lse`` itself); row slices made once per call (:func:`_lse_rows`).
    On CUDA every add of the step (dQ, dK, dV of each task) is ONE :func:`foreach_into` after the wait
    (one launch for up to 4 adds, where torch's ``_foreach_add_`` would loop: fp32 accumulators, bf16 blocks);
    on CPU each dQ is added as soon as its task is done (its block freed at once). ``receipt``: the visiting
    block's backward status to record (``dst.copy_(src)``; on CUDA by the same list op). ``padded``: ``(dout, q,
    out)`` padded and ``kv_padded`` a function giving the block padded, for the tasks whose kernel pads (None:
    none does; :func:`_forward_step`)."""
    fused = gathers_adds(dq)
    partial: list[tuple[slice, torch.Tensor, torch.Tensor]] = []
    adds: list[tuple[str, slice, torch.Tensor, torch.Tensor]] = []  # CUDA: (accumulator, its rows, view, block)
    s, sk = q.shape[2], kt.shape[2]
    for task in tasks:
        rows = task.q
        lse_of = functools.partial(_lse_rows, lse, rows, lse_rows, lse_own)
        padded_of = None if padded is None else functools.partial(_padded_task, padded, kv_padded, task, s)
        with breakdown.section(step, "kernel"):
            if covers(rows, s):
                dq_b, dk_b, dv_b = plan.backward_block(task, dout, q, *block_cols(kt, vt, task.kv), out, lse_of, step,
                                                       padded_of)
            else:
                dq_b, dk_b, dv_b = plan.backward_block(
                    task, dout[:, :, rows], q[:, :, rows], *block_cols(kt, vt, task.kv), out[:, :, rows], lse_of, step,
                    padded_of)
        dq_view = dq if covers(rows, s) else dq[:, :, rows]
        if fused:
            adds.append(("dq", rows, dq_view, dq_b))
        else:
            with breakdown.section(step, "copies"):  # add_ into the view: no write-back copy as ``+=`` does
                dq_view.copy_(dq_b) if fresh else dq_view.add_(dq_b)
        del dq_b
        partial.append((task.kv, dk_b, dv_b))
    wait_for_acc()
    with breakdown.section(step, "copies"):
        for cols, dk_b, dv_b in partial:
            dk_view, dv_view = (dk_acc, dv_acc) if covers(cols, sk) else block_cols(dk_acc, dv_acc, cols)
            if fused:
                adds += (("dk", cols, dk_view, dk_b), ("dv", cols, dv_view, dv_b))
            elif fresh:
                dk_view.copy_(dk_b)
                dv_view.copy_(dv_b)
            else:
                dk_view.add_(dk_b)
                dv_view.add_(dv_b)
        if receipt is not None and not fused:
            receipt[0].copy_(receipt[1])
        add_all(adds, add=not fresh, copies=[receipt] if receipt is not None and fused else [])


def _padded_task(shared: tuple[torch.Tensor, ...], kv_padded, task, s: int) -> tuple[torch.Tensor, ...]:
    """A task's operands padded: the task's rows of the ring's padded ``shared`` operands (forward ``(q,)``,
    backward ``(dout, q, out)``), then the task's columns of the step's padded K and V."""
    rows = shared if covers(task.q, s) else tuple(t[:, :, task.q] for t in shared)
    return (*rows, *block_cols(*kv_padded(), task.kv))


def _lse_rows(lse: torch.Tensor, rows: slice, cache: dict, lse_own: torch.Tensor | None = None,
             own: bool = False) -> torch.Tensor:
    """``lse[:, :, rows]`` contiguous (as the kernels take it; ``lse`` itself for all rows), made once per row
    slice and call (``cache``). ``own``: from ``lse_own`` instead, where given (a variable-length kernel's
    convention, +inf where a row sees no key)."""
    if own and lse_own is not None:
        lse, tag = lse_own, "own"
    else:
        tag = "ours"
    if covers(rows, lse.shape[2]):
        return lse
    key = (tag, rows.start, rows.stop, rows.step)
    got = cache.get(key)
    if got is None:
        got = cache[key] = lse[:, :, rows].contiguous()
    return got


def _heads(qs: slice, h: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The query heads ``qs`` of each tensor (dim 1; the tensors themselves when ``qs`` is all ``h``)."""
    if covers(qs, h):
        return tensors
    return tuple(t[:, qs] for t in tensors)


def refuse_on_ring(plan: RingPlan, k: torch.Tensor, v: torch.Tensor, refusal: BaseException) -> NoReturn:
    """This rank's input was refused after the cross-rank check: take part in the forward ring anyway,
    then raise ``refusal``. The forward runs as :func:`ring_forward` does (the same :class:`KVStream`), its
    K/V zeros marked with a failing status and nothing computed, so the others raise at the end of that
    ring, or at the start of the backward ring (see :mod:`.status`).

    ``k``, ``v``: BHSD, only their shapes matter (``[b, h_kv, s, d]``; v's head dim from ``v``)."""
    b, h_kv, s, d = k.shape
    zk = k.new_zeros((b, h_kv, s, d))
    zv = k.new_zeros((b, h_kv, s, v.shape[-1]))
    with torch.no_grad():
        ring_forward(zk, zk, zv, plan, refusal=refusal)
    raise refusal
