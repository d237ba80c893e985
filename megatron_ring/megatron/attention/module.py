"""Ring attention as Megatron-Core's core attention (drop-in for the local ``DotProductAttention``)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_ring

from megatron_ring.megatron import compat
from megatron_ring.megatron.attention import comm_types, qk_clip, rope_guard
from megatron_ring.megatron.groups import resolve as groups
from megatron_ring.megatron.config import ContextParallelConfigError, RingConfig, refuse_mtp_without_zigzag
from megatron_ring.megatron.data.documents import documents_from_mask, packed_cu_seqlens, real_rows
from megatron_ring.megatron.attention.dropout import dropout_seed, row_seed
from megatron_ring.megatron.env import kv_pieces_from_env, ring_config_from_env
from megatron_ring.megatron.attention.sinks import make_softmax_offset, ring_softmax_offset, sharded_sinks
from megatron_ring.megatron.groups.provider import get_ring_state, is_context_parallel_initialized
from megatron_ring.megatron.data import token_order
from megatron_ring.megatron.data.packed_rope import apply_packed_rope

__all__ = ["RingDotProductAttention"]


_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}
# with packed (THD) batches: documents and their padding are the packed_seq_params' (what these types ask for)
_PACKED = {AttnMaskType.padding_causal: True, AttnMaskType.padding: False}
_KEPT = 8  # resolved settings a layer keeps (one per group it runs on: hybrid CP's sizes, eval rebinding)


class _LayerSettings(NamedTuple):
    """What a layer resolves once per group (:meth:`RingDotProductAttention._settings`)."""

    group: Any
    cfg: RingConfig
    registered: Any  # the registered RingState when ``group`` is its group
    strategy: dict  # comm_type / hierarchical_groups for ring_attention
    kv_pieces: Optional[int]  # MEGATRON_RING_KV_PIECES (None: the library chooses)
    max_logit: bool  # QK-clip asks for the max logit


def _call_group(layer: Any, packed_seq_params: Any) -> tuple[Any, bool, Any]:
    """(registered state or None, whether the group is the call's own, the group) -- looked up per call."""
    state = get_ring_state() if is_context_parallel_initialized() else None
    per_call, group = groups.per_call_group(packed_seq_params)
    if not per_call:
        group = groups.model_group(layer.pg_collection, state)
    return state, per_call, group


def _resolve_ring(layer: Any, state: Any, per_call: bool, group: Any) -> tuple[Any, RingConfig, Any]:
    """The ring config and the registered state for ``group`` (see :meth:`RingDotProductAttention._ring`)."""
    cfg = state.config if state is not None else ring_config_from_env(layer.config.context_parallel_size)
    if not per_call:
        size = group.size() if group is not None else 1
        cp_size = layer.config.context_parallel_size
        if size != cp_size:
            raise ContextParallelConfigError(
                "--context-parallel-size", f"the model config has context_parallel_size={cp_size} but its CP "
                                           f"group has {size} ranks; give the model the group it was configured "
                                           "for (pg_collection.cp, or initialize_context_parallel)")
    registered = state if state is not None and groups.same_ranks(group, state) else None
    if registered is not None:
        group = state.group  # the registered object: its sub-rings and caches
    return group, cfg, registered


def _per_rank(total: int, tp: int, what: str) -> int:
    """``total`` split over ``tp`` tensor-parallel ranks (as Megatron's core attention splits it)."""
    if total % tp:
        raise ContextParallelConfigError("--tensor-model-parallel-size", f"{what} = {total} is not divisible by "
                                         f"the tensor-parallel size {tp}")
    return total // tp


class RingDotProductAttention(MegatronModule):
    """Exact attention over the context-parallel group, with Megatron's core-attention interface.

    Same constructor and forward as ``megatron.core.transformer.dot_product_attention.DotProductAttention``:
    query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (GQA: ``np % ng == 0``, K/V never repeated),
    output ``[sq, b, np * hn]``. ``sq`` is this rank's share of the sequence, split with the configured
    layout (see :func:`~megatron_ring.megatron.data.batch.get_batch_on_this_cp_rank`).

    The CP group is looked up at each call, never in ``__init__`` (no collective at model build):
    ``packed_seq_params.cp_group`` / ``local_cp_size`` (a per-call group: Megatron's hybrid / dynamic CP),
    else the model's ``pg_collection.cp`` (followed when Megatron replaces it, e.g. eval-time CP
    rebinding), else the group registered by
    :func:`~megatron_ring.megatron.groups.provider.initialize_context_parallel`, else ``parallel_state``'s. The
    options (layout, wire dtype, comm type, timeout) come from the registered ring, else from the
    ``MEGATRON_RING_*`` environment variables (:mod:`megatron_ring.megatron.env`), read once per layer and group
    at the layer's first call on that group and kept (see :meth:`_settings`). ``batch_split="megatron"`` (set by
    :mod:`megatron_ring.megatron.spec`): the batch was split by stock Megatron, so packed THD batches at CP > 1 run
    in the order it split them in: Megatron's per-document zigzag (:class:`~megatron_ring.DocumentZigzag` of
    ``cu_seqlens_q_padded``; ``--sft``, Megatron-Core), or, where Megatron-LM's ``get_batch`` cut the stream as one
    sequence (``--dataloader-inter-document-masking``), the stream's zigzag with the documents as a mask (see
    :mod:`megatron_ring.megatron.data.token_order`).
    Supported masks: ``causal`` and ``no_mask``; documents from ``packed_seq_params`` (THD, global
    ``cu_seqlens``) or, with ``causal``, from an ``attention_mask`` that is causal within documents
    (``--reset-attention-mask``; see :mod:`megatron_ring.megatron.data.documents`); ``config.window_size`` (sliding window).
    Multi-latent attention (``k_channels != v_channels``, passed by Megatron's ``MLASelfAttention``),
    ``config.softmax_type`` "off-by-one" / "learnable" (attention sinks; the learnable ``softmax_offset``
    parameter is named and initialised like Megatron's), and ``attention_dropout > 0`` in training mode
    (positional dropout: the same mask at every CP size and layout; see :mod:`.dropout`).
    QK-clip (``config.qk_clip`` / ``config.log_max_attention_logit``): ``current_max_attn_logits``, the max logit
    per head of this rank's queries accumulated over micro-batches, as Megatron's QK-clip reads it (:mod:`.qk_clip`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        batch_split: str = "ring",
        **newer_kwargs: Any,
    ):
        super().__init__(config=config)
        _refuse_meaningful("constructor", newer_kwargs)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        p_drop = config.attention_dropout if attention_dropout is None else attention_dropout
        if not 0.0 <= float(p_drop) < 1.0:
            raise ContextParallelConfigError("--attention-dropout", f"must be in [0, 1), got {p_drop}")
        # applied in training mode only (its seed: megatron_ring.megatron.attention.dropout.dropout_seed)
        self.attention_dropout_p = float(p_drop)
        if attention_type != "self":
            raise NotImplementedError(f"RingDotProductAttention supports self-attention only, got "
                                      f"attention_type={attention_type!r}")
        self._cp_comm_type_arg = cp_comm_type  # resolved per layer by comm_types.layer_comm_type
        self.window = _window(config, layer_number)
        self.packed_rope: Optional[tuple] = None  # (RotaryEmbedding,): THD RoPE applied here (rope.py)
        rope_guard.watch(self)  # a RoPE model whose positions do not follow the layout is refused (rope_guard.py)
        self._documents = documents_from_mask  # one for all layers: the first layer of a micro-batch reads the mask
        self._mask_causal(attn_mask_type)  # fail early on unsupported masks
        # --deterministic-mode: deterministic CUDA backward kernels for this layer's calls (passed per call;
        # off: the process default, torch's deterministic mode, which Megatron-LM's flag also turns on)
        self.deterministic = True if getattr(config, "deterministic_mode", False) else None
        if batch_split not in ("ring", "megatron"):
            raise ValueError(f"batch_split must be 'ring' or 'megatron', got {batch_split!r}")
        # "megatron": the batch is split by stock Megatron (zigzag sequences; packed THD per document)
        self.batch_split = batch_split
        # No collective and no group lookup here (a pipeline stage may hold no layers): the CP group is
        # taken at each call (see _ring). Only options that need no group are checked now.
        cfg = get_ring_state().config if is_context_parallel_initialized() else \
            ring_config_from_env(config.context_parallel_size)
        refuse_mtp_without_zigzag(getattr(config, "mtp_num_layers", None), cfg.layout, config.context_parallel_size)
        comm_types.layer_comm_type(config, self.layer_number, cp_comm_type, cfg)  # fail at build on a bad name

        pg_cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        known = pg_cp.size() if pg_cp is not None else (
            get_ring_state().size if is_context_parallel_initialized() else None)
        if known is not None and known != config.context_parallel_size:  # group sizes are local: no collective
            raise ContextParallelConfigError(
                "--context-parallel-size", f"the model config has context_parallel_size="
                                           f"{config.context_parallel_size} but its CP group "
                                           f"({'pg_collection.cp' if pg_cp is not None else 'the registered ring'}) "
                                           f"has {known} ranks; pass the same --context-parallel-size to both")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection  # Megatron may replace it on live modules (eval CP rebinding)
        tp = pg_collection.tp.size()
        # MLA passes k_channels (Q/K head dim) and v_channels (V head dim, which sets the output size)
        k_ch = config.kv_channels if k_channels is None else k_channels
        v_ch = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_partition = _per_rank(v_ch * config.num_attention_heads, tp, "kv_channels x num_attention_heads")
        self.hidden_size_per_attention_head = k_ch
        self.v_head_dim = v_ch  # V's own head dim (MLA: Megatron may hand V zero-padded past it, see forward)
        self.num_attention_heads_per_partition = _per_rank(config.num_attention_heads, tp, "num_attention_heads")
        self.softmax_offset = make_softmax_offset(config, self.num_attention_heads_per_partition)
        self.num_query_groups_per_partition = _per_rank(config.num_query_groups, tp, "num_query_groups")
        # Megatron's query-key layer scaling divides the scale by layer_number and multiplies it back
        # inside the softmax: mathematically the plain scale, which is what the ring uses.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        # QK-clip (--qk-clip / --log-max-attention-logit): max logit per head of this TP rank, accumulated over
        # micro-batches; Megatron all-reduces it over DP x CP and resets it to None (see .qk_clip)
        self.current_max_attn_logits: Optional[Tensor] = None
        qk_clip.requested(config)  # refused at build on a megatron-core without QK-clip
        self._resolved: list[tuple[tuple, _LayerSettings]] = []  # see _settings

    def _comm_type(self, group: Any, registered: Any, cfg: RingConfig) -> dict[str, Any]:
        """``comm_type`` / ``hierarchical_groups`` of this layer on ``group`` (see :mod:`.comm_types`).

        ``registered``: the registered :class:`~megatron_ring.megatron.groups.provider.RingState` when ``group``
        is its group (its hierarchical sub-rings apply), else None (a group Megatron or the caller brought: no
        sub-rings)."""
        ct = comm_types.layer_comm_type(self.config, self.layer_number, self._cp_comm_type_arg, cfg)
        size = group.size() if group is not None else 1
        if ct == "a2a+p2p" and registered is None and size > 1:
            raise ContextParallelConfigError(
                "--cp-comm-type", f"layer {self.layer_number}: a2a+p2p needs the hierarchical sub-rings of the "
                                  "registered CP group, but this call runs on another group (pg_collection.cp or "
                                  "packed_seq_params.cp_group); use p2p, all_gather, a2a or auto there")
        heads = _per_rank(self.config.num_attention_heads, self.config.tensor_model_parallel_size, "num_attention_heads")
        if ct == "a2a" and size > 1 and heads < size:
            raise ContextParallelConfigError(
                "--cp-comm-type", f"layer {self.layer_number}: a2a splits the {heads} attention heads of a rank "
                                  f"over the {size} ranks of this call's CP group, but every rank needs at least "
                                  "one head; use p2p, all_gather or auto")
        if registered is not None:
            comm_types.check_heads(ct, heads, registered.config)
        return comm_types.strategy_kwargs(ct, registered)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Distributed checkpointing as Megatron's ``DotProductAttention``: the learnable ``softmax_offset``
        sharded over TP (see :func:`~megatron_ring.megatron.attention.sinks.sharded_sinks`)."""
        return sharded_sinks(self, prefix, sharded_offsets, metadata, self.pg_collection.tp)

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _mask_causal(mask_type: AttnMaskType, packed: bool | None = None) -> bool:
        """Whether ``mask_type`` is causal. ``packed``: the call has packed_seq_params (None: at build, not known
        yet): padding_causal / padding are causal / not within the packed documents, which carry the padding."""
        if mask_type in _CAUSAL:
            return _CAUSAL[mask_type]
        if mask_type in _PACKED and packed is not False:
            return _PACKED[mask_type]
        if mask_type in _PACKED:
            raise NotImplementedError(
                f"ring attention takes attn_mask_type {mask_type} with packed (THD) batches only (packed_seq_params: "
                "the documents and their padding); for a BSHD batch use causal or no_mask (padding tokens then take "
                "part in attention: mask their loss), or pack the batch (documents.packed_batch)")
        raise NotImplementedError(f"ring attention supports attn_mask_type causal or no_mask (padding_causal and "
                                  f"padding with packed THD batches), got {mask_type}")

    def _ring(self, packed_seq_params: Optional[PackedSeqParams] = None) -> tuple[Any, RingConfig, Any]:
        """(CP process group, ring config, registered state if the group is its group) for this call.

        The group, first found: ``packed_seq_params.cp_group`` / ``local_cp_size`` (per call: Megatron's
        hybrid/dynamic CP); the model's ``pg_collection.cp`` (read now: Megatron's eval-time CP rebinding
        replaces ``pg_collection`` on live modules); the registered ring's group; ``parallel_state``'s CP
        group. The options come from the registered ring, else from ``MEGATRON_RING_*`` (:mod:`megatron_ring.megatron.env`).
        """
        return _resolve_ring(self, *_call_group(self, packed_seq_params))

    def _settings(self, packed_seq_params: Optional[PackedSeqParams]) -> "_LayerSettings":
        """This call's group and options, resolved once per layer and :func:`_call_group` key.

        The group is looked up at every call (cheap: attribute reads); what follows from it -- the ring
        config (``MEGATRON_RING_*`` when no ring is registered), the size check, the comm type and its
        checks, ``MEGATRON_RING_KV_PIECES``, QK-clip -- is resolved at the first call on a (group, registered
        ring, CP size) and kept: a new group (per-call ``packed_seq_params.cp_group``, Megatron's eval-time
        rebinding of ``pg_collection``), a newly registered ring or a changed ``context_parallel_size``
        resolves again; an environment variable changed later is not read by this layer for a key it has seen.
        A failed resolution is not kept (the next call raises again)."""
        state, per_call, group = _call_group(self, packed_seq_params)
        key = (group, state, per_call, self.config.context_parallel_size)
        for seen, resolved in self._resolved:
            if all(a is b for a, b in zip(seen[:3], key[:3])) and seen[3] == key[3]:
                return resolved
        group, cfg, registered = _resolve_ring(self, state, per_call, group)
        resolved = _LayerSettings(group, cfg, registered, self._comm_type(group, registered, cfg),
                                  kv_pieces_from_env(), qk_clip.requested(self.config))
        self._resolved = (self._resolved + [(key, resolved)])[-_KEPT:]  # a few groups (hybrid CP sizes), bounded
        return resolved

    def check_rope(self, packed_seq_params: Optional[PackedSeqParams], group: Any = None, cfg: Any = None) -> None:
        """Refuse a model whose RoPE is not at the positions of the tokens this call's rank holds (the batch was
        split with the ring's layout: ``batch_split="ring"``; see :mod:`.rope_guard`). Run by each call, and by the
        parent attention's first call before Megatron applies RoPE (``group`` / ``cfg``: this call's settings)."""
        packed = packed_seq_params is not None
        mla = packed and getattr(self.config, "multi_latent_attention", False)
        if self.batch_split != "ring" or not (self.rope_applied or mla):
            return
        if cfg is None:
            group, cfg = self._settings(packed_seq_params)[:2]
        if group is None or group.size() == 1:
            return
        if mla:  # MLA applies its own RoPE, in Megatron's split of the packed batch
            token_order.refuse_mla_packed_ring_split(group.size())
        rope_guard.check(self, group.size(), cfg.layout, packed)

    def _megatron_padded_v(self, query: Tensor, value: Tensor) -> bool:
        """Whether ``value`` is MLA's V padded past its head dim by Megatron for a THD batch (megatron-core 0.19's
        ``MLASelfAttention`` pads V to Q's head dim, then keeps only the first ``v_head_dim`` columns of each head's
        output and drops the gradient of the padding): then the ring takes V at its own head dim, exactly what the
        caller keeps, whatever the padding holds. cuDNN takes MLA head dims as they are where torch's SDPA hands
        them to it, and the wire carries V unpadded (K + V at 192 / 128: 17% fewer bytes than at 192 / 192)."""
        return (getattr(self.config, "multi_latent_attention", False) and value.shape[-1] == query.shape[-1]
                and self.v_head_dim < value.shape[-1])

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **newer_kwargs: Any,
    ) -> Tensor:
        """``[sq, b, np, hn]`` x ``[sk, b, ng, hn]`` x2 -> ``[sq, b, np * hn]``.

        Keywords newer Megatron passes to core attention (``core_attention_extra_kwargs``, e.g. the inputs of
        a sparse-attention variant) are accepted when None and refused by name otherwise."""
        _refuse_meaningful("forward", newer_kwargs)
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by RingDotProductAttention")
        causal = self._mask_causal(attn_mask_type if attn_mask_type is not None else self.attn_mask_type,
                                   packed_seq_params is not None)
        group, cfg, registered, strategy, pieces, max_logit = self._settings(packed_seq_params)
        layout = cfg.layout
        if packed_seq_params is not None and self.batch_split == "megatron" and group is not None \
                and group.size() > 1:  # run in the order stock Megatron split the packed batch in
            split = compat.megatron_lm_packed_split()
            if split == "sequence":
                token_order.check_sequence_split(group.size())  # RoPE (GPT models; hybrids at build time)
            layout = token_order.megatron_thd_layout(group.size(), cfg.layout, packed_seq_params, split)
        else:
            self.check_rope(packed_seq_params, group, cfg)

        def run(q, k, v, fmt, cu=None, rows=None):
            got = megatron_ring.ring_attention(
                q, k, v, group=group, causal=causal, layout=layout, softmax_scale=self.softmax_scale,
                qkv_format=fmt, comm_dtype=cfg.torch_comm_dtype, timeout_s=cfg.timeout_s, cu_seqlens=cu,
                window=self.window, softmax_offset=offset, dropout_p=p_drop, dropout_seed=seed, kv_pieces=pieces,
                deterministic=self.deterministic, return_max_logit=max_logit, max_logit_rows=rows,
                call_id=self.layer_number, **strategy)
            if not max_logit:
                return got
            self.current_max_attn_logits = qk_clip.accumulate(self.current_max_attn_logits, got[1])
            return got[0]

        offset = ring_softmax_offset(self.config, self.softmax_offset)
        p_drop = self.attention_dropout_p if self.training else 0.0
        seed = dropout_seed_base = dropout_seed(self.layer_number, query.device) if p_drop else None
        if packed_seq_params is not None:  # THD: query [t, np, hn] (Megatron squeezed the batch dim)
            if query.dim() == 4:
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            if self.packed_rope is not None:  # set by use_layout_rope: RoPE at the layout's positions
                query, key = apply_packed_rope(self.packed_rope[0], self.config, query, key, packed_seq_params,
                                               layout, group)
            rows = None
            if max_logit:  # QK-clip's max over the real tokens: not over the filler of padded documents
                world, rank = (group.size(), group.rank()) if group is not None else (1, 0)
                rows = real_rows(packed_seq_params, layout, world, rank, query.shape[0], query.device)
            came, sliced = value.shape[-1], self._megatron_padded_v(query, value)
            if sliced:
                value = value[..., : self.v_head_dim]  # a view: the ring runs (and sends) V at its own head dim
            out = run(query, key, value, "thd", packed_cu_seqlens(packed_seq_params), rows)
            if sliced:  # as wide as V came: the caller keeps the first v_head_dim columns
                out = F.pad(out, (0, came - self.v_head_dim))
            return out.view(out.size(0), -1)
        if query.shape[0] != key.shape[0]:  # a decode step of inference with a KV cache
            return _decode(self, query, key, value, causal, group, offset)
        docs = None
        if attention_mask is not None and causal:  # --reset-attention-mask: documents per batch row
            docs = self._documents(attention_mask, group if group is not None and group.size() > 1 else None,
                                   cfg.layout)
        if docs is None:
            out = run(query, key, value, "sbhd")
        else:
            rows = []
            for i, cu in enumerate(docs):  # one packed stream per batch row: its own dropout seed
                seed = None if p_drop == 0.0 else row_seed(dropout_seed_base, i)
                rows.append(run(query[:, i], key[:, i], value[:, i], "thd", torch.tensor(cu)))
            out = torch.stack(rows, 1)
        return out.view(out.size(0), out.size(1), -1)


