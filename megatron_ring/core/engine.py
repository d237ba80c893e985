"""The ring attention engine: one forward ring and one backward ring, driven by data.

Everything that varies is a parameter of :class:`RingPlan`: the layout (which sub-blocks each step
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
views of the accumulator (:class:`_Accumulators`). Only the last piece's hop home is left in the open.

K/V slots come from :data:`~megatron_ring.core.buffers.POOL` and go back to it after the ring, so steps and
calls reuse the same memory (no fresh pages per call on CPU).

A rank whose input is refused after the cross-rank check still runs the forward ring's K/V stream
(:func:`refuse_on_ring`: the same :class:`_KVStream`, zeros marked with a failing status, no compute), so
the other ranks see the status and raise instead of waiting (:mod:`.status`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, NoReturn

import torch

from megatron_ring import breakdown
from megatron_ring.core.buffers import POOL
from megatron_ring.kernels.dropout import DropoutKernel, DropoutSpec
from megatron_ring.core.max_logit import fold_task_max
from megatron_ring.kernels.sinks import fold_sink, sink_grad
from megatron_ring.wire.codecs import KVCodec, KVSpec
from megatron_ring.transport.ring import Transport
from megatron_ring.kernels.block import BlockKernel, ReversedKernel
from megatron_ring.kernels.varlen import masked_kernel, whole_blocks
from megatron_ring.schedules.layouts import Schedule, TaskKind
from megatron_ring.schedules.masks import AttentionMask, needed_steps, schedule
from megatron_ring.schedules.on_device import positions_on
from megatron_ring.core.foreach import foreach_into
from megatron_ring.core.merge import merge_into
from megatron_ring.core.rotation import Rotation, divisor_at_most, start_for
from megatron_ring.core.status import PendingChecks, RingStatus, StatusRecorder, status_buffers
from megatron_ring.core.heads import head_groups

__all__ = ["RingPlan", "ring_forward", "ring_backward", "RingAttentionFunction", "head_groups", "refuse_on_ring",
           "query_heads", "forward_by_heads"]


@dataclass
class RingPlan:
    """Everything the engine needs besides the tensors."""

    ring: Transport
    layout: Schedule  # a layout, or a strategy's view of several shards (schedules/views.py)
    causal: bool
    scale: float
    kernel: BlockKernel
    codec: KVCodec
    mask: AttentionMask | None = None  # documents / window (None: the layout's causal or full structure)
    dropout: DropoutSpec | None = None  # attention dropout by global positions (see kernels/dropout.py)
    pieces: int = 1  # K/V heads pieces a ring step streams a block in, at most (see rotation.py)
    #: status codes the forward ring left to check at the start of the backward ring (CUDA; core/status.py);
    #: shared by the plans derived from this one (dataclasses.replace keeps the object)
    checks: PendingChecks = field(default_factory=PendingChecks, compare=False, repr=False)
    #: in a collective strategy's call: where a refusal is recorded (strategies/refusal.py), else None
    strategy_status: StatusRecorder | None = field(default=None, compare=False, repr=False)
    #: QK-clip: fp32 ``[h, s]`` running max of the scaled logits per query head and local query row of this
    #: plan's q, folded in place by the forward (core/max_logit.py); None: not asked, nothing computed
    row_max: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def runs_whole_blocks(self, q: torch.Tensor) -> bool:
        """Whether this call's masked tasks run as whole blocks, not tiles: on a variable-length kernel that
        takes ``q``'s case, without dropout (kernels/varlen.py: whole_blocks). Asked once per call."""
        return self.mask is not None and self.dropout is None and whole_blocks(self.kernel, q)

    def tasks(self, step: int, s: int, whole: bool = False):
        """The tasks of ``step`` for local blocks of ``s`` rows (``whole``: :meth:`runs_whole_blocks`)."""
        src = (self.ring.rank - step) % self.ring.world
        if self.mask is None:
            return self.layout.block_tasks(self.causal, self.ring.world, self.ring.rank, src, s)
        return schedule(self.layout, self.mask, self.ring.world, self.ring.rank, src, s, s if whole else None)

    def steps(self, s: int) -> int:
        """Ring steps to run: fewer than P when no rank needs the K/V of the farther ranks (windows)."""
        return self.ring.world if self.mask is None else needed_steps(self.layout, self.mask, self.ring.world, s)

    def positions(self, task, step: int, device: torch.device) -> dict:
        """Global query/key positions of a task on ``device`` (for position-keyed dropout; copied there
        once per signature, schedules/on_device.py)."""
        world, rank = self.ring.world, self.ring.rank
        pos = lambda r: positions_on(self.layout, self.dropout.seq_len, world, r, device)  # noqa: E731
        return {"qpos": pos(rank)[task.q], "kpos": pos((rank - step) % world)[task.kv]}

    def heads_dropout(self, first: int) -> DropoutSpec | None:
        """The dropout spec for tensors whose query heads start at head ``first`` of this plan's (dropout
        keys on global head numbers); None without dropout."""
        return None if self.dropout is None else self.dropout.shifted(self.dropout.head_offset + first)

    def _kernel_for(self, task, step: int | None, device: torch.device):
        """The kernel a task runs on, its ``causal`` flag and extra keywords: position-keyed dropout, an
        explicit mask (on a kernel that takes masks, else the math kernel), or the plan's kernel."""
        kind = task.kind
        if self.dropout is not None:
            return (DropoutKernel(self.dropout), task.causal,
                    dict(mask=task.explicit_mask(), **self.positions(task, step, device)))
        if kind is TaskKind.FULL or kind is TaskKind.CAUSAL:
            return self.kernel, task.causal, {}
        if kind is TaskKind.REVERSED:  # key >= query: top-left causal on reversed rows, unmasked
            return ReversedKernel(self.kernel), True, {}
        kernel = _mask_kernel(self.kernel)
        kw = {"mask": task.explicit_mask()}
        if getattr(kernel, "takes_kernel_lse", False):  # its lse in its own convention (kernels/varlen.py)
            kw["kernel_lse"] = True
        return kernel, False, kw

    def forward_block(self, task, q, k, v, step: int | None = None):
        """``(out, lse, posinf_empty)``: the block's result; ``posinf_empty``: its lse is the kernel's own, +inf
        where a row sees no key (a variable-length kernel's; the merge reads it as -inf, merge_into)."""
        kernel, causal, kw = self._kernel_for(task, step, q.device)
        return (*kernel.forward(q, k, v, causal, self.scale, **kw), kw.get("kernel_lse", False))

    def backward_block(self, task, dout, q, k, v, out, lse, step: int | None = None):
        """``lse``: the lse of the task's rows as :meth:`forward_block` gave it (the kernel takes either
        convention), or ``lse(own)``, a function giving it in ours (``own`` False) or in a variable-length
        kernel's (True: +inf where a row sees no key), made once per call by the caller."""
        kernel, causal, kw = self._kernel_for(task, step, q.device)
        if callable(lse):
            lse = lse(kw.get("kernel_lse", False))
        elif "kernel_lse" in kw:  # a tensor in either convention: the kernel fixes it up itself
            kw["kernel_lse"] = False
        return kernel.backward(dout, q, k, v, out, lse, causal, self.scale, **kw)

    def rows_may_see_nothing(self, s: int) -> bool:
        """Whether a local query row may see no key at all: only padding does (tokens at or past the last
        document's end; a window always holds the diagonal), so only documents that end before the
        ``s * world`` tokens of the stream."""
        m = self.mask
        return m is not None and m.cu_seqlens is not None and m.cu_seqlens[-1] < s * self.ring.world


