"""Masked tasks (packed documents, window edges, padding) on a variable-length flash kernel.

A masked task's :class:`~megatron_ring.schedules.masks.BlockMask` becomes a segment plan
(:mod:`megatron_ring.kernels.varlen_plan`): a few calls of a variable-length kernel, each over consecutive
query rows and key rows cut into segments, with one window per call. Two kernels run such plans:

* :class:`VarlenFlashCudaKernel` (``varlen_cuda``): torch's ``aten._flash_attention_forward`` /
  ``aten._flash_attention_backward`` with ``cum_seq_q/k`` (THD-packed ``[rows, heads, d]`` views of the BHSD
  block; a batch of ``b`` is ``b`` times the segments), GQA native (K/V heads are not repeated). The backward
  gets what torch's autograd formula for ``_flash_attention_forward`` passes (``tests/fake_cuda/test_conformance.py``):
  the lse in the forward's layout ``[heads, rows]`` with ``+inf`` for rows that see no key, the forward's
  (unused, no dropout) rng_state and offset. sm80+, fp16/bf16, head dim <= 256 and a multiple of 8; not in
  deterministic mode (as ``flash_cuda``). Run on an H200 (2026-11-27): ``tests/gpu/test_gpu_varlen.py`` and the GPU
  engine tests pass vs float64; that first run found the kernel's two window rewrites (a bound
  ``>= max_seqlen_k`` dropped, a -1 opposite a set bound made ``max_seqlen_k``), now modelled by the stand-in and
  avoided by :attr:`~megatron_ring.kernels.varlen_plan.VarlenCall.kernel_max_k`.
* :class:`VarlenCPUKernel` (``varlen_cpu``): a CPU stand-in with the same documented semantics (per segment:
  bottom-right aligned causal and window after the kernel's rewrites of the window given ``max_seqlen_k``, GQA,
  rows that see no key give out 0 and lse ``+inf``), fp32 math
  per segment, written from those semantics; :func:`cpu_stand_in` makes the engine send masked tasks on CPU
  to it, so the same plans are checked against float64 in CI.

:func:`masked_kernel` is the engine's choice for masked tasks: the variable-length kernel where the plan's
kernel is a fused CUDA kernel and the case fits, else :class:`~megatron_ring.kernels.block.MathKernel` (fp32 on
CUDA, deterministic mode -- the plan's kernel's, ``BlockKernel.is_deterministic`` --, a mask with no exact
plan). :data:`COUNTS` counts the tasks each ran.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from megatron_ring.kernels.block import (BlockKernel, MathKernel, _deterministic_refusal, _flash_backward_gap,
                                          _fused_cuda_case, _torch_switches, _turned_off_in_torch,
                                          _unused_rng, operand_head_dim)
from megatron_ring.kernels.head_dim import HeadDimPadKernel, padded_kernel
from megatron_ring.kernels.varlen_plan import SegmentPlan, VarlenCall, plan_for, visible_in_segment

__all__ = ["VarlenFlashCudaKernel", "VarlenCPUKernel", "masked_kernel", "whole_blocks", "cpu_stand_in", "COUNTS",
           "FUSED_CUDA", "no_key_as"]

#: masked tasks run, by kernel: "varlen_cuda", "varlen_cpu", "math" (a fallback: the case or the mask does not fit)
COUNTS: Counter = Counter()
#: dense kernels whose masked tasks go to the variable-length flash kernel on CUDA
FUSED_CUDA = ("cudnn", "flash_cuda", "flash_attn", "te_fused", "sdpa_cuda")

_MATH = MathKernel()
_stand_in = False


@contextlib.contextmanager
def cpu_stand_in(on: bool = True):
    """Within: masked tasks on CPU run on :class:`VarlenCPUKernel` (the plans of the CUDA path, checked on CPU)."""
    global _stand_in
    before, _stand_in = _stand_in, on
    try:
        yield
    finally:
        _stand_in = before


def _thd(x: torch.Tensor) -> torch.Tensor:
    """BHSD ``[b, h, s, d]`` -> packed ``[b * s, h, d]`` (a view where the memory allows, else a copy)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _bhsd(x: torch.Tensor, b: int) -> torch.Tensor:
    """Packed ``[b * s, h, d]`` -> BHSD view ``[b, h, s, d]``."""
    n, h, d = x.shape
    return x.view(b, n // b, h, d).transpose(1, 2)


def no_key_as(lse: torch.Tensor, value: float) -> torch.Tensor:
    """``lse`` with its infinite entries (rows that see no key: +inf in the kernel's convention, -inf in the
    engine's) set to ``value``, in one element-wise kernel (NaN stays NaN); finite entries unchanged."""
    return lse.nan_to_num(nan=float("nan"), posinf=value, neginf=value)


class _VarlenKernel(BlockKernel):
    """Runs a masked task as its segment plan's calls (``_fwd`` / ``_bwd`` on packed rows); a task without a
    plan, or a case the kernel does not take, runs on the math kernel (counted in :data:`COUNTS`)."""

    supports_mask = True
    #: ``forward``/``backward`` take ``kernel_lse=True``: the lse in the kernel's own convention (+inf for a row
    #: that sees no key), so the engine does the fix-ups in its merge and once per call (core/engine.py)
    takes_kernel_lse = True

    def __init__(self) -> None:
        self._fits: dict[tuple, bool] = {}

    def fits(self, q: torch.Tensor, head_dim: int) -> bool:
        """Whether this kernel takes ``q``'s case (cached per device, dtype, head dim, determinism and torch's SDPA
        switches)."""
        key = (q.device, q.dtype, head_dim, self.is_deterministic(), _torch_switches())
        fits = self._fits.get(key)
        if fits is None:
            fits = self._fits[key] = self.unsupported(q, head_dim) is None
        return fits

    def _plan(self, q, v, mask) -> SegmentPlan | None:
        fits = self.fits(q, max(q.shape[-1], v.shape[-1]))
        plan = plan_for(mask) if fits and mask is not None else None
        COUNTS[self.name if plan is not None else "math"] += 1
        return plan

    def forward(self, q, k, v, causal, scale, mask=None, kernel_lse=False):
        """``kernel_lse``: return the lse as the kernel gives it, +inf (not -inf) where a row sees no key (the
        math fallback's -inf stays): the caller reads +inf as -inf."""
        plan = self._plan(q, v, mask)
        if plan is None:
            return _MATH.forward(q, k, v, causal, scale, mask=mask)
        b = q.shape[0]
        results = []
        for call, (cq, ck) in zip(plan.calls, plan.cum(q.device, b)):
            o, lse = self._fwd(_thd(q[:, :, call.q]), _thd(k[:, :, call.kv]), _thd(v[:, :, call.kv]), cq, ck,
                               call, b, scale)
            results.append((call, _bhsd(o, b), lse.view(lse.shape[0], b, -1).transpose(0, 1)))
        if len(results) == 1 and not plan.shared_keys:
            _, out, lse = results[0]
        elif not plan.shared_keys:
            out = q.new_empty((*q.shape[:3], v.shape[-1]))
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        else:  # rows no call covers see no key
            out = q.new_zeros((*q.shape[:3], v.shape[-1]))
            lse = q.new_full(q.shape[:3], float("inf" if kernel_lse else "-inf"), dtype=torch.float32)
        if len(results) > 1 or plan.shared_keys:
            for call, o, l_ in results:
                out[:, :, call.q] = o
                lse[:, :, call.q] = l_
        return out, lse if kernel_lse else no_key_as(lse, float("-inf"))  # rows that see no key: our -inf

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, kernel_lse=False):
        """``kernel_lse``: ``lse`` is already +inf (not -inf) where a row sees no key."""
        plan = self._plan(q, v, mask)
        if plan is None:
            if kernel_lse:
                lse = no_key_as(lse, float("-inf"))
            return _MATH.backward(dout, q, k, v, out, lse, causal, scale, mask=mask)
        b, h = q.shape[:2]
        # the kernel's lse layout [heads, rows] with +inf where a row sees no key (the forward's values)
        lse_k = (lse if kernel_lse else no_key_as(lse, float("inf"))).transpose(0, 1)
        grads = []
        for call, (cq, ck) in zip(plan.calls, plan.cum(q.device, b)):
            dq, dk, dv = self._bwd(_thd(dout[:, :, call.q]), _thd(q[:, :, call.q]), _thd(k[:, :, call.kv]),
                                   _thd(v[:, :, call.kv]), _thd(out[:, :, call.q]),
                                   # dense [heads, rows]: the kernel reads it with no strides of its own (one
                                   # batch row and a call of some rows: reshape gives a strided view)
                                   lse_k[:, :, call.q].reshape(h, -1).contiguous(), cq, ck, call, b, scale)
            grads.append((call, _bhsd(dq, b), _bhsd(dk, b), _bhsd(dv, b)))
        if len(grads) == 1 and not plan.shared_keys:
            return grads[0][1:]
        dq = q.new_zeros(q.shape) if plan.shared_keys else torch.empty_like(q)
        dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
        for call, a, b_, c in grads:
            dq[:, :, call.q] = a
            if plan.shared_keys:
                dk[:, :, call.kv] += b_
                dv[:, :, call.kv] += c
            else:
                dk[:, :, call.kv] = b_
                dv[:, :, call.kv] = c
        return dq, dk, dv

    def _fwd(self, q, k, v, cum_q, cum_k, call: VarlenCall, b: int, scale: float):
        """``(out [rows, h, d_v], lse [h, rows] fp32, +inf where a row sees no key)`` of packed rows."""
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, cum_q, cum_k, call: VarlenCall, b: int, scale: float):
        """``(dq, dk, dv)`` packed; ``lse`` as ``_fwd`` returns it."""
        raise NotImplementedError


