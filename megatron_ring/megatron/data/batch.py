"""Split a training batch along the sequence for this CP rank, with the ring's layout."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megatron_ring import get_layout

__all__ = ["get_batch_on_this_cp_rank", "cp_positions"]

#: Sequence dimension per batch key; every other tensor is ``[b, s, ...]`` (dimension 1).
SEQ_DIM = {"attention_mask": 2}  # [b, 1, s_q, s_k]: queries are split, keys stay whole (as in Megatron)
#: Packed-document metadata: GLOBAL boundaries of the packed stream, the same on every CP rank (not split).
GLOBAL_KEYS = frozenset({"cu_seqlens", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_padded",
                         "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen", "max_seqlen_q",
                         "max_seqlen_kv"})


def _resolve(layout: str | None, cp_group: Any, cp_size: int | None, cp_rank: int | None) -> tuple[str, int, int]:
    from megatron_ring.megatron.groups.provider import get_ring_state, is_context_parallel_initialized

    if is_context_parallel_initialized():
        state = get_ring_state()
        layout = layout or state.layout
        cp_group = cp_group if cp_group is not None else state.group
    if cp_size is None or cp_rank is None:
        if cp_group is None:
            from megatron_ring.megatron.groups.resolve import default_cp_group

            cp_group = default_cp_group()  # no ring registered (state is None): parallel_state's
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
    return layout or "zigzag", cp_size, cp_rank


def cp_positions(seq_length: int, *, layout: str | None = None, cp_group: Any = None,
                 cp_size: int | None = None, cp_rank: int | None = None) -> torch.Tensor:
    """Global token positions (``[seq_length / cp]``, int64) this CP rank holds."""
    layout, cp_size, cp_rank = _resolve(layout, cp_group, cp_size, cp_rank)
    lay = get_layout(layout)
    lay.check_global_len(seq_length, cp_size)
    return lay.positions(seq_length, cp_size, cp_rank)


def get_batch_on_this_cp_rank(batch: Mapping[str, Any], *, layout: str | None = None, cp_group: Any = None,
                              cp_size: int | None = None, cp_rank: int | None = None) -> dict[str, Any]:
    """This CP rank's part of ``batch`` (a new dict; the input is not modified).

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (``[b, s]``) and any other ``[b, s, ...]``
    tensor become ``[b, s / cp, ...]``; ``attention_mask`` ``[b, 1, s, s]`` keeps its key dimension
    (``[b, 1, s / cp, s]``). ``None`` and non-tensor values pass through. Defaults come from the
    registered ring (layout, group); Megatron's own helper would always split zigzag.

    Packed documents (THD, ``tokens [1, T]``): every ``[1, T]`` tensor (tokens, labels, loss mask,
    position ids restarting per document) is split like a sequence, and ``cu_seqlens`` (and the other
    ``GLOBAL_KEYS``) stay global, as ring attention wants them; ``--reset-attention-mask`` masks keep
    their key dimension. No per-document padding is needed (pad the stream's end only).

    Pass full-sequence ``position_ids`` (``0..s-1``) so learned position embeddings see global positions;
    RoPE gets them from :func:`~megatron_ring.megatron.data.rope.use_layout_rope`.
    """
    layout, cp_size, cp_rank = _resolve(layout, cp_group, cp_size, cp_rank)
    out = dict(batch)
    if cp_size == 1:
        return out
    lay = get_layout(layout)
    cache: dict[tuple[int, torch.device], torch.Tensor] = {}
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor) or key in GLOBAL_KEYS:
            continue
        dim = SEQ_DIM.get(key, 1)
        if val.dim() <= dim:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}; expected a sequence dimension {dim}")
        s = val.size(dim)
        try:
            lay.check_global_len(s, cp_size)
        except ValueError as e:
            raise ValueError(f"batch[{key!r}]: {e} (--seq-length / --cp-layout)") from None
        idx = cache.get((s, val.device))
        if idx is None:
            idx = cache[(s, val.device)] = lay.positions(s, cp_size, cp_rank).to(val.device)
        out[key] = val.index_select(dim, idx)
    return out
