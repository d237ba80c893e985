"""Rotary embeddings whose positions follow the ring layout.

Megatron-Core slices RoPE frequencies per CP rank with its own zigzag split. With ``--cp-layout striped``
or ``contiguous`` the tokens a rank holds are different ones, so the frequencies must be taken at the
layout's positions instead. :func:`use_layout_rope` switches a model's ``RotaryEmbedding`` to
:class:`LayoutRotaryEmbedding` in place (no parameters change; zigzag gives Megatron's exact result).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_ring.layouts import get_layout

__all__ = ["LayoutRotaryEmbedding", "use_layout_rope"]


class LayoutRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` that selects this CP rank's positions with the ring layout.

    ``forward(max_seq_len)`` returns ``[s_local, 1, 1, dim]``: the full-sequence embedding indexed by
    ``get_layout(self.ring_layout).positions(max_seq_len, cp_size, cp_rank)``.
    """

    ring_layout: str = "zigzag"

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> Tensor:
        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
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
        from .provider import get_ring_state

        layout = get_ring_state().layout
    get_layout(layout)  # validate the name
    n = 0
    for m in _modules(model):
        if type(m) is RotaryEmbedding or isinstance(m, LayoutRotaryEmbedding):
            m.__class__ = LayoutRotaryEmbedding
            m.ring_layout = layout
            n += 1
        elif "RotaryEmbedding" in type(m).__name__ and layout != "zigzag":
            raise NotImplementedError(f"{type(m).__name__} only supports --cp-layout zigzag, got {layout}")
    return n


def _modules(model: Any):
    if isinstance(model, (list, tuple)):  # Megatron-LM passes lists of model chunks
        for chunk in model:
            yield from chunk.modules()
    else:
        yield from model.modules()