class VarlenFlashCudaKernel(_VarlenKernel):
    """torch's variable-length CUDA flash kernel (see the module doc)."""

    name = "varlen_cuda"
    head_dim_multiple = 8

    def unsupported(self, q, head_dim):
        return (_fused_cuda_case(q, head_dim, 256) or _flash_backward_gap(q, head_dim)
                or _turned_off_in_torch("flash") or _deterministic_refusal(self, torch_flash=True))

    @staticmethod
    def _args(call: VarlenCall, scale: float) -> dict:
        left, right = call.window
        return dict(scale=scale, window_size_left=left, window_size_right=right)

    def _fwd(self, q, k, v, cum_q, cum_k, call, b, scale):
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cum_q, cum_k, call.max_q, call.kernel_max_k, 0.0, call.causal, False, **self._args(call, scale))
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, cum_q, cum_k, call, b, scale):
        # without dropout the forward's rng_state and offset are not read: made as the forward makes them
        rng_state, unused = _unused_rng(q, torch.uint64, (2,))
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, call.max_q, call.kernel_max_k, 0.0, call.causal, rng_state, unused,
            **self._args(call, scale))


class VarlenCPUKernel(_VarlenKernel):
    """The CPU stand-in: the variable-length flash kernel's documented semantics in fp32, per segment."""

    name = "varlen_cpu"

    def unsupported(self, q, head_dim):
        return None if q.device.type == "cpu" else f"it runs on CPU only, not {q.device.type}"

    @staticmethod
    def _segments(call: VarlenCall, b: int):
        cq, ck = call.batched(b)
        return [(qa, qb, ka, kb) for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]) if qb > qa]

    @staticmethod
    def _scores(q, k, call, qa, qb, ka, kb, scale):
        """fp32 scores ``[h_kv, g, sq, sk]`` of one segment, hidden pairs -inf."""
        h, hk = q.shape[1], k.shape[1]
        qs = q[qa:qb].float().transpose(0, 1).reshape(hk, h // hk, qb - qa, -1)
        s = torch.einsum("kgqd,ksd->kgqs", qs, k[ka:kb].float().transpose(0, 1)) * scale
        ok = visible_in_segment(qb - qa, kb - ka, call.causal, *call.window, call.kernel_max_k)
        return s.masked_fill(~ok, float("-inf"))

    def _fwd(self, q, k, v, cum_q, cum_k, call, b, scale):
        n, h, _ = q.shape
        out = torch.zeros(n, h, v.shape[-1], dtype=q.dtype)
        lse = torch.full((h, n), float("inf"))  # rows that see no key: the kernel's +inf, out 0
        for qa, qb, ka, kb in self._segments(call, b):
            if kb == ka:
                continue
            s = self._scores(q, k, call, qa, qb, ka, kb, scale)
            m = torch.logsumexp(s, -1)  # [h_kv, g, sq]
            p = torch.exp(s - m.masked_fill(torch.isneginf(m), 0.0)[..., None])
            o = torch.einsum("kgqs,ksd->kgqd", p, v[ka:kb].float().transpose(0, 1))
            out[qa:qb] = o.reshape(h, qb - qa, -1).transpose(0, 1).to(q.dtype)
            lse[:, qa:qb] = m.reshape(h, qb - qa).masked_fill(torch.isneginf(m.reshape(h, qb - qa)), float("inf"))
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, cum_q, cum_k, call, b, scale):
        n, h, _ = q.shape
        hk = k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dk = torch.zeros(k.shape, dtype=torch.float32)
        dv = torch.zeros(v.shape, dtype=torch.float32)
        grouped = lambda x, a, z: x[a:z].float().transpose(0, 1).reshape(hk, h // hk, z - a, -1)  # noqa: E731
        for qa, qb, ka, kb in self._segments(call, b):
            if kb == ka:
                continue
            s = self._scores(q, k, call, qa, qb, ka, kb, scale)
            p = torch.exp(s - lse[:, qa:qb].reshape(hk, h // hk, qb - qa)[..., None])  # lse +inf: p = 0
            do, o, qs = grouped(dout, qa, qb), grouped(out, qa, qb), grouped(q, qa, qb)
            ks, vs = k[ka:kb].float().transpose(0, 1), v[ka:kb].float().transpose(0, 1)
            delta = (do * o).sum(-1, keepdim=True)
            dp = torch.einsum("kgqd,ksd->kgqs", do, vs)
            ds = p * (dp - delta) * scale
            dq[qa:qb] = torch.einsum("kgqs,ksd->kgqd", ds, ks).reshape(h, qb - qa, -1).transpose(0, 1)
            dk[ka:kb] = torch.einsum("kgqs,kgqd->ksd", ds, qs).transpose(0, 1)
            dv[ka:kb] = torch.einsum("kgqs,kgqd->ksd", p, do).transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _with_flag(det: bool | None) -> VarlenFlashCudaKernel:
    kernel = VarlenFlashCudaKernel()
    kernel.deterministic = det
    return kernel


#: per determinism flag of the plan's kernel (True/False: the call's, None: the process default)
_VARLEN_CUDA = {det: _with_flag(det) for det in (None, True, False)}
_VARLEN_CPU = VarlenCPUKernel()


def masked_kernel(kernel: BlockKernel, head_dims: tuple[int, int] | None = None) -> BlockKernel:
    """The kernel for the masked tasks of a plan whose kernel is ``kernel``: the variable-length flash kernel for a
    fused CUDA kernel (it falls back to the math kernel per case it does not take), the CPU stand-in within
    :func:`cpu_stand_in`, ``kernel`` itself if it takes masks, else the math kernel. The head-dim padding
    (:class:`HeadDimPadKernel`: MLA head dims, or a head dim the kernels do not take) wraps the chosen kernel as it
    wraps ``kernel``; with MLA ``head_dims`` (the call's ``(d_qk, d_v)``) that ``kernel`` takes as they are (cuDNN),
    the variable-length kernels, which take one head dim, are padded to the larger."""
    base = kernel.base if isinstance(kernel, HeadDimPadKernel) else kernel
    if _stand_in and base.name in ("flash_cpu", "math"):
        chosen = _VARLEN_CPU
    elif base.name in FUSED_CUDA:
        chosen = _VARLEN_CUDA[base.deterministic]  # the call's determinism, as the plan's kernel has it
    elif kernel.supports_mask:
        return kernel
    else:
        chosen = _MATH
    if chosen is _MATH:
        return chosen
    if isinstance(kernel, HeadDimPadKernel):
        return padded_kernel(chosen, kernel.d)
    if head_dims is not None and head_dims[0] != head_dims[1]:
        return padded_kernel(chosen, operand_head_dim(chosen, max(head_dims)))
    return chosen


def whole_blocks(kernel: BlockKernel, q: torch.Tensor, head_dims: tuple[int, int] | None = None) -> bool:
    """True when the masked tasks of a plan whose kernel is ``kernel`` run on a variable-length kernel (which
    takes ``q``'s case: else they fall back to the math kernel, which needs tiles to bound its memory): the
    schedule then hands it whole blocks (one masked task per run of rows, :func:`..schedules.masks.schedule`
    with ``tile`` = the block) instead of tiles, since the kernel skips the hidden pairs itself. On tiles a
    packed block of documents became dozens of small calls, each with its merge: on an H200 (2026-11-27) 1,015
    to 8,240 launches per call and 1-2% of one-GPU variable-length flash, host-bound."""
    chosen = masked_kernel(kernel, head_dims)
    if not isinstance(chosen, HeadDimPadKernel):
        return isinstance(chosen, _VarlenKernel) and chosen.fits(q, q.shape[-1])
    return isinstance(chosen.base, _VarlenKernel) and chosen.base.fits(q, chosen.d)  # the dim it is handed