def _mask_kernel(kernel: BlockKernel) -> BlockKernel:
    """The kernel for tasks with an explicit mask (kernels/varlen.py): the variable-length flash kernel for a
    fused CUDA kernel, ``kernel`` if it takes masks, else the math kernel."""
    return masked_kernel(kernel)


class _KVStream:
    """The visiting K/V blocks, in ``n`` pieces of K/V heads, with the next block's pieces in flight
    (:class:`~megatron_ring.core.rotation.Rotation`: ``n + 1`` piece slots instead of two whole blocks).

    ``refusal``: this rank's input was refused; its pieces go out marked with a failing status
    (:class:`~megatron_ring.core.status.RingStatus`), the same messages in the same order.
    ``status``: whether this stream carries the ranks' status codes (the forward ring); the backward
    ring's K/V are the ones its forward ring checked, so it sends them without (its status elements are
    never read).

    The slots are one :class:`~megatron_ring.core.buffers.SlotSet` from the pool: the views made of a slot
    (decoded K, V where decoding makes views; the status element) are made once per set, not per ring."""

    def __init__(self, plan: RingPlan, k: torch.Tensor, v: torch.Tensor, channel: str, n: int,
                 steps: int, refusal: BaseException | None = None, status: bool = True,
                 flips: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> None:
        """``flips``: ``(dst, src)`` pairs also copied, -inf made +inf, by the launch that writes the K/V into the
        wire (a variable-length kernel's lse); ``flipped`` says whether it did (else the caller copies them)."""
        self.plan, self.k, self.v, self.steps = plan, k, v, steps
        self.flipped = False
        self.heads = head_groups(k.shape[1], n)
        b, h_kv, s, d = k.shape
        hj = h_kv // n
        self.spec = KVSpec((b, hj, s, d), (b, hj, s, v.shape[-1]), k.dtype, k.device)
        #: the local block's pieces (step 0)
        self.local = [(k, v) if _covers(hs, h_kv) else (k[:, hs], v[:, hs]) for hs in self.heads]
        self.rot: Rotation | None = None
        self.status: RingStatus | None = None
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
                                         backward_follows=plan.checks.backward_follows)
                elems = [self._elem(slot) for slot in cur]
                # the same launch zeroes the status elements and the codes (the code where every piece is OK)
                writes = self._writes(cur, [*elems, self.status.codes]) if fused else [None] * n
                # an error is raised after the ring, on every rank
                self.status.encode_pieces(self.local, raws, writes, elems, zeroed=fused)
            else:
                writes = self._writes(cur, flips=flips) if fused else [None] * n
                self.flipped = fused and bool(flips)
                for (kj, vj), raw, w in zip(self.local, raws, writes):
                    if w is None:
                        plan.codec.encode_flagged(kj, vj, raw[:-1])  # checked by the forward: verdict unused
                    else:
                        w(kj, vj)

    def _writes(self, cur: list[int], zero: tuple | list = (), flips: tuple = ()
                ) -> list[Callable[[torch.Tensor, torch.Tensor], None]]:
        """Per piece, its writer for :meth:`RingStatus.encode` where the wire is the identity: the first
        copies EVERY piece's K and V into the decoded views of its slot (the bytes :meth:`KVCodec.encode`
        writes, through views made once), zeroes the tensors ``zero`` and copies the ``flips`` pairs (-inf made
        +inf) in one :func:`foreach_into` (one launch on CUDA for 4 tensors: one piece and its status), the
        others do nothing. A failing copy is still caught and sent as the status."""
        dsts = [t for slot in cur for t in self._decoded(0, slot)] + list(zero) + [d for d, _ in flips]
        srcs = [t for kv in self.local for t in kv] + [None] * len(zero) + [x for _, x in flips]
        flip = [False] * (len(dsts) - len(flips)) + [True] * len(flips)

        def write_all(k: torch.Tensor, v: torch.Tensor) -> None:
            foreach_into(dsts, srcs, flip=flip)

        return [write_all] + [_write_nothing] * (len(cur) - 1)

    def _elem(self, slot: int) -> torch.Tensor:
        """The status element of ``slot`` (its last element; a view made once per set)."""
        key = ("status", slot)
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = self.rot.slots[slot][-1:]
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
        if self.status is not None:  # recorded by the step's first merge (:meth:`take_receipt`)
            self._receipts[j] = self.status.receipt((self.plan.ring.rank - step) % self.plan.ring.world,
                                                    self._elem(slot))
        return self._decoded(step, slot)

    def take_receipt(self, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The status of piece ``j``'s visiting block still to record, ``(codes element, status element)``
        (see :meth:`RingStatus.receipt`): the caller copies it, in its first merge where it has one."""
        return self._receipts.pop(j, None)

    def _decoded(self, step: int, slot: int):
        """K, V decoded from ``slot``; made once per set where decoding makes views of it (the identity
        wire: they follow its contents)."""
        got = self._views.get(slot)
        if got is not None:
            return got
        buf = self.rot.slots[slot]
        with breakdown.section(step, "decode"):
            got = self.plan.codec.decode(buf[:-1], self.spec)
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
    """A piece's writer where the first piece's writer wrote every piece (:meth:`_KVStream._writes`)."""


def _pieces(plan: RingPlan, k: torch.Tensor) -> int:
    """Pieces per K/V block on this ring: the largest divisor of the K/V heads within ``plan.pieces``."""
    return 1 if plan.ring.world == 1 else divisor_at_most(k.shape[1], plan.pieces)


def query_heads(heads: list[slice], g: int) -> list[tuple[slice, slice]]:
    """Per group of K/V heads ``hs``: ``(hs, qs)``, ``qs`` its query heads (``g`` per K/V head)."""
    return [(hs, slice(hs.start * g, hs.stop * g)) for hs in heads]


def _piece_plans(plan: RingPlan, heads: list[slice], g: int) -> list[tuple[slice, RingPlan]]:
    """Per piece: its query heads and its plan (dropout keyed on the global head numbers)."""
    return [(qs, _for_heads(plan, qs)) for _, qs in query_heads(heads, g)]


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, *,
                 refusal: BaseException | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward. Returns ``(out [b,h,s,d] float32, lse [b,h,s] float32)``; ``out`` has q's
    memory order.

    ``refusal``: this rank's input was refused (see :func:`refuse_on_ring`): the K/V stream runs with a
    failing status and nothing is computed."""
    breakdown.set_phase("fwd")
    b, h, s, _ = q.shape
    steps = plan.steps(s)
    with breakdown.section(0, "copies"):
        kv = _KVStream(plan, k, v, "fwd_kv", _pieces(plan, k), steps, refusal)
    out = torch.empty_strided((b, h, s, v.shape[-1]), _strides_like((b, h, s, v.shape[-1]), q),
                              dtype=torch.float32, device=q.device)
    lse = q.new_empty((b, h, s), dtype=torch.float32)
    pieces = _piece_plans(plan, kv.heads, h // k.shape[1])
    views = [_heads(qs, h, q, out, lse) for qs, _ in pieces]  # made once, not per step
    fresh = [True] * len(pieces)  # piece's accumulator rows not written yet
    whole = plan.runs_whole_blocks(q)
    for step in range(steps):
        tasks = plan.tasks(step, s, whole) if refusal is None else ()  # refused: the stream only, no compute
        for j, (_, piece_plan) in enumerate(pieces):
            q_j, out_j, lse_j = views[j]
            kt, vt = kv.block(step, j)
            fresh[j], receipt = _forward_step(q_j, kt, vt, piece_plan, step, tasks, out_j, lse_j, fresh[j],
                                              kv.take_receipt(j))
            if receipt is not None:  # no merge this step (nothing computed): recorded by a copy of its own
                receipt[0].copy_(receipt[1])
        kv.advance()
    kv.release(steps)
    if plan.ring.world > 1:
        kv.status.spread(steps)  # a window-shortened ring: the codes travel the remaining hops
        kv.status.settle(plan.checks)  # every rank raises if any rank's K/V (or input) was refused
    for j, (qs, _) in enumerate(pieces):
        if fresh[j]:  # no local query sees any key (all padding, or masked away): out 0, lse -inf
            _init_acc(out[:, qs], lse[:, qs])
    return out, lse


def _init_acc(out: torch.Tensor, lse: torch.Tensor) -> None:
    out.zero_()
    lse.fill_(float("-inf"))


def _forward_step(q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, plan: RingPlan, step: int, tasks,
                  out: torch.Tensor, lse: torch.Tensor, fresh: bool,
                  receipt: tuple[torch.Tensor, torch.Tensor] | None = None,
                  ) -> tuple[bool, tuple[torch.Tensor, torch.Tensor] | None]:
    """Fold one visiting block (piece) into ``out``/``lse``; a function so its temporaries die before the
    next step. ``receipt``: the block's status to record, copied by the first merge (no launch of its own on
    CUDA). Returns whether the accumulator is still unwritten, and the receipt if no merge took it."""
    s = q.shape[2]
    for task in tasks:
        rows, cols = task.q, task.kv
        whole = _covers(rows, s)
        with breakdown.section(step, "kernel"):
            o, l, posinf = plan.forward_block(task, q if whole else q[:, :, rows], *_cols(kt, vt, cols), step)
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
    plan.checks.check()  # raises if the forward ring carried a failing rank's code (CUDA)
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
    with breakdown.section(0, "copies"):
        kv = _KVStream(plan, k, v, "bwd_kv", n, steps, status=False,
                       flips=((lse_own, lse),) if lse_own is not None else ())
        if lse_own is not None and not kv.flipped:
            foreach_into([lse_own], [lse], flip=True)
        dkv = _Accumulators(plan.ring, k, v, n)
        dq = torch.empty_like(q, dtype=torch.float32)  # q's strides: returned as is for fp32 inputs
    # one task of step 0 (the local block) covering every row and column writes each accumulator whole: its
    # results are copied in, nothing is zeroed; else the accumulators are zeroed in one launch on CUDA (fp32,
    # dense: torch's fast route)
    first = plan.tasks(0, s, whole) if steps else ()
    fresh = len(first) == 1 and _covers(first[0].q, s) and _covers(first[0].kv, k.shape[2])
    if not fresh:
        torch._foreach_zero_([dq, *dkv.to_zero])
    pieces = _piece_plans(plan, kv.heads, q.shape[1] // k.shape[1])
    # per piece, made once: its query heads' views, lse contiguous (as the kernels take it), and as a
    # variable-length kernel takes it (None: the same)
    views = [(dout_j, q_j, out_j, lse_j.contiguous(), dq_j)
             for dout_j, q_j, out_j, lse_j, dq_j in (_heads(qs, q.shape[1], dout, q, out, lse, dq)
                                                     for qs, _ in pieces)]
    owns = [None if lse_own is None else _heads(qs, q.shape[1], lse_own)[0].contiguous() for qs, _ in pieces]
    lse_rows: list[dict] = [{} for _ in pieces]  # per piece: its lse row slices, made contiguous once
    for step in range(steps):
        tasks = first if step == 0 else plan.tasks(step, s, whole)
        for j, (_, piece_plan) in enumerate(pieces):
            kt, vt = kv.block(step, j)
            dout_j, q_j, out_j, lse_j, dq_j = views[j]
            _backward_step(dout_j, q_j, kt, vt, out_j, lse_j, piece_plan, step, dq_j,
                           lambda: dkv.arrived(j, step), *dkv.views(j), tasks, lse_rows[j],
                           fresh and step == 0, owns[j])
            dkv.pass_on(j, step)  # after the last step this hop returns each piece to its owner
        kv.advance()
        dkv.advance()
    for step in range(steps, world):  # a shortened ring: carry the accumulators home, nothing to add
        for j in range(n):
            dkv.arrived(j, step)
            dkv.pass_on(j, step)
        dkv.advance()
    kv.release(world)
    return (dq, *dkv.result(world))


class _Accumulators:
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


def _backward_step(dout: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, plan: RingPlan, step: int, dq: torch.Tensor,
                   wait_for_acc, dk_acc: torch.Tensor, dv_acc: torch.Tensor, tasks, lse_rows: dict,
                   fresh: bool = False, lse_own: torch.Tensor | None = None) -> None:
    """``tasks`` of one visiting block: dQ into ``dq``; dK/dV into the travelling accumulator, after
    ``wait_for_acc()`` says it has arrived (so that hop overlaps this step's compute).

    ``lse_rows``: the contiguous lse row slices of earlier steps (the same rows recur every step), filled here.
    ``fresh``: the accumulators hold nothing yet and the one task covers them whole: its results are copied in.
    ``lse_own``: ``lse`` as a variable-length kernel takes it, +inf where a row sees no key at all (None: no row
    can, :meth:`RingPlan.rows_may_see_nothing`; ``lse`` itself); row slices made once per call (:func:`_lse_rows`).
    On CUDA every add of the step (dQ, dK, dV of each task) is ONE :func:`foreach_into` after the wait
    (one launch for up to 4 adds, where torch's ``_foreach_add_`` would loop: fp32 accumulators, bf16 blocks);
    on CPU each dQ is added as soon as its task is done (its block freed at once)."""
    fused = dq.device.type == "cuda"
    partial: list[tuple[slice, torch.Tensor, torch.Tensor]] = []
    adds: list[tuple[str, slice, torch.Tensor, torch.Tensor]] = []  # CUDA: (accumulator, its rows, view, block)
    s, sk = q.shape[2], kt.shape[2]
    for task in tasks:
        rows = task.q
        lse_of = functools.partial(_lse_rows, lse, rows, lse_rows, lse_own)
        with breakdown.section(step, "kernel"):
            if _covers(rows, s):
                dq_b, dk_b, dv_b = plan.backward_block(task, dout, q, *_cols(kt, vt, task.kv), out, lse_of, step)
            else:
                dq_b, dk_b, dv_b = plan.backward_block(
                    task, dout[:, :, rows], q[:, :, rows], *_cols(kt, vt, task.kv), out[:, :, rows], lse_of, step)
        dq_view = dq if _covers(rows, s) else dq[:, :, rows]
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
            dk_view, dv_view = (dk_acc, dv_acc) if _covers(cols, sk) else _cols(dk_acc, dv_acc, cols)
            if fused:
                adds += (("dk", cols, dk_view, dk_b), ("dv", cols, dv_view, dv_b))
            elif fresh:
                dk_view.copy_(dk_b)
                dv_view.copy_(dv_b)
            else:
                dk_view.add_(dk_b)
                dv_view.add_(dv_b)
        _add_all(adds, add=not fresh)


def _add_all(adds: list[tuple[str, slice, torch.Tensor, torch.Tensor]], add: bool = True) -> None:
    """``view.add_(block)`` (``view.copy_(block)`` where not ``add``) for each entry, in as few
    :func:`foreach_into` calls as can be: one, unless two entries overlap in the same accumulator (the pairs of
    one call are updated in parallel, so overlapping ones go to the next call, which keeps each accumulator's
    additions in their order: the same result)."""
    batch: list[tuple[str, slice, torch.Tensor, torch.Tensor]] = []
    for entry in adds:
        name, sl = entry[0], entry[1]
        if any(n == name and sl.start < o.stop and o.start < sl.stop for n, o, _, _ in batch):
            foreach_into([e[2] for e in batch], [e[3] for e in batch], add=add)
            batch = []
        batch.append(entry)
    if batch:
        foreach_into([e[2] for e in batch], [e[3] for e in batch], add=add)


def _lse_rows(lse: torch.Tensor, rows: slice, cache: dict, lse_own: torch.Tensor | None = None,
             own: bool = False) -> torch.Tensor:
    """``lse[:, :, rows]`` contiguous (as the kernels take it; ``lse`` itself for all rows), made once per row
    slice and call (``cache``). ``own``: from ``lse_own`` instead, where given (a variable-length kernel's
    convention, +inf where a row sees no key)."""
    if own and lse_own is not None:
        lse, tag = lse_own, "own"
    else:
        tag = "ours"
    if _covers(rows, lse.shape[2]):
        return lse
    key = (tag, rows.start, rows.stop, rows.step)
    got = cache.get(key)
    if got is None:
        got = cache[key] = lse[:, :, rows].contiguous()
    return got


def _heads(qs: slice, h: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The query heads ``qs`` of each tensor (dim 1; the tensors themselves when ``qs`` is all ``h``)."""
    if _covers(qs, h):
        return tensors
    return tuple(t[:, qs] for t in tensors)


def _covers(sl: slice, n: int) -> bool:
    """Whether the row slice ``sl`` is all ``n`` rows (then the tensor itself is used, no view made)."""
    return sl.start == 0 and sl.stop == n and sl.step is None


def _cols(k: torch.Tensor, v: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V rows ``cols`` (the tensors themselves when that is all of them)."""
    if _covers(cols, k.shape[2]):
        return k, v
    return k[:, :, cols], v[:, :, cols]


def _memory_order(like: torch.Tensor) -> list[int]:
    """``like``'s dimensions from outermost to innermost in memory."""
    strides = like.stride()
    return sorted(range(like.ndim), key=strides.__getitem__, reverse=True)



class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper. Inputs/outputs are BHSD views; results keep the strides of the inputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                sink: torch.Tensor | None = None, perm: tuple[int, ...] | None = None) -> torch.Tensor:
        """``sink``: optional fp32 ``[h]`` softmax offsets (attention sinks), folded into the lse.

        ``perm``: q, k, v come in the caller's layout, ``t.permute(perm)`` is BHSD; the output (and the
        gradients) are returned in the caller's layout. The views are made here, so autograd records no
        view nodes around the call (less host time per call)."""
        plan.checks.backward_follows = any(ctx.needs_input_grad[:3])  # where the status is read (core/status.py)
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
        q, k, v, out, lse, sink = ctx.saved_tensors
        perm = ctx.perm
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
    out = torch.empty_strided(shape, _strides_like(shape, q), dtype=q.dtype, device=q.device)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for hs, qs in query_heads(heads, q.shape[1] // sum(h.stop - h.start for h in heads)):
        acc, lse_part = run(hs, qs)
        if sink is not None:
            fold_sink(acc, lse_part, sink[qs])
        out[:, qs].copy_(acc)
        lse[:, qs].copy_(lse_part)
        del acc, lse_part
    return out, lse


def refuse_on_ring(plan: RingPlan, k: torch.Tensor, v: torch.Tensor, refusal: BaseException) -> NoReturn:
    """This rank's input was refused after the cross-rank check: take part in the forward ring anyway,
    then raise ``refusal``. The forward runs as :func:`ring_forward` does (the same :class:`_KVStream`), its
    K/V zeros marked with a failing status and nothing computed, so the others raise at the end of that
    ring, or at the start of the backward ring (see :mod:`.status`).

    ``k``, ``v``: BHSD, only their shapes matter (``[b, h_kv, s, d]``; v's head dim from ``v``)."""
    b, h_kv, s, d = k.shape
    zk = k.new_zeros((b, h_kv, s, d))
    zv = k.new_zeros((b, h_kv, s, v.shape[-1]))
    with torch.no_grad():
        ring_forward(zk, zk, zv, plan, refusal=refusal)
    raise refusal


def _for_heads(plan: RingPlan, qs: slice) -> RingPlan:
    """The plan for the query heads ``qs`` of a K/V piece (dropout keys on global heads; the
    max-logit rows of those heads)."""
    if plan.dropout is None and plan.row_max is None:
        return plan
    return replace(plan, dropout=plan.heads_dropout(qs.start),
                   row_max=None if plan.row_max is None else plan.row_max[qs])


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
            dst = torch.empty_strided(acc.shape, _strides_like(acc.shape, like), dtype=like.dtype, device=like.device)
        got.append(dst)
        dsts.append(dst)
        srcs.append(acc)
    foreach_into(dsts, srcs)
    return got


def _strides_like(shape, like: torch.Tensor) -> list[int]:
    """Dense strides for ``shape`` in ``like``'s memory order."""
    strides, step = [0] * like.ndim, 1
    for i in reversed(_memory_order(like)):
        strides[i], step = step, step * shape[i]
    return strides
