"""Public entry point: :func:`ring_attention`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from megatron_ring import settings
from megatron_ring.kernels.head_dim import NATIVE_HEAD_DIM_KERNELS, HeadDimPadKernel
from megatron_ring.kernels.dropout import DropoutSpec
from megatron_ring.wire.codecs import KVCodec, make_codec
from megatron_ring.transport.groups import PerGroup
from megatron_ring.transport.ring import LoopbackRing, Ring, Transport
from megatron_ring.core.engine import RingAttentionFunction, RingPlan
from megatron_ring.core.heads import head_groups
from megatron_ring.kernels.block import BlockKernel, MathKernel, select_kernel
from megatron_ring.schedules.layouts import Layout, get_layout
from megatron_ring.schedules.masks import AttentionMask
from megatron_ring.strategies import Refusal, refuse, run_strategy
from megatron_ring.core.rotation import piece_count
from megatron_ring.core.validation import (call_signature, check_cu_seqlens, check_inputs, check_same_across_ranks, check_window)

__all__ = ["ring_attention", "resolve_group"]

_rings = PerGroup()  # group -> (device, timeout_s) -> Ring; held weakly (transport/groups.py)


def resolve_group(group: Any) -> Any:
    """``None`` means the default group; returns None when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call torch.distributed.init_process_group first")
        return None
    return dist.group.WORLD if group is None else group