def _decode(layer: "RingDotProductAttention", query: Tensor, key: Tensor, value: Tensor, causal: bool, group: Any,
            offset: Any) -> Tensor:
    """Core attention with fewer queries than keys: a decode step of Megatron's inference with a KV cache (it
    turns the mask off past the prompt: ``no_mask``), at CP = 1, as Megatron's ``DotProductAttention`` computes it:
    every query sees every key (torch's SDPA, GQA K/V as they are); one causal query is the last position, which
    sees every key too. Refused by name at CP > 1, causal with several queries (Megatron's own attention refuses it
    too), with a window or attention sinks."""
    if group is not None and group.size() > 1:
        raise NotImplementedError(f"query length {query.shape[0]} != key length {key.shape[0]} (inference with a "
                                  "KV cache) at context parallel size > 1: run generation at CP = 1")
    if causal and query.shape[0] > 1:
        raise NotImplementedError(f"causal attention with query length {query.shape[0]} != key length "
                                  f"{key.shape[0]}: Megatron turns the mask off for decode steps (attn_mask_type "
                                  "no_mask); its own attention refuses this too")
    if layer.window is not None or offset is not None:
        raise NotImplementedError("a decode step (query length != key length) with a sliding window or attention "
                                  "sinks: not supported by RingDotProductAttention; build the model for "
                                  "generation with Megatron's own core attention")
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=layer.softmax_scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _refuse_meaningful(where: str, kwargs: dict[str, Any]) -> None:
    """Keywords this module does not know: None (the caller's "not used") is accepted; a value is refused by
    name, since ignoring it could change what the model computes."""
    used = sorted(k for k, v in kwargs.items() if v is not None)
    if used:
        raise NotImplementedError(f"RingDotProductAttention {where}: got {', '.join(used)}, which ring attention "
                                  "does not implement (a core attention variant of newer Megatron); use that "
                                  "variant's own core attention for these layers")


def _window(config: TransformerConfig, layer_number: int) -> Optional[tuple[int, int]]:
    """Megatron's ``window_size`` for this layer (``window_attn_skip_freq`` layers use full attention)."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ContextParallelConfigError("--window-size", f"needs two values, left and right (e.g. --window-size "
                                                          f"4096 0; -1: unbounded), got {window!r}")
    skip = getattr(config, "window_attn_skip_freq", None)
    if skip is not None:
        from megatron.core.transformer.utils import is_layer_window_attention

        if not is_layer_window_attention(window, skip, layer_number):
            return None
    return (int(window[0]), int(window[1]))
