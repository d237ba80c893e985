"""Rotary embeddings whose positions follow the ring layout.

Megatron-Core slices RoPE frequencies per CP rank with its own zigzag split. With ``--cp-layout striped``
or ``contiguous`` the tokens a rank holds are different ones, so the frequencies must be taken at the
layout's positions instead. :func:`use_layout_rope` switches a model's ``RotaryEmbedding`` to
:class:`LayoutRotaryEmbedding` in place (no parameters change; zigzag gives Megatron's exact result).

Packed batches (``PackedSeqParams``, ``qkv_format="thd"``): Megatron's THD RoPE cuts every document into
2·CP pieces of its own (TransformerEngine's per-document split), which is not how the ring's layouts
split the packed stream. So for THD batches :class:`LayoutRotaryEmbedding` returns no embedding (Megatron's
attention then applies none) and the model's ring core attentions, linked by :func:`use_layout_rope`,
apply RoPE to Q and K themselves (:func:`~megatron_ring.megatron.data.packed_rope.apply_packed_rope`): each
local token at its layout position minus its document's start (``cu_seqlens_*_padded`` when given, as
Megatron does), with Megatron's own ``apply_rotary_pos_emb``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_ring import get_layout
from megatron_ring.megatron.data.token_order import refuse_mla_packed_ring_split

__all__ = ["LayoutRotaryEmbedding", "use_layout_rope"]


class LayoutRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` that selects this CP rank's positions with the ring layout.

    ``forward(max_seq_len)`` returns ``[s_local, 1, 1, dim]``: the full-sequence embedding indexed by
    ``get_layout(self.ring_layout).positions(max_seq_len, cp_size, cp_rank)``.
    """

    ring_layout: str = "zigzag"
    packed_by_ring: bool = False  # THD batches: the ring core attentions apply RoPE (apply_packed_rope)
    #: an MLA's own RoPE: its core attention's ``batch_split`` ("ring": packed batches at CP > 1 are refused by name)
    mla_split: Optional[str] = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> Optional[Tensor]:
        if packed_seq and self.packed_by_ring:
            return None  # Megatron's attention applies no RoPE; ring attention does, per token
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if packed_seq and self.mla_split == "ring" and group is not None and group.size() > 1:
            refuse_mla_packed_ring_split(group.size())
        if group is not None and group.size() > 1 and not packed_seq:
            pos = get_layout(self.ring_layout).positions(max_seq_len, group.size(), group.rank())
            emb = emb.index_select(0, pos.to(emb.device))
        return emb


def use_layout_rope(model: torch.nn.Module, layout: str | None = None) -> int:
    """Make every plain ``RotaryEmbedding`` in ``model`` use ``layout`` (default: the registered ring's).

    Returns how many modules were switched. YaRN / multimodal RoPE are left alone and rejected for
    non-zigzag layouts (they slice zigzag internally).
    """
    if layout is None:
        from megatron_ring.megatron.groups.provider import get_ring_state

        layout = get_ring_state().layout
    get_layout(layout)  # validate the name
    n = 0
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        rotary = []
        own = _mla_rotaries(chunk)
        for m in chunk.modules():
            if type(m) is RotaryEmbedding or isinstance(m, LayoutRotaryEmbedding):
                m.__class__ = LayoutRotaryEmbedding
                m.ring_layout = layout
                rotary.append(m)
            elif "RotaryEmbedding" in type(m).__name__ and layout != "zigzag":
                raise NotImplementedError(f"{type(m).__name__} only supports --cp-layout zigzag, got {layout}")
        n += len(rotary)
        # packed (THD) batches: the chunk's ring attentions apply its RoPE at the layout's positions
        # (RingDotProductAttention declares ``packed_rope``; found by that attribute, so data/ needs no
        # import of attention/)
        ring = [m for m in chunk.modules() if hasattr(m, "packed_rope")]
        for attention in own.values():  # MLA applies its own RoPE, to packed batches too
            attention.rotary_pos_emb.mla_split = getattr(getattr(attention, "core_attention", None), "batch_split",
                                                         None)
        if rotary:  # the chunk's RoPE follows ``layout`` (the ring core attentions refuse another: rope_guard.py)
            for m in ring:
                m.rope_layout = layout
        rotary = [m for m in rotary if id(m) not in own]
        if len(rotary) == 1 and ring:
            rotary[0].packed_by_ring = True
            for m in ring:
                m.packed_rope = (rotary[0],)  # a tuple: not registered as a submodule
    return n


def _mla_rotaries(chunk: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The multi-latent attention layers by the id of the RoPE module each owns: MLA applies it itself (to a slice
    of each head, packed batches in Megatron's per-document order), so the ring's core attention never takes it
    over for packed batches."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention  # noqa: PLC0415

    return {id(m.rotary_pos_emb): m for m in chunk.modules()
            if isinstance(m, MultiLatentAttention) and getattr(m, "rotary_pos_emb", None) is not None}