def _ring_for(group: Any, device: torch.device, timeout_s: float | None) -> Transport:
    if group is None:
        return LoopbackRing(1, 0, device)
    return _rings.setdefault(group, (device, timeout_s), lambda: Ring(group, device, timeout_s))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                   causal: bool = False, layout: str | Layout = "zigzag",
                   softmax_scale: float | None = None, qkv_format: str = "bshd",
                   comm_dtype: torch.dtype | str | None = None, kernel: str | BlockKernel = "auto",
                   check_consistency: bool = True, timeout_s: float | None = None,
                   head_chunks: int = 1, ring: Transport | None = None, cu_seqlens: Any = None,
                   window: tuple[int, int] | None = None, comm_type: str = "p2p",
                   hierarchical_groups: Any = None, softmax_offset: Any = None,
                   dropout_p: float = 0.0, dropout_seed: int | torch.Tensor | None = None,
                   kv_pieces: int | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's queries, ``[b, s_local, h, d]`` ("bshd") or ``[s_local, b, h, d]`` ("sbhd").
        k, v: this rank's keys/values, ``[.., s_local, h_kv, d]`` with ``h % h_kv == 0`` (GQA/MQA;
            K/V are never repeated on the wire).
        group: the context-parallel process group (None: the default group; single-process when
            torch.distributed is not initialised).
        causal: apply the global causal mask of the full sequence.
        layout: how the global sequence was split: "zigzag", "striped" or "contiguous".
        softmax_scale: defaults to ``1/sqrt(d)``.
        qkv_format: "bshd", "sbhd", or "thd" (packed documents: ``q [t_local, h, d]``, k/v
            ``[t_local, h_kv, d]``, this rank's share of ONE packed stream of T tokens split by ``layout``
            like a sequence, e.g. ``shard_sequence(x, dim=0, layout=...)``).
        comm_dtype: wire dtype for K/V (None sends them as they are).
        kernel: local block kernel: "auto", "flash_cpu", "math", "sdpa_cuda", "flash_attn", "flash_cuda",
            "cudnn", "te_fused" (``auto``: the fastest one that supports the case).
        check_consistency: verify (once per new shape signature) that every rank passes the same
            shapes/dtypes/options, raising on every rank otherwise.
        timeout_s: seconds to wait for a ring peer before raising RingPeerError naming it (default:
            the ``MEGATRON_RING_TIMEOUT_S`` environment variable, else the timeout of ``group``; note
            that Megatron creates its CP groups with ``distributed_timeout_minutes``, not the default
            group's timeout).
        head_chunks: run the ring over this many groups of K/V heads one after another (capped at
            h_kv): per-rank extra memory (wire buffers, dK/dV accumulators, temporaries) shrinks by
            this factor, for proportionally more (smaller) ring steps. Same bytes, same compute.
        cu_seqlens: ("thd" only) int tensor ``[n_docs + 1]``: the GLOBAL document boundaries of the
            packed stream, the same on every rank (``0``, non-decreasing, ``<= T``). Attention never
            crosses a boundary (``causal`` is causal within each document); tokens at or past
            ``cu_seqlens[-1]`` are padding: they see nothing and are seen by nothing (output 0).
        window: ``(left, right)``: query at global position i sees keys j with
            ``i - left <= j <= i + right`` (``-1``: unbounded on that side), combined with ``causal``
            and documents. A query that sees no key gets output 0 and zero gradients.
        softmax_offset: attention sinks (megatron-core's ``softmax_type`` "off-by-one"/"learnable"): a
            float (the same extra logit for every head; ``0.0`` is off-by-one) or a tensor ``[h]`` of
            per-head logits (learnable: it receives a gradient). The extra logit is a virtual key with
            value 0 in the softmax denominator only, folded into the log-sum-exp merge. The gradient
            a rank gets for the tensor covers ITS OWN queries only: summing it over the CP group (as
            Megatron's data-parallel x CP gradient all-reduce does) gives the full gradient.
        dropout_p: attention dropout probability (on the softmax probabilities, kept ones scaled by
            ``1/(1-p)``). The keep/drop decision of (query, key, head, batch row) is a counter-based
            hash of ``(dropout_seed, batch row * h + head, GLOBAL query position, GLOBAL key position)``:
            the same in forward and backward (and any recompute with the same seed), and independent
            of the CP size and layout. Uses an fp32 matmul block kernel (slower than flash).
        dropout_seed: int, or a one-element integer tensor (a device seed, e.g. drawn on the GPU: never
            read on the host, so no sync and a CUDA graph replays with the tensor's current value),
            required when ``dropout_p > 0``; the same on every rank of the group (an int seed is
            compared across ranks with each new call signature; a tensor seed is not).
        v: may have a different head dim than q/k (multi-latent attention); the output has v's.
        kv_pieces: each ring step streams the visiting K/V block (and, in backward, its dK/dV
            accumulator) in this many pieces of K/V heads through ``kv_pieces + 1`` piece buffers, so a
            block in flight costs ``(n+1)/n`` blocks instead of two (lower peak memory; same bytes, same
            compute, more and smaller kernel calls). Rounded down to a divisor of the K/V heads. Default
            (None): ``MEGATRON_RING_KV_PIECES`` if set, else automatic: as many as keep each piece's
            work large (on CPU up to 8; see ``rotation.piece_count``).
        ring: advanced: a prepared :class:`~megatron_ring.transport.ring.Transport` (a ``Ring`` over a
            group, or ``LoopbackRing`` for compute-only timing); overrides ``group``.
        comm_type: the exchange: "p2p" (the ring), "all_gather", "a2a" (Ulysses), "a2a+p2p"
            (Ulysses inside ``hierarchical_groups[0]``, ring across ``hierarchical_groups[1]``) or
            "auto" (chosen by a cost model). Same inputs, outputs and exactness for every type; see
            docs/strategies.md.
        hierarchical_groups: ``(inner, outer)`` process groups for "a2a+p2p" (inner = consecutive ranks
            of ``group``, outer = the ranks with the same inner index; Megatron's
            ``hierarchical_context_parallel_sizes`` convention).

    Returns:
        The attention output with q's shape and dtype, contiguous in ``qkv_format``.
    """
    if torch.compiler.is_compiling():  # torch.compile: ONE graph break, the ring runs eagerly (docs/compile.md)
        return _eager_ring_attention(
            q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, qkv_format=qkv_format,
            comm_dtype=comm_dtype, kernel=kernel, check_consistency=check_consistency, timeout_s=timeout_s,
            head_chunks=head_chunks, ring=ring, cu_seqlens=cu_seqlens, window=window, comm_type=comm_type,
            hierarchical_groups=hierarchical_groups, softmax_offset=softmax_offset, dropout_p=dropout_p,
            dropout_seed=dropout_seed, kv_pieces=kv_pieces)
    _check_tensors(q, k, v)
    if ring is None:
        ring = _ring_for(resolve_group(group), q.device, timeout_s if timeout_s is not None else settings.timeout_s())
    if kv_pieces is None:
        kv_pieces = settings.kv_pieces()
    call = _Call(ring=ring, causal=bool(causal), layout=layout, qkv_format=qkv_format, cu_seqlens=cu_seqlens,
                 window=window, comm_type=comm_type, head_chunks=head_chunks,
                 hierarchical_groups=hierarchical_groups)
    codec = _agreed_codec(call, q, k, v, comm_dtype=comm_dtype, softmax_scale=softmax_scale,
                          check_consistency=check_consistency, extras=(
                              dropout_p, dropout_seed is not None, _offset_kind(softmax_offset),
                              kv_pieces),
                          per_call=(dropout_seed,) if isinstance(dropout_seed, int) and dropout_p else ())
    q, k, v = call.tensors = call.unpack(q, k, v)
    call.codec, call.pieces = codec, _pieces(kv_pieces, q, k, call.s_dim)
    call.refusing(check_inputs, q, k, v, call.qkv_format)
    lay, mask, scale = call.checked_schedule(q, softmax_scale)
    qh = call.bhsd(q)
    block_kernel = call.refusing(select_kernel, qh, kernel)
    plan = call.plan(lay, mask, scale, block_kernel, qh, v,
                     _dropout_spec(dropout_p, dropout_seed, qh, q.shape[call.s_dim] * ring.world))
    return call.repack(_dispatch(call, q, k, v, qh, plan, _sink(softmax_offset, qh)))


#: ``ring_attention`` as torch.compile sees it: never traced (its exchanges wait on the host, its status is
#: read on the host), called eagerly between the compiled graphs before and after it
_eager_ring_attention = torch.compiler.disable(
    ring_attention, reason="megatron_ring: the ring's exchanges and in-band status run eagerly (docs/compile.md)")


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


@dataclass
class _Call:
    """One call's options, as the steps of :func:`ring_attention` consume them: the schedule (layout
    and mask, built once), the tensor layout (``thd`` unpacked to ``bshd``; BHSD views), and the
    refusal of rank-local input errors (:meth:`refusing`)."""

    ring: Any
    causal: bool
    layout: Any
    qkv_format: str
    cu_seqlens: Any
    window: Any
    comm_type: str
    head_chunks: Any
    hierarchical_groups: Any
    codec: Any = None
    pieces: int = 1
    thd: bool = False
    s_dim: int = 1
    tensors: tuple = ()  # q, k, v in the call's format (thd unpacked)

    def unpack(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``thd`` (packed tokens) as one ``bshd`` sequence; the sequence dimension of the others."""
        if self.qkv_format == "thd":
            for name, t in (("q", q), ("k", k), ("v", v)):
                if t.ndim != 3:
                    raise ValueError(f"qkv_format='thd' expects {name} as [t, h, d] (packed tokens), got shape "
                                     f"{tuple(t.shape)}; for [s, b, h, d] use qkv_format='sbhd', for [b, s, h, d] "
                                     "qkv_format='bshd'")
            self.thd, self.qkv_format = True, "bshd"
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        elif self.cu_seqlens is not None:
            raise ValueError(f"cu_seqlens describes packed documents: use qkv_format='thd' ([t, h, d]), got "
                             f"qkv_format={self.qkv_format!r}")
        self.s_dim = 1 if self.qkv_format == "bshd" else 0
        return q, k, v

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

    def schedule(self, s_local: int) -> tuple[Layout, AttentionMask]:
        """The layout and the validated mask (ValueError names the fix)."""
        return get_layout(self.layout), _attention_mask(self.causal, self.cu_seqlens, self.window,
                                                        s_local * self.ring.world)

    def checked_schedule(self, q: torch.Tensor, softmax_scale: Any) -> tuple[Layout, AttentionMask, float]:
        """The layout (checked against the local length), the mask and the softmax scale."""
        s_local = q.shape[self.s_dim]
        lay = get_layout(self.layout)
        lay.check_local_len(s_local, self.ring.world)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
        return lay, self.schedule(s_local)[1], float(scale)

    def plan(self, lay: Layout, mask: AttentionMask, scale: float, kernel: BlockKernel, qh: torch.Tensor,
             v: torch.Tensor, dropout: DropoutSpec | None) -> RingPlan:
        """The engine's plan (``v``: in any format; only its head dim is read)."""
        if v.shape[-1] != qh.shape[-1] and kernel.name not in NATIVE_HEAD_DIM_KERNELS:
            kernel = HeadDimPadKernel(kernel)  # MLA: exact zero padding of the kernel's operands
        plan = RingPlan(ring=self.ring, layout=lay, causal=self.causal, scale=scale, kernel=kernel,
                        codec=self.codec, mask=None if mask.plain else mask, dropout=dropout, pieces=self.pieces)
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
            lay, mask = self.schedule(q.shape[self.s_dim])
        except ValueError:  # every rank raises that before any exchange
            raise exc from None
        qh = self.bhsd(q) if q.ndim == 4 else None
        kernel = select_kernel(qh, "auto") if collective else MathKernel()  # the ring alone computes nothing
        plan = RingPlan(ring=self.ring, layout=lay, causal=self.causal, scale=k.shape[-1] ** -0.5, kernel=kernel,
                        codec=self.codec, mask=None if mask.plain else mask, pieces=self.pieces)
        refuse(Refusal(error=exc, comm_type=self.comm_type, plan=plan, q=qh, k=self.bhsd(k), v=self.bhsd(v),
                       head_chunks=self.head_chunks, hierarchical_groups=self.hierarchical_groups))


def _agreed_codec(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm_dtype: Any,
                  softmax_scale: Any, check_consistency: bool, extras: tuple,
                  per_call: tuple = ()) -> KVCodec:
    """The cross-rank check (every rank raises the same error unless all pass the same shapes, dtypes
    and options; ``per_call``: the dropout seed, compared with a new signature only), then the wire codec. ``comm_dtype`` spellings are normalised ("fp8" ==
    torch.float8_e4m3fn); a bad value is raised after the cross-rank check, never before it."""
    try:
        codec, codec_error = _codec(comm_dtype, q.dtype), None
    except ValueError as exc:
        codec, codec_error = None, exc
    wire_name = codec.name if codec is not None else f"invalid {comm_dtype!r}"
    ring = call.ring
    if ring.world > 1 and ring.group is not None and check_consistency:
        sig = call_signature(q, k, v, causal=call.causal, layout=call.layout, qkv_format=call.qkv_format,
                             comm_dtype=wire_name, softmax_scale=softmax_scale, head_chunks=call.head_chunks,
                             cu_seqlens=call.cu_seqlens, window=call.window, comm_type=call.comm_type,
                             extras=extras)
        try:
            check_same_across_ranks(sig, ring.group, q.device, {"comm_type": call.comm_type,
                "q.dtype": q.dtype, "k.dtype": k.dtype, "v.dtype": v.dtype, "device type": q.device.type,
                "layout": getattr(call.layout, "name", call.layout), "qkv_format": call.qkv_format,
                "comm_dtype": wire_name, "cu_seqlens": call.cu_seqlens, "window": call.window,
                "dropout/softmax_offset/kv_pieces": extras}, timeout=ring.timeout, per_call=per_call)
        except (RuntimeError, TimeoutError) as exc:  # a rank of the group died or stalled (not a mismatch)
            raise ring.group_error("the cross-rank check of the call's arguments (an all_gather)", exc) from exc
    if codec_error is not None:
        raise codec_error
    return codec


_codecs: dict = {}  # (comm_dtype, compute dtype) -> codec; codecs hold no per-call state


def _codec(comm_dtype: Any, dtype: torch.dtype) -> KVCodec:
    """:func:`make_codec`, one codec object per signature (its wire layout is cached per object)."""
    try:
        codec = _codecs.get((comm_dtype, dtype))
    except TypeError:  # an unhashable spelling: make_codec names the accepted ones
        return make_codec(comm_dtype, dtype)
    if codec is None:
        codec = _codecs[comm_dtype, dtype] = make_codec(comm_dtype, dtype)
    return codec


def _dispatch(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qh: torch.Tensor,
              plan: RingPlan, sink: torch.Tensor | None) -> torch.Tensor:
    """The exchange: the ring itself, or another comm type (same plan and schedule; sinks, dropout too).
    ``q, k, v`` in the call's format, ``qh`` q's BHSD view; returns the output in the call's format (the
    ring takes the call's format itself: no autograd view nodes around it, and no BHSD views of k, v made
    here; heads are dim 2 in both bshd and sbhd)."""
    if call.comm_type == "p2p":
        return RingAttentionFunction.apply(q, k, v, plan, head_groups(k.shape[2], call.head_chunks), sink, call.perm)
    kh, vh = call.bhsd(k), call.bhsd(v)
    return call.from_bhsd(run_strategy(call.comm_type, qh, kh, vh, plan, head_chunks=call.head_chunks,
                                       hierarchical_groups=call.hierarchical_groups, sink=sink))


def _pieces(requested: Any, q: torch.Tensor, k: torch.Tensor, s_dim: int) -> int:
    """``kv_pieces`` resolved (:func:`~megatron_ring.core.rotation.piece_count`); 1 for shapes ``check_inputs``
    refuses later anyway."""
    if q.ndim != 4 or k.ndim != 4:
        return 1
    b = q.shape[1 - s_dim]
    return piece_count(b, q.shape[2], k.shape[2], q.shape[s_dim], q.shape[3], q.device.type, requested)


def _offset_kind(offset: Any) -> Any:
    """What every rank must agree on about ``softmax_offset`` (a tensor's values may differ: its shape)."""
    return ("tensor", tuple(offset.shape)) if isinstance(offset, torch.Tensor) else offset


def _sink(offset: Any, qh: torch.Tensor) -> torch.Tensor | None:
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


def _dropout_spec(p: Any, seed: Any, qh: torch.Tensor, seq_len: int) -> DropoutSpec | None:
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


def _attention_mask(causal: bool, cu_seqlens: Any, window: Any, total: int) -> AttentionMask:
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
