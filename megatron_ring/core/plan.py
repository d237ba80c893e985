"""The engine's plan of one call: :class:`RingPlan`, everything the ring needs besides the tensors (the ring,
the layout's schedule and mask, the block kernel, the wire codec, dropout, pieces), and the block calls it
makes (:meth:`RingPlan.forward_block` / :meth:`RingPlan.backward_block`: which kernel a task runs on)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megatron_ring.kernels.dropout import DropoutKernel, DropoutSpec, FusedDropoutKernel
from megatron_ring.wire.codecs import KVCodec
from megatron_ring.transport.ring import Transport
from megatron_ring.kernels.block import BlockKernel, ReversedKernel
from megatron_ring.kernels.head_dim import pads_to
from megatron_ring.kernels.varlen import masked_kernel, whole_blocks
from megatron_ring.kernels.varlen_plan import one_task
from megatron_ring.schedules.layouts import Schedule, TaskKind
from megatron_ring.schedules.masks import AttentionMask, needed_steps, schedule
from megatron_ring.schedules.on_device import positions_on
from megatron_ring.core.launch import direct_launch_ok, has_triton
from megatron_ring.core.status import PendingChecks, StatusRecorder

__all__ = ["RingPlan", "for_heads"]


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
    #: status codes the forward ring left to check before the backward ring's first exchange (CUDA; core/status.py);
    #: shared by the plans derived from this one (dataclasses.replace keeps the object)
    checks: PendingChecks = field(default_factory=PendingChecks, compare=False, repr=False)
    #: in a collective strategy's call: where a refusal is recorded (strategies/refusal.py), else None
    strategy_status: StatusRecorder | None = field(default=None, compare=False, repr=False)
    #: QK-clip: fp32 ``[h, s]`` running max of the scaled logits per query head and local query row of this
    #: plan's q, folded in place by the forward (core/max_logit.py); None: not asked, nothing computed
    row_max: torch.Tensor | None = field(default=None, compare=False, repr=False)
    #: the call's tag (core/validation.py: call_tag): what the status this rank's K/V carry says when all is well,
    #: compared with every other rank's on every call (core/status.py); 0: not compared
    tag: int = 0
    #: this call's forward ring's number on its transport (``Transport.forward_rings``, set by the forward; -1: not
    #: run): with the tag, what the backward ring's status says (core/backward_check.py: BackwardTag)
    number: int = field(default=-1, compare=False)
    #: the call's ``(d_qk, d_v)`` (None: not given, as the kernel's operands have them): with MLA head dims that
    #: ``kernel`` takes as they are (cuDNN), the masked tasks' kernel, which takes one, is padded (kernels/varlen.py)
    head_dims: tuple[int, int] | None = None

    def runs_whole_blocks(self, q: torch.Tensor) -> bool:
        """Whether this call's masked tasks run as whole blocks, not tiles: on a variable-length kernel that
        takes ``q``'s case (kernels/varlen.py: whole_blocks), or with dropout on its fused kernels, which find
        each pair's visibility themselves and skip the tile pairs that see nothing. Asked once per call."""
        if self.mask is None:
            return False
        if self.dropout is not None:
            return fused_dropout(q.device) and FusedDropoutKernel.fuses(q)
        return whole_blocks(self.kernel, q, self.head_dims)

    def tasks(self, step: int, s: int, whole: bool = False):
        """The tasks of ``step`` for local blocks of ``s`` rows (``whole``: :meth:`runs_whole_blocks`)."""
        src = (self.ring.rank - step) % self.ring.world
        if self.mask is None:
            return self.layout.block_tasks(self.causal, self.ring.world, self.ring.rank, src, s)
        if not whole:
            return schedule(self.layout, self.mask, self.ring.world, self.ring.rank, src, s)
        # a whole block whose mask the kernel takes at once is one task: on the variable-length kernel, one it has a
        # plan for; on the fused dropout kernels, any
        return schedule(self.layout, self.mask, self.ring.world, self.ring.rank, src, s, s,
                        one_task if self.dropout is None else FusedDropoutKernel.one_task)

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
            fused = fused_dropout(device)
            kernel = FusedDropoutKernel(self.dropout, direct_launch_ok) if fused else DropoutKernel(self.dropout)
            return (kernel, task.causal,
                    dict(mask=task.explicit_mask(), **self.positions(task, step, device)))
        if kind is TaskKind.FULL or kind is TaskKind.CAUSAL:
            return self.kernel, task.causal, {}
        if kind is TaskKind.REVERSED:  # key >= query: top-left causal on reversed rows, unmasked
            return ReversedKernel(self.kernel), True, {}
        kernel = masked_kernel(self.kernel, self.head_dims)
        kw = {"mask": task.explicit_mask()}
        if getattr(kernel, "takes_kernel_lse", False):  # its lse in its own convention (kernels/varlen.py)
            kw["kernel_lse"] = True
        return kernel, False, kw

    @property
    def operand_pad(self) -> int | None:
        """The head dim this call's kernel pads its operands to (kernels/head_dim.py), or, where it takes MLA head
        dims as they are, its masked tasks' kernel; the engine pads them once per ring instead
        (:class:`~megatron_ring.kernels.head_dim.RingPads`) for the tasks whose kernel pads. None: nothing to
        pad, or dropout (its kernels take the head dims as they are)."""
        if self.dropout is not None:
            return None
        d = pads_to(self.kernel)
        if d is None and self.mask is not None:
            d = pads_to(masked_kernel(self.kernel, self.head_dims))
        return d

    def forward_block(self, task, q, k, v, step: int | None = None, padded=None):
        """``(out, lse, posinf_empty)``: the block's result; ``posinf_empty``: its lse is the kernel's own, +inf
        where a row sees no key (a variable-length kernel's; the merge reads it as -inf, merge_into).
        ``padded``: None, or a function giving ``(q, k, v)`` padded to :attr:`operand_pad` (the same rows and
        columns), which a task whose kernel pads takes instead."""
        kernel, causal, kw = self._kernel_for(task, step, q.device)
        if padded is not None and pads_to(kernel) is not None:
            kw["dims"] = (k.shape[-1], v.shape[-1])
            q, k, v = padded()
        return (*kernel.forward(q, k, v, causal, self.scale, **kw), kw.get("kernel_lse", False))

    def backward_block(self, task, dout, q, k, v, out, lse, step: int | None = None, padded=None):
        """``lse``: the lse of the task's rows as :meth:`forward_block` gave it (the kernel takes either
        convention), or ``lse(own)``, a function giving it in ours (``own`` False) or in a variable-length
        kernel's (True: +inf where a row sees no key), made once per call by the caller. ``padded``: None, or a
        function giving ``(dout, q, out, k, v)`` padded (:meth:`forward_block`)."""
        kernel, causal, kw = self._kernel_for(task, step, q.device)
        if callable(lse):
            lse = lse(kw.get("kernel_lse", False))
        elif "kernel_lse" in kw:  # a tensor in either convention: the kernel fixes it up itself
            kw["kernel_lse"] = False
        if padded is not None and pads_to(kernel) is not None:
            kw["dims"] = (k.shape[-1], v.shape[-1])
            dout, q, out, k, v = padded()
        return kernel.backward(dout, q, k, v, out, lse, causal, self.scale, **kw)

    def rows_may_see_nothing(self, s: int) -> bool:
        """Whether a local query row may see no key at all: only padding does (tokens at or past the last
        document's end; a window always holds the diagonal), so only documents that end before the
        ``s * world`` tokens of the stream."""
        m = self.mask
        return m is not None and m.cu_seqlens is not None and m.cu_seqlens[-1] < s * self.ring.world


def fused_dropout(device: torch.device) -> bool:
    """Whether attention dropout runs on its fused kernels on ``device`` (kernels/dropout_triton.py): CUDA with
    Triton (fp16/bf16 inputs; fp32 run the torch kernel, :meth:`FusedDropoutKernel.fuses`)."""
    return device.type == "cuda" and has_triton()


def for_heads(plan: RingPlan, qs: slice) -> RingPlan:
    """The plan for the query heads ``qs`` of a K/V piece (dropout keys on global heads; the
    max-logit rows of those heads)."""
    if plan.dropout is None and plan.row_max is None:
        return plan
    return replace(plan, dropout=plan.heads_dropout(qs.start),
                   row_max=None if plan.row_max is None else plan.row_max[qs])
