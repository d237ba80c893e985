"""RoPE for packed (THD) batches, applied by the ring's core attention: each local token at its layout
position minus its document's start, with Megatron's own ``apply_rotary_pos_emb`` (see :mod:`.rope`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_ring import get_layout, to_device
from megatron_ring.megatron.data.documents import LastAnswer, params_on_host

__all__ = ["apply_packed_rope"]


def _doc_positions(pos: Tensor, cu: Tensor) -> Tensor:
    """Position of each global stream position ``pos`` inside its document (boundaries ``cu``, int64); tokens
    past ``cu[-1]`` (end padding) count from ``cu[-1]``."""
    return pos - cu[(torch.searchsorted(cu, pos, right=True) - 1).clamp_(0, len(cu) - 1)]


def apply_packed_rope(rotary: RotaryEmbedding, config: Any, query: Tensor, key: Tensor, params: Any,
                      layout: str, group: Any) -> tuple[Tensor, Tensor]:
    """RoPE on this rank's packed ``query [t, np, hn]`` / ``key [t, ng, hn]`` (THD, split by ``layout``
    over ``group``): token at global stream position p of a document starting at c gets angle p - c.

    Document starts come from ``params.cu_seqlens_q_padded`` (``_kv_padded`` for K) when set, else
    ``cu_seqlens_q`` / ``_kv``: the positions Megatron's own THD RoPE gives at CP = 1. The angles of Q and K
    (``rotary.get_emb`` at the positions) are computed by the first layer of a micro-batch and kept on the device
    (:class:`~.documents.LastAnswer`, watching the params' tensors and ``rotary.inv_freq``): the later layers make no
    host read, no host-to-device copy and no device op for them."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    world = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    t = query.size(0)
    freqs = _LAST_FREQS.get(params, (layout, world, rank, t, str(query.device), id(rotary)),
                            lambda: _freqs(rotary, params, layout, world, rank, t, query.device),
                            also=(getattr(rotary, "inv_freq", None),))
    return tuple(apply_rotary_pos_emb(x.unsqueeze(1), f, config=config, cu_seqlens=None, cp_group=group).squeeze(1)
                 for x, f in zip((query, key), freqs))


def _freqs(rotary: RotaryEmbedding, params: Any, layout: str, world: int, rank: int, t: int,
           device: Any) -> tuple[Tensor, Tensor]:
    """The RoPE angles ``[t, 1, 1, dim]`` of this rank's Q and K tokens, each at its position in its document: from
    the params' values on the host (:func:`~.documents.params_on_host`: one read), one host-to-device copy."""
    host = params_on_host(params)
    pos = get_layout(layout).positions(t * world, world, rank)
    starts = [next(host[n] for n in (f"cu_seqlens_{side}_padded", f"cu_seqlens_{side}", "cu_seqlens_q")
                   if host[n] is not None) for side in ("q", "kv")]
    rel = torch.stack([_doc_positions(pos, torch.tensor(cu)) for cu in starts])
    emb = rotary.get_emb(int(rel.max()) + 1)
    rel = to_device(rel, device)
    return emb.index_select(0, rel[0]), emb.index_select(0, rel[1])


_LAST_FREQS = LastAnswer()
