"""One document of Megatron's hybrid-CP loop, ready for a model whose core attention is the ring.

megatron-core's ``hybrid_context_parallel_forward_backward`` (``--hybrid-context-parallel``) calls
``forward_step`` once per document, with a one-sample iterator whose sample holds 1-D tensors of the
document's length (``tokens``, ``labels``, ``loss_mask``, ``position_ids``) plus ``local_cp_size``: how
many DP x CP ranks share the document in this round. The group itself is left to the callee
(``parallel_state.get_hybrid_data_context_parallel_groups(group_size=local_cp_size)``).

:func:`get_hybrid_cp_batch` turns that sample into what the ring wants: the document as a one-document
THD stream (``[1, L / p]`` per rank, split by the ring layout over the document's group) and a
``PackedSeqParams`` that carries the group (``cp_group`` / ``local_cp_size``) and the document boundaries,
so ring attention and its RoPE (:func:`~megatron_ring.megatron.data.rope.use_layout_rope`) run on that group.
``local_cp_size == 1`` gives no group (the ring runs on this rank alone; megatron-core builds no hybrid
group of size 1). The document must split evenly under the layout (zigzag: length divisible by 2p);
otherwise a ValueError names the fix.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ring.megatron.data.batch import get_batch_on_this_cp_rank
from megatron_ring.megatron.groups.resolve import hybrid_cp_group

__all__ = ["HYBRID_KEYS", "hybrid_cp_group", "get_hybrid_cp_batch"]

HYBRID_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # the per-token tensors of a hybrid-CP sample


def _from_first_tp_rank(sample: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """With tensor parallelism, megatron-core's hybrid-CP loop gives the sample to the first TP rank only
    (the others get ``data_iterator=None``): broadcast it over the TP group, as Megatron's ``get_batch``
    does for fixed CP."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        if sample is None:
            raise ValueError("no hybrid-CP sample (data_iterator is None) and no tensor-parallel peer to get it from")
        return sample
    group, src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    first = ps.get_tensor_model_parallel_rank() == 0
    if first and sample is None:
        raise ValueError("the first tensor-parallel rank got no hybrid-CP sample")
    device = sample["tokens"].device if first else (torch.device("cuda", torch.cuda.current_device())
                                                    if torch.cuda.is_available() else torch.device("cpu"))
    head = torch.zeros(2, dtype=torch.int64, device=device)
    if first:
        size = sample["local_cp_size"]
        head[0], head[1] = sample["tokens"].numel(), int(size.item()) if isinstance(size, torch.Tensor) else int(size)
    dist.broadcast(head, src, group=group)
    length, size = int(head[0]), int(head[1])
    out: dict[str, Any] = {"local_cp_size": size}
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32)):
        t = sample[key].to(device, dtype) if first else torch.empty(length, dtype=dtype, device=device)
        dist.broadcast(t, src, group=group)
        out[key] = t
    return out


def get_hybrid_cp_batch(sample: Mapping[str, Any] | None, *, layout: str | None = None
                        ) -> tuple[dict[str, torch.Tensor], PackedSeqParams]:
    """(this rank's part of the document ``[1, L / p]``, its ``PackedSeqParams``) for one hybrid-CP sample.

    ``sample`` is what the hybrid-CP loop's one-sample iterator yields, or None on tensor-parallel ranks
    other than the first (whose iterator Megatron leaves None): those receive it by broadcast over the TP
    group. ``position_ids`` are rebuilt as ``0..L-1`` (positions within the document); the ring's packed
    RoPE uses the document boundaries, so they matter only to learned position embeddings."""
    if sample is not None and "local_cp_size" not in sample:
        raise ValueError("the sample has no 'local_cp_size': get_hybrid_cp_batch is for the samples megatron-core's "
                         "hybrid-CP loop (--hybrid-context-parallel) hands to forward_step")
    sample = _from_first_tp_rank(sample)
    size = sample["local_cp_size"]
    size = int(size.item()) if isinstance(size, torch.Tensor) else int(size)
    tokens = sample["tokens"]
    if tokens.dim() != 1:
        raise ValueError(f"hybrid-CP sample tokens have shape {tuple(tokens.shape)}; expected one document, 1-D")
    length = tokens.numel()
    doc = {k: sample[k].reshape(1, length) for k in HYBRID_KEYS if k in sample and k != "position_ids"}
    doc["position_ids"] = torch.arange(length, device=tokens.device).view(1, length)
    group = hybrid_cp_group(size)
    if group is not None and group.size() != size:
        raise ValueError(f"local_cp_size={size} but parallel_state's hybrid group has {group.size()} ranks")
    if size > 1:
        try:
            doc = get_batch_on_this_cp_rank(doc, layout=layout, cp_group=group)
        except ValueError as e:
            raise ValueError(f"{e}; with --hybrid-context-parallel every document must split evenly over the "
                             f"{size} ranks it is given: pad documents to a multiple of 2 x the largest group "
                             "(zigzag) or of the group size (striped, contiguous)") from None
    cu = torch.tensor([0, length], dtype=torch.int32, device=tokens.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=length,
                             max_seqlen_kv=length, cp_group=group, local_cp_size=size)
    return doc, params
