"""One call of :func:`~megatron_ring.api.ring_attention`, normalised once: the cross-rank agreement on its
arguments and the wire codec, the tensor format (``thd`` unpacked), the K/V piece count, then a frozen
:class:`Call` whose schedule (layout and mask) is built once and whose engine plan is built in one place, for
the call itself or for the refusal of a rank-local input error (:meth:`Call.refusing`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from megatron_ring.core.launch import direct_launch_ok, has_triton
from megatron_ring.kernels.head_dim import padded_kernel
from megatron_ring.kernels.dropout import DropoutSpec
from megatron_ring.wire.codecs import KVCodec, make_codec
from megatron_ring.core.plan import RingPlan
from megatron_ring.core.max_logit import new_row_max
from megatron_ring.kernels.block import BlockKernel, MathKernel, operand_head_dim, select_kernel
from megatron_ring.schedules.layouts import Layout, get_layout
from megatron_ring.schedules.masks import AttentionMask
from megatron_ring.strategies import Refusal, refuse
from megatron_ring.core.rotation import piece_count
from megatron_ring.core.validation import (call_signature, call_tag, check_cu_seqlens, check_same_across_ranks,
                                           check_window)

__all__ = ["Call", "agree", "offset_kind", "sink_logits", "dropout_spec", "attention_mask"]


def agree(ring: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Any, layout: Any,
          qkv_format: str, cu_seqlens: Any, window: Any, comm_type: str, head_chunks: Any,
          hierarchical_groups: Any, comm_dtype: Any, softmax_scale: Any, check_consistency: bool,
          kv_pieces: int | None, extras: tuple, per_call: dict | None = None, max_logit: bool = False) -> "Call":
    """The cross-rank check of the call's arguments and the wire codec (:func:`_agreed_codec`), then the
    tensors in the call's format (``thd`` as one ``bshd`` sequence) and the piece count: a frozen Call."""
    codec, tag = _agreed_codec(ring, q, k, v, causal=bool(causal), layout=layout, qkv_format=qkv_format,
                          cu_seqlens=cu_seqlens, window=window, comm_type=comm_type, head_chunks=head_chunks,
                          comm_dtype=comm_dtype, softmax_scale=softmax_scale, check_consistency=check_consistency,
                          extras=extras, per_call=per_call)
    thd, fmt, (q, k, v) = _unpack(qkv_format, cu_seqlens, q, k, v)
    s_dim = 1 if fmt == "bshd" else 0
    return Call(ring=ring, causal=bool(causal), layout=layout, qkv_format=fmt, thd=thd, s_dim=s_dim,
                cu_seqlens=cu_seqlens, window=window, comm_type=comm_type, head_chunks=head_chunks,
                hierarchical_groups=hierarchical_groups, codec=codec, pieces=_pieces(kv_pieces, q, k, s_dim),
                tensors=(q, k, v), max_logit=max_logit, tag=tag)


