"""Public entry point: :func:`ring_attention`."""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring import settings
from megatron_ring.call import Call, agree, dropout_spec, offset_kind, sink_logits
from megatron_ring.transport.groups import ring_over
from megatron_ring.transport.ring import LoopbackRing, Transport
from megatron_ring.core.autocast import autocast_inputs, autocast_off
from megatron_ring.core.autograd import RingAttentionFunction
from megatron_ring.core.plan import RingPlan
from megatron_ring.kernels.block import BlockKernel, select_kernel
from megatron_ring.schedules.layouts import Layout
from megatron_ring.strategies import run_strategy
from megatron_ring.core.validation import check_inputs

__all__ = ["ring_attention", "resolve_group"]

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
    return ring_over(group, device, timeout_s)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                   causal: bool = False, layout: str | Layout = "zigzag",
                   softmax_scale: float | None = None, qkv_format: str = "bshd",
                   comm_dtype: torch.dtype | str | None = None, kernel: str | BlockKernel = "auto",
                   check_consistency: bool = True, timeout_s: float | None = None,
                   head_chunks: int = 1, ring: Transport | None = None, cu_seqlens: Any = None,
                   window: tuple[int, int] | None = None, comm_type: str = "p2p",
                   hierarchical_groups: Any = None, softmax_offset: Any = None,
                   dropout_p: float = 0.0, dropout_seed: int | torch.Tensor | None = None,
                   kv_pieces: int | None = None, deterministic: bool | None = None,
                   return_max_logit: bool = False, max_logit_rows: torch.Tensor | None = None,
                   call_id: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        kernel: local block kernel: "auto", "flash_cpu", "math", "flash_attn", "flash_cuda", "cudnn",
            "te_fused" (``auto``: the first that supports the case in a fixed order, cudnn, flash_attn,
            te_fused, flash_cuda, flash_cpu, math; fp32 on CUDA: "math"). A kernel named that cannot run the
            case (device, dtype, head dim, GPU architecture, deterministic mode, a backend turned off in torch's
            SDPA switches) is refused with a ValueError giving the reason; "sdpa_cuda" is refused until verified
            on a GPU.
        check_consistency: verify (once per new shape signature, one all-gather) that every rank passes the
            same shapes/dtypes/options, and compare every call in-band (the call's tag in the ring's status),
            raising on every rank otherwise.
        timeout_s: seconds to wait for a ring peer before raising RingPeerError naming it (default:
            the ``MEGATRON_RING_TIMEOUT_S`` environment variable, else the timeout of ``group``; note
            that Megatron creates its CP groups with ``distributed_timeout_minutes``, not the default
            group's timeout).
        head_chunks: deprecated alias of ``kv_pieces`` (a FutureWarning when not 1): ``head_chunks=n`` runs as
            ``kv_pieces=n``; ignored when ``kv_pieces`` is given.
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
            of the CP size and layout. On CUDA (fp16/bf16, Triton installed) fused Triton kernels; an fp32
            matmul block kernel on CPU and for fp32.
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
        deterministic: run CUDA backward kernels deterministically (kernels without a deterministic backward
            are not chosen by "auto" and refused by name). None: the process default, torch's deterministic
            mode (``torch.use_deterministic_algorithms``) unless :func:`~megatron_ring.set_deterministic` set
            one. A property of this call only.
        ring: advanced: a prepared :class:`~megatron_ring.transport.ring.Transport` (a ``Ring`` over a
            group, or ``LoopbackRing`` for compute-only timing); overrides ``group``.
        comm_type: the exchange: "p2p" (the ring), "all_gather", "a2a" (Ulysses), "a2a+p2p"
            (Ulysses inside ``hierarchical_groups[0]``, ring across ``hierarchical_groups[1]``) or
            "auto" (chosen by a cost model). Same inputs, outputs and exactness for every type; see
            docs/strategies.md.
        hierarchical_groups: ``(inner, outer)`` process groups for "a2a+p2p" (inner = consecutive ranks
            of ``group``, outer = the ranks with the same inner index; Megatron's
            ``hierarchical_context_parallel_sizes`` convention).
        return_max_logit: also return the largest attention logit per query head (QK-clip, Megatron's
            ``--qk-clip`` / ``--log-max-attention-logit``): ``max_logit`` fp32 ``[h]`` (h: the heads of this
            rank's q), detached: the max of ``softmax_scale * q . k`` over every (query, key) pair this rank's
            queries see (causal, documents, window; over every ring step and the batch; the K a kernel sees,
            i.e. after the wire's decoding; a sink is not a logit). ``-inf`` for a head none of whose queries
            sees a key (all padding): a MAX-reduce over ranks ignores it. Every comm type gives this rank's
            own queries' max (docs/model_features.md, "QK-clip"). An extra pass over each computed block
            (the kernels return no max; fp32 accumulation, scores rounded once to bf16 for bf16 inputs, else
            fp32); nothing is computed when False.
        max_logit_rows: with ``return_max_logit``, a bool tensor on q's device, one entry per local query row (the
            sequence dim of q in ``qkv_format``: ``s_local``, or ``t_local`` for "thd"): only the rows marked True
            count in ``max_logit`` (e.g. the real tokens of Megatron's padded packed documents, not their filler).
            No host read. None: every row.
        call_id: an int naming the call site, the same on every rank for the same call (e.g. the layer number:
            the Megatron layers pass theirs). Compared across ranks like an int ``dropout_seed`` (with each new
            signature) and in-band in every call (the call's tag), so ranks that make calls of one signature from
            different sites at once raise ``RingInputError`` on every rank instead of mixing the two calls' K/V:
            e.g. two alike layers recomputed in different orders under reentrant activation checkpointing
            (``torch.utils.checkpoint(..., use_reentrant=True)``, Megatron's recompute), or layers skipped on
            some ranks only. None: not compared (calls of one signature are told apart by their order only).

    Returns:
        The attention output with q's shape and dtype, contiguous in ``qkv_format``; with
        ``return_max_logit``, the pair ``(output, max_logit)``. Under ``torch.autocast`` for q's device, as
        torch's SDPA there: q, k, v are cast to the autocast dtype (floating, not float64), the output has it, and
        the call runs with autocast off, forward and backward (core/autocast.py).
    """
    if torch.compiler.is_compiling():  # torch.compile: ONE graph break, the ring runs eagerly (docs/compile.md)
        return _eager_ring_attention(
            q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale, qkv_format=qkv_format,
            comm_dtype=comm_dtype, kernel=kernel, check_consistency=check_consistency, timeout_s=timeout_s,
            head_chunks=head_chunks, ring=ring, cu_seqlens=cu_seqlens, window=window, comm_type=comm_type,
            hierarchical_groups=hierarchical_groups, softmax_offset=softmax_offset, dropout_p=dropout_p,
            dropout_seed=dropout_seed, kv_pieces=kv_pieces, deterministic=deterministic,
            return_max_logit=return_max_logit, max_logit_rows=max_logit_rows, call_id=call_id)
    _check_tensors(q, k, v)
    cast = autocast_inputs(q.device.type, q, k, v)
    if cast is not None:  # as torch's SDPA under autocast: inputs in its dtype, the call without it (core/autocast.py)
        q, k, v = cast
    with autocast_off(q.device.type):
        if head_chunks != 1:
            warnings.warn("ring_attention(head_chunks=n) is deprecated: it runs as kv_pieces=n (K/V heads streamed "
                          "in n pieces within each ring step; the same exact result) and is ignored when kv_pieces is "
                          "given; pass kv_pieces=n", FutureWarning, stacklevel=2)
        if not isinstance(return_max_logit, bool):
            raise ValueError(f"return_max_logit must be a bool, got {return_max_logit!r}")
        if call_id is not None and (isinstance(call_id, bool) or not isinstance(call_id, int)):
            raise ValueError(f"call_id must be an int naming the call site (e.g. the layer number) or None, got "
                             f"{call_id!r}")
        per_call = {"dropout_seed": dropout_seed} if isinstance(dropout_seed, int) and dropout_p else {}
        if call_id is not None:
            per_call["call_id"] = call_id
        if ring is None:
            timeout = timeout_s if timeout_s is not None else settings.timeout_s()
            ring = _ring_for(resolve_group(group), q.device, timeout)
        if kv_pieces is None:
            kv_pieces = _pieces_alias(head_chunks) or settings.kv_pieces()
        call = agree(ring, q, k, v, causal=causal, layout=layout, qkv_format=qkv_format, cu_seqlens=cu_seqlens,
                     window=window, comm_type=comm_type, head_chunks=head_chunks,
                     hierarchical_groups=hierarchical_groups, comm_dtype=comm_dtype, softmax_scale=softmax_scale,
                     check_consistency=check_consistency, kv_pieces=kv_pieces, max_logit=return_max_logit,
                     extras=(dropout_p, dropout_seed is not None, offset_kind(softmax_offset), kv_pieces,
                             return_max_logit),
                     per_call=per_call)
        q, k, v = call.tensors
        call.refusing(check_inputs, q, k, v, call.qkv_format)
        if return_max_logit and max_logit_rows is not None:  # refused on every rank (a per-rank value)
            call.refusing(_check_rows, max_logit_rows, q.shape[call.s_dim], q.device)
        scale = call.checked_scale(softmax_scale)
        qh = call.bhsd(q)
        # head dim: with MLA head dims the kernel's operands are padded to the larger one (kernels.head_dim), unless
        # it takes them as they are (cuDNN, where torch's own SDPA hands it those head dims)
        block_kernel = call.refusing(select_kernel, qh, kernel, max(qh.shape[-1], v.shape[-1]), deterministic,
                                     call.mla_kv())
        # values the cross-rank check does not compare (a device seed's dtype, an offset tensor's dtype): refused on
        # every rank (this rank takes part in the forward's exchanges first, the others raise naming it)
        dropout = call.refusing(dropout_spec, dropout_p, dropout_seed, qh, q.shape[call.s_dim] * ring.world)
        sink = call.refusing(sink_logits, softmax_offset, qh)
        plan = call.plan(scale, block_kernel, qh, dropout)
        out = call.repack(_dispatch(call, q, k, v, qh, plan, sink))
        if not return_max_logit:
            return out
        return out, _max_logit(plan.row_max, max_logit_rows)


#: ``ring_attention`` as torch.compile sees it: never traced (its exchanges wait on the host, its status is
#: read on the host), called eagerly between the compiled graphs before and after it
_eager_ring_attention = torch.compiler.disable(
    ring_attention, reason="megatron_ring: the ring's exchanges and in-band status run eagerly (docs/compile.md)")


def _check_rows(rows: Any, s_local: int, device: torch.device) -> None:
    if not (isinstance(rows, torch.Tensor) and rows.dtype == torch.bool and tuple(rows.shape) == (s_local,)
            and rows.device == device):
        got = f"{rows.dtype} {tuple(rows.shape)} on {rows.device}" if isinstance(rows, torch.Tensor) else \
            type(rows).__name__
        raise ValueError(f"max_logit_rows must be a bool tensor of the {s_local} local query rows on {device}, "
                         f"got {got}")


def _max_logit(row_max: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The max logit per head (``row_max``: fp32 ``[h, s_local]``) over the rows ``rows`` marks (None: all)."""
    if rows is None:
        return row_max.amax(dim=1)
    return row_max.masked_fill(~rows, float("-inf")).amax(dim=1)


def _pieces_alias(head_chunks: Any) -> int | None:
    """The K/V pieces the deprecated ``head_chunks`` asks for (None: 1, or not a count: refused by name later,
    after the cross-rank check)."""
    ok = isinstance(head_chunks, int) and not isinstance(head_chunks, bool) and head_chunks > 1
    return head_chunks if ok else None


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _dispatch(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qh: torch.Tensor,
              plan: RingPlan, sink: torch.Tensor | None) -> torch.Tensor:
    """The exchange: the ring itself, or another comm type (same plan and schedule; sinks, dropout too).
    ``q, k, v`` in the call's format, ``qh`` q's BHSD view; returns the output in the call's format (the
    ring takes the call's format itself: no autograd view nodes around it, and no BHSD views of k, v made
    here; heads are dim 2 in both bshd and sbhd)."""
    if call.comm_type == "p2p":
        return RingAttentionFunction.apply(q, k, v, plan, sink, call.perm)
    kh, vh = call.bhsd(k), call.bhsd(v)
    return call.from_bhsd(run_strategy(call.comm_type, qh, kh, vh, plan,
                                       hierarchical_groups=call.hierarchical_groups, sink=sink))