def _unpack(qkv_format: str, cu_seqlens: Any, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> tuple[bool, str, tuple[torch.Tensor, ...]]:
    """``thd`` (packed tokens) as one ``bshd`` sequence: (thd, the format the engine sees, q, k, v)."""
    if qkv_format == "thd":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.ndim != 3:
                raise ValueError(f"qkv_format='thd' expects {name} as [t, h, d] (packed tokens), got shape "
                                 f"{tuple(t.shape)}; for [s, b, h, d] use qkv_format='sbhd', for [b, s, h, d] "
                                 "qkv_format='bshd'")
        return True, "bshd", (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    if cu_seqlens is not None:
        raise ValueError(f"cu_seqlens describes packed documents: use qkv_format='thd' ([t, h, d]), got "
                         f"qkv_format={qkv_format!r}")
    return False, qkv_format, (q, k, v)


@dataclass(frozen=True)
class Call:
    """One call, normalised (:func:`agree` builds it): its options, the tensors in its format (``thd``
    unpacked to ``bshd``; BHSD views), the schedule (layout and mask, each built once), the engine plan
    (:meth:`ring_plan`, the one place a RingPlan is made for a call) and the refusal of rank-local input
    errors (:meth:`refusing`)."""

    ring: Any
    causal: bool
    layout: Any  # as given (a name or a Layout)
    qkv_format: str  # "bshd" or "sbhd" ("thd" is unpacked to "bshd")
    thd: bool
    s_dim: int
    cu_seqlens: Any
    window: Any
    comm_type: str
    head_chunks: Any
    hierarchical_groups: Any
    codec: KVCodec
    pieces: int
    tensors: tuple  # q, k, v in the call's format
    max_logit: bool = False  # return_max_logit: the plan carries the per-row max accumulator
    tag: int = 0  # the call's signature as the ring's status carries it, compared every call (0: not compared)

    @property
    def perm(self) -> tuple[int, ...]:
        """``t.permute(perm)`` is the BHSD view of a tensor in the call's format."""
        return (0, 2, 1, 3) if self.qkv_format == "bshd" else (1, 2, 0, 3)

    def bhsd(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if self.qkv_format == "bshd" else t.permute(1, 2, 0, 3)

    def from_bhsd(self, out: torch.Tensor) -> torch.Tensor:
        """A BHSD tensor in the call's format (a view)."""
        return out.transpose(1, 2) if self.qkv_format == "bshd" else out.permute(2, 0, 1, 3)

    def repack(self, out: torch.Tensor) -> torch.Tensor:
        """The output in the caller's format, contiguous (e.g. q was a non-dense view)."""
        out = out.squeeze(0) if self.thd else out
        return out if out.is_contiguous() else out.contiguous()

    @functools.cached_property
    def schedule_layout(self) -> Layout:
        """The layout object (built once per call; ValueError names the fix)."""
        return get_layout(self.layout)

    @functools.cached_property
    def mask(self) -> AttentionMask:
        """The validated mask of the whole stream (built once per call; ValueError names the fix)."""
        q = self.tensors[0]
        return attention_mask(self.causal, self.cu_seqlens, self.window, q.shape[self.s_dim] * self.ring.world)

    def checked_scale(self, softmax_scale: Any) -> float:
        """The layout checked against the local length (first), the mask validated, then the softmax scale."""
        q = self.tensors[0]
        self.schedule_layout.check_local_len(q.shape[self.s_dim], self.ring.world)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
        self.mask  # noqa: B018 - validated here, after the layout's check (the order the errors are raised in)
        return float(scale)

    def ring_plan(self, kernel: BlockKernel, scale: float, dropout: DropoutSpec | None = None,
                  row_max: torch.Tensor | None = None) -> RingPlan:
        """The engine's plan for this call: the one place a call's RingPlan is made."""
        mask = self.mask
        return RingPlan(ring=self.ring, layout=self.schedule_layout, causal=self.causal, scale=scale,
                        kernel=kernel, codec=self.codec, mask=None if mask.plain else mask, dropout=dropout,
                        pieces=self.pieces, row_max=row_max, tag=self.tag,
                        head_dims=(self.tensors[0].shape[-1], self.tensors[2].shape[-1]))

    def _row_max(self, qh: torch.Tensor | None) -> torch.Tensor | None:
        """``return_max_logit``: the fp32 ``[h, s]`` per-row max accumulator of the BHSD ``qh`` (-inf)."""
        return new_row_max(qh.shape[1], qh.shape[2], qh.device) if self.max_logit and qh is not None else None

    def mla_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The call's K and V as BHSD views where V's head dim differs from Q's (MLA: what :func:`select_kernel`
        and :meth:`padded` ask a kernel about), else None."""
        q, k, v = self.tensors
        return None if v.shape[-1] == q.shape[-1] else (self.bhsd(k), self.bhsd(v))

    def padded(self, kernel: BlockKernel) -> BlockKernel:
        """``kernel``, zero-padding its operands (exact, kernels/head_dim.py) when v's head dim differs from q's
        (MLA) and the kernel does not take them so (:meth:`~BlockKernel.unsupported_head_dims`: cuDNN where torch's
        own SDPA hands it those head dims), or the head dim is not a multiple of what the kernel takes (8 for the
        fused CUDA ones)."""
        q, k, v = self.tensors
        dqk, dv = q.shape[-1], v.shape[-1]
        d = operand_head_dim(kernel, max(dqk, dv))
        if dqk == d and dv == d:
            return kernel
        if dqk != dv and kernel.unsupported_head_dims(self.bhsd(q), *self.mla_kv()) is None:
            return kernel
        return padded_kernel(kernel, d)

    def plan(self, scale: float, kernel: BlockKernel, qh: torch.Tensor, dropout: DropoutSpec | None) -> RingPlan:
        """The call's plan, its kernel :meth:`padded`."""
        plan = self.ring_plan(self.padded(kernel), scale, dropout, self._row_max(qh))
        if not (isinstance(self.head_chunks, int) and self.head_chunks >= 1):
            raise ValueError(f"head_chunks must be a positive integer, got {self.head_chunks!r}")
        return plan

    def refusing(self, check, *args: Any) -> Any:
        """``check(*args)``; a ValueError it raises on this rank only (after the cross-rank check) is
        raised on every rank: this rank first takes part in the forward's exchanges
        (:func:`~megatron_ring.strategies.refuse`), the others raise naming it."""
        try:
            return check(*args)
        except ValueError as exc:
            self._refuse(exc)

    def _refuse(self, exc: ValueError) -> NoReturn:
        q, k, v = self.tensors
        collective = self.comm_type != "p2p"
        if (self.ring.world == 1 or self.codec is None or k.ndim != 4 or v.ndim != 4
                or not (isinstance(self.head_chunks, int) and self.head_chunks >= 1)  # refused before any exchange
                or (collective and (self.ring.group is None or q.ndim != 4))):
            raise exc
        try:
            self.schedule_layout, self.mask  # noqa: B018 - built once, shared with the call's own plan
        except ValueError:  # every rank raises that before any exchange
            raise exc from None
        qh = self.bhsd(q) if q.ndim == 4 else None
        # the ring alone computes nothing; the collective strategies run their forward on zeros
        kernel = (self.padded(select_kernel(qh, "auto", max(q.shape[-1], v.shape[-1]), kv=self.mla_kv()))
                  if collective else MathKernel())
        plan = self.ring_plan(kernel, k.shape[-1] ** -0.5,
                              row_max=self._row_max(qh) if collective else None)  # a2a: its max-logit exchange too
        refuse(Refusal(error=exc, comm_type=self.comm_type, plan=plan, q=qh, k=self.bhsd(k), v=self.bhsd(v),
                       hierarchical_groups=self.hierarchical_groups))


def _agreed_codec(ring: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, layout: Any,
                  qkv_format: str, cu_seqlens: Any, window: Any, comm_type: str, head_chunks: Any, comm_dtype: Any,
                  softmax_scale: Any, check_consistency: bool, extras: tuple,
                  per_call: dict | None = None) -> tuple[KVCodec, int]:
    """The cross-rank check (every rank raises the same error unless all pass the same shapes, dtypes
    and options; ``per_call``: the int dropout seed and the call id, compared with a new signature only), then the
    wire codec and the call's tag (:func:`~megatron_ring.core.validation.call_tag`: the signature, the seed and the
    call id, carried in-band and compared on every call, so ranks whose sequences of calls diverge onto signatures
    each has seen raise too; 0 where nothing is compared). ``comm_dtype`` spellings are normalised ("fp8" ==
    torch.float8_e4m3fn); a bad value is raised after the cross-rank check, never before it."""
    try:
        codec, codec_error = _codec(comm_dtype, q.dtype), None
    except ValueError as exc:
        codec, codec_error = None, exc
    wire_name = codec.name if codec is not None else f"invalid {comm_dtype!r}"
    tag = 0
    if ring.world > 1 and ring.group is not None and check_consistency:
        if comm_type == "auto":  # what auto decides from besides the call: the same on every rank, or named
            from megatron_ring.strategies.auto import inputs_key  # noqa: PLC0415 - auto loads on first use

            comm_type = inputs_key(ring.group, q.device.type)
        sig = call_signature(q, k, v, causal=causal, layout=layout, qkv_format=qkv_format,
                             comm_dtype=wire_name, softmax_scale=softmax_scale, head_chunks=head_chunks,
                             cu_seqlens=cu_seqlens, window=window, comm_type=comm_type,
                             extras=extras)
        try:
            check_same_across_ranks(sig, ring.group, q.device, {"comm_type": comm_type,
                "q.dtype": q.dtype, "k.dtype": k.dtype, "v.dtype": v.dtype, "device type": q.device.type,
                "layout": getattr(layout, "name", layout), "qkv_format": qkv_format,
                "comm_dtype": wire_name, "cu_seqlens": cu_seqlens, "window": window,
                "dropout/softmax_offset/kv_pieces": extras}, timeout=ring.timeout, per_call=per_call)
        except (RuntimeError, TimeoutError) as exc:  # a rank of the group died or stalled (not a mismatch)
            raise ring.group_error("the cross-rank check of the call's arguments (an all_gather)", exc) from exc
        tag = call_tag(sig, per_call)
    if codec_error is not None:
        raise codec_error
    return codec, tag


_codecs: dict = {}  # (comm_dtype, compute dtype) -> codec; codecs hold no per-call state


def _codec(comm_dtype: Any, dtype: torch.dtype) -> KVCodec:
    """:func:`make_codec`, one codec object per signature (its wire layout is cached per object)."""
    try:
        codec = _codecs.get((comm_dtype, dtype))
    except TypeError:  # an unhashable spelling: make_codec names the accepted ones
        return make_codec(comm_dtype, dtype)
    if codec is None:
        codec = _codecs[comm_dtype, dtype] = make_codec(comm_dtype, dtype)
        codec.launch_rule = direct_launch_ok if has_triton() else None  # its fused kernels where Triton is
    return codec


def _pieces(requested: Any, q: torch.Tensor, k: torch.Tensor, s_dim: int) -> int:
    """``kv_pieces`` resolved (:func:`~megatron_ring.core.rotation.piece_count`); 1 for shapes ``check_inputs``
    refuses later anyway."""
    if q.ndim != 4 or k.ndim != 4:
        return 1
    b = q.shape[1 - s_dim]
    return piece_count(b, q.shape[2], k.shape[2], q.shape[s_dim], q.shape[3], q.device.type, requested)


def offset_kind(offset: Any) -> Any:
    """What every rank must agree on about ``softmax_offset`` (a tensor's values may differ: its shape)."""
    return ("tensor", tuple(offset.shape)) if isinstance(offset, torch.Tensor) else offset


def sink_logits(offset: Any, qh: torch.Tensor) -> torch.Tensor | None:
    """``softmax_offset`` as an fp32 ``[h]`` tensor (keeping the autograd link of a learnable one)."""
    if offset is None:
        return None
    h = qh.shape[1]
    if isinstance(offset, torch.Tensor):
        if offset.shape not in ((h,), (1, h, 1, 1)) or not offset.is_floating_point():
            raise ValueError(f"softmax_offset tensor must be floating point with shape [h] = [{h}] (one logit "
                             f"per query head of this rank), got {offset.dtype} {tuple(offset.shape)}")
        if offset.device != qh.device:
            raise ValueError(f"softmax_offset is on {offset.device} but q is on {qh.device}")
        return offset.reshape(h).float()
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"softmax_offset must be None, a finite float (0.0: off-by-one) or a tensor [h], "
                         f"got {offset!r}")
    return torch.full((h,), float(offset), dtype=torch.float32, device=qh.device)


def dropout_spec(p: Any, seed: Any, qh: torch.Tensor, seq_len: int) -> DropoutSpec | None:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {p!r}")
    if p == 0.0:
        return None
    if isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.is_floating_point() \
            and not seed.is_complex() and seed.dtype != torch.bool:
        return DropoutSpec(float(p), seed, heads=qh.shape[1], seq_len=seq_len)  # a device seed: not read here
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"dropout_p={p} needs dropout_seed (an int, or a one-element integer tensor, the same "
                         f"on every rank of the group; vary it per step and layer), got {seed!r}")
    return DropoutSpec(float(p), int(seed), heads=qh.shape[1], seq_len=seq_len)


def attention_mask(causal: bool, cu_seqlens: Any, window: Any, total: int) -> AttentionMask:
    """The validated, normalised mask: one document covering the stream and unbounded windows vanish."""
    cu = check_cu_seqlens(cu_seqlens, total) if cu_seqlens is not None else None
    win = check_window(window)
    if cu is not None and cu == (0, total):
        cu = None
    if win is not None and causal:
        win = (win[0], -1)  # causal already hides every key right of the query
    if win == (-1, -1):
        win = None
    return AttentionMask(causal, cu, win)
