"""Document structure from Megatron's inputs: ``PackedSeqParams`` (THD) and ``--reset-attention-mask``.

* :func:`packed_cu_seqlens` turns ``PackedSeqParams`` (``cu_seqlens_q/kv`` and their ``_padded``
  variants, as Megatron builds them) into the ring's global ``cu_seqlens``. With ``_padded`` boundaries
  each document sits at the start of its padded slot; the filler after it becomes a document of its own
  (it attends only to filler, never to a real token, and its loss mask is 0).
* :class:`DocumentsFromMask` reads the documents of each batch row from Megatron's boolean
  ``attention_mask`` (True = hidden; ``[b, 1, s_local, S]`` as :func:`~megatron_ring.megatron.data.batch.get_batch_on_this_cp_rank` shards
  it, or ``[b, 1, S, S]`` at CP 1), as built by ``get_ltor_masks_and_position_ids(reset_attention_mask)``.
  Each local query row gives the start of its document; one small all-reduce over the CP group
  (``[b, S]`` bytes, once per mask tensor: the later layers reuse it, :data:`documents_from_mask`) makes the
  boundaries global and equal on every rank. A mask that is not "causal within documents" is refused
  (NotImplementedError), never silently approximated.
* :func:`document_mask` builds that mask (and position ids restarting per document) from EOD tokens.
* :func:`packed_batch` turns such a batch into one packed THD stream with ``PackedSeqParams``.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron_ring import get_layout, to_device

__all__ = ["LastAnswer", "params_on_host", "packed_cu_seqlens", "real_rows", "DocumentsFromMask", "documents_from_mask",
           "document_mask", "packed_batch"]


#: the tensors of ``PackedSeqParams`` the answers below are computed from
_PARAMS_TENSORS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


class LastAnswer:
    """The last answer of a function of ``owner`` (a ``PackedSeqParams``, or a mask tensor), given again while it is
    the same object, its ``tensors`` (default: the params' ``cu_seqlens*``) are the same objects, not changed in place
    since (their version counters), and the plain ``key`` is equal. Every layer of a micro-batch passes the same
    params and mask, so only the first layer reads them on the host: on a GPU each read waits for the device, and the
    host can no longer run ahead of it. One answer is kept (weak references to the owner and the tensors).
    Inference-mode tensors have no version counter: computed every call (as the engine's ``host_values`` reads
    them); so are answers asked for under ``torch.inference_mode()`` (tensors made there may not be used outside it:
    packed RoPE's angles in a training step after an inference-mode call on the same params)."""

    def __init__(self) -> None:
        self._last: tuple = (None, (), None, None)

    def get(self, owner: Any, key: tuple, compute: Any, tensors: tuple | None = None, also: tuple = ()) -> Any:
        """``also``: more tensors to watch, beside ``tensors`` (a module's buffer the answer is computed from)."""
        if tensors is None:
            tensors = tuple(getattr(owner, name, None) for name in _PARAMS_TENSORS)
        tensors = tuple(tensors) + tuple(also)
        if torch.is_inference_mode_enabled() or any(t is not None and t.is_inference() for t in tensors):
            return compute()  # an answer made in inference mode may not be used outside it (autograd refuses it)
        seen = (key, tuple(None if t is None else t._version for t in tensors))
        ref, refs, last_seen, answer = self._last
        if ref is not None and ref() is owner and last_seen == seen and all(
                (r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors)):
            return answer
        answer = compute()
        try:
            self._last = (weakref.ref(owner), tuple(None if t is None else weakref.ref(t) for t in tensors), seen,
                          answer)
        except TypeError:  # an owner that takes no weak reference: not kept
            self._last = (None, (), None, None)
        return answer


def params_on_host(params: Any) -> dict[str, list[int] | None]:
    """The values of the params' ``cu_seqlens*`` tensors (:data:`_PARAMS_TENSORS`; None where unset) on the host, read
    in ONE device-to-host copy (the tensors concatenated on their device); the answer is kept for the later layers
    of the micro-batch (:class:`LastAnswer`). Everything the glue derives from a packed batch's params (the ring's
    ``cu_seqlens``, QK-clip's filler rows, packed RoPE's positions, stock Megatron's per-document layout) starts
    here: the first layer of a micro-batch makes one read where it made 2 to 7."""
    return _LAST_HOST.get(params, (), lambda: _read_params(params))


def _read_params(params: Any) -> dict[str, list[int] | None]:
    values: dict[str, list[int] | None] = {name: None for name in _PARAMS_TENSORS}
    on: dict[Any, list[tuple[str, torch.Tensor]]] = {}
    for name in _PARAMS_TENSORS:
        t = getattr(params, name, None)
        if t is None:
            continue
        if t.dim() != 1 or t.is_floating_point():
            raise ValueError(f"packed_seq_params.{name} must be a 1-D integer tensor [n_docs + 1], got {t.dtype} "
                             f"{tuple(t.shape)}")
        on.setdefault(t.device, []).append((name, t))
    for group in on.values():  # one device in practice: one read
        flat = torch.cat([t.detach() for _, t in group]).tolist()
        at = 0
        for name, t in group:
            values[name], at = flat[at:at + t.numel()], at + t.numel()
    return values


def packed_cu_seqlens(params: Any) -> torch.Tensor:
    """Global document boundaries (int64, CPU) for the ring from Megatron's ``PackedSeqParams`` (the last answer is
    kept: see :class:`LastAnswer`; the same tensor, which the engine then reads no more either)."""
    return _LAST_CU.get(params, (), lambda: _packed_cu_seqlens(params))


def _packed_cu_seqlens(params: Any) -> torch.Tensor:
    if getattr(params, "qkv_format", "thd") != "thd":
        raise NotImplementedError(f"packed_seq_params.qkv_format={params.qkv_format!r}: ring attention takes 'thd'")
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None; pass the global document boundaries")
    host = params_on_host(params)
    if host["cu_seqlens_kv"] is not None and host["cu_seqlens_kv"] != host["cu_seqlens_q"]:
        raise NotImplementedError("ring attention is self-attention: cu_seqlens_q must equal cu_seqlens_kv")
    padded = _padded_documents(params)
    if padded is None:
        return torch.tensor(host["cu_seqlens_q"], dtype=torch.int64)
    starts, ends, total = padded  # real tokens [starts[i], ends[i]); filler [ends[i], starts[i+1])
    bounds = torch.stack([starts, ends], 1).flatten()
    return torch.unique_consecutive(torch.cat([bounds, total.view(1)]))


def _padded_documents(params: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Where Megatron padded the documents (``cu_seqlens_q_padded`` differs from ``cu_seqlens_q``): each document's
    start and the end of its real tokens in the padded stream, and the padded stream's length (int64, CPU); else
    None."""
    host = params_on_host(params)
    cu, padded = host["cu_seqlens_q"], host["cu_seqlens_q_padded"]
    if padded is None or padded == cu:
        return None
    if len(padded) != len(cu):
        raise ValueError("cu_seqlens_q_padded must have cu_seqlens_q's shape [n_docs + 1]")
    cu, padded = torch.tensor(cu, dtype=torch.int64), torch.tensor(padded, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    if bool((padded[1:] - padded[:-1] < lens).any()):
        raise ValueError("cu_seqlens_q_padded leaves less room than cu_seqlens_q for some document")
    return padded[:-1], padded[:-1] + lens, padded[-1]


def real_rows(params: Any, layout: Any, world: int, rank: int, t_local: int, device: Any) -> torch.Tensor | None:
    """Bool ``[t_local]`` on ``device``: which of this rank's packed rows are real tokens, not the filler Megatron
    pads each document with (``cu_seqlens_q_padded``; :func:`packed_cu_seqlens` makes filler documents of their
    own, so it gets attention like any document, but it is no token of the data); None where nothing is filler
    (tokens past the last document are padding to the ring itself: they see nothing). ``layout``: the ring layout
    the stream was split by (a name or a layout object). For QK-clip's max logit: every layer of a micro-batch asks
    with the same ``params``, so the last answer is kept and given again (:class:`LastAnswer`)."""
    key = (layout if isinstance(layout, str) else id(layout), world, rank, t_local, str(device))
    return _LAST_ROWS.get(params, key, lambda: _real_rows(params, layout, world, rank, t_local, device))


def _real_rows(params: Any, layout: Any, world: int, rank: int, t_local: int, device: Any) -> torch.Tensor | None:
    padded = _padded_documents(params)
    rows = None
    if padded is not None:
        starts, ends, total = padded
        pos = (get_layout(layout) if isinstance(layout, str) else layout).positions(t_local * world, world, rank)
        doc = (torch.searchsorted(starts, pos, right=True) - 1).clamp(min=0)
        rows = to_device((pos >= starts[doc]) & (pos < ends[doc]) & (pos < total), device)
    return rows


_LAST_HOST, _LAST_CU, _LAST_ROWS = LastAnswer(), LastAnswer(), LastAnswer()


class DocumentsFromMask:
    """Per-row ``cu_seqlens`` from a boolean causal-document ``attention_mask``. The last answer is kept while the
    same mask tensor, not changed in place, comes with the same group and layout: every layer of a micro-batch
    passes the same mask, so with one instance for all layers (:data:`documents_from_mask`, what
    ``RingDotProductAttention`` uses) only the first layer reads it on the host and, at CP > 1, all-reduces its
    document starts; every rank's layers ask in the same order, so the ranks that all-reduce are the same ones."""

    def __init__(self) -> None:
        self._last = LastAnswer()

    def __call__(self, mask: torch.Tensor, group: Any, layout: str) -> list[list[int]] | None:
        """Boundaries per batch row, or None when every row is one document (plain causal)."""
        return self._last.get(mask, (group, layout), lambda: _documents(mask, group, layout), tensors=(mask,))


documents_from_mask = DocumentsFromMask()  # the one every ring core attention asks


def _documents(mask: torch.Tensor, group: Any, layout: str) -> list[list[int]] | None:
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.size(1) != 1:
        raise NotImplementedError(f"attention_mask must be a bool [b, 1, s, S] tensor (True = hidden), got "
                                  f"{mask.dtype} {tuple(mask.shape)}")
    b, _, s_local, S = mask.shape
    cp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if cp > 1 else 0
    if s_local * cp != S:
        raise ValueError(f"attention_mask has {s_local} query rows and {S} keys; with CP={cp} shard it with "
                         "get_batch_on_this_cp_rank (queries split, keys whole)")
    pos = to_device(get_layout(layout).positions(S, cp, rank), mask.device)
    visible = ~mask[:, 0]  # [b, s_local, S]
    j = torch.arange(S, device=mask.device)
    start = torch.where(visible, j, S).amin(-1)  # first visible key of each local query
    expected = (j >= start[..., None]) & (j <= pos[:, None])
    # the last column: whether this rank's rows break the rule; reduced with the document starts, so that a mask
    # only some ranks' query rows break is refused on every rank (one raising alone left the others in the
    # all-reduce)
    is_start = torch.zeros(b, S + 1, dtype=torch.uint8, device=mask.device)
    is_start.scatter_(1, start.clamp(max=S - 1).long(), 1)
    is_start[:, S] = (visible != expected).flatten(1).any(1)
    if cp > 1:
        dist.all_reduce(is_start, op=dist.ReduceOp.MAX, group=group)
    flags = is_start.cpu().numpy()  # the one device-to-host read of the mask's documents
    if flags[:, S].any():
        raise NotImplementedError(
            "ring attention supports attention_mask tensors that are causal within documents (as "
            "--reset-attention-mask builds them); this mask is not (on some CP rank's query rows). Use "
            "attn_mask_type causal/no_mask with attention_mask=None, or packed_seq_params (THD) for packed documents")
    rows = [[0] + [int(i) for i in numpy.flatnonzero(r[1:S]) + 1] + [S] for r in flags]
    return None if all(r == [0, S] for r in rows) else rows


def document_mask(tokens: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_mask [b, 1, s, s] bool, True = hidden; position_ids [b, s])`` for documents that end
    at each ``eod`` token (the EOD belongs to the document it ends), as Megatron's
    ``--reset-attention-mask --reset-position-ids`` build them."""
    b, s = tokens.shape
    ends = (tokens == eod).long()
    doc = torch.cumsum(ends, 1) - ends  # a document id per token; the EOD stays in its document
    i = torch.arange(s)
    visible = (doc[:, :, None] == doc[:, None, :]) & (i[None, None, :] <= i[None, :, None])
    first = torch.where(visible, i, s).amin(-1)
    return ~visible.unsqueeze(1), i[None, :] - first


def packed_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A ``--reset-attention-mask`` batch (``[b, s]`` tensors, ``position_ids`` restarting at 0 at each
    document start and at each row start) as ONE packed THD stream, the way Megatron feeds packed
    sequences: every ``[b, s, ...]`` tensor becomes ``[1, b*s, ...]``, the mask is dropped, and
    ``packed_seq_params`` (``qkv_format="thd"``, GLOBAL ``cu_seqlens_q/kv`` of the stream, ``max_seqlen``)
    carries the documents. Call before :func:`~megatron_ring.megatron.data.batch.get_batch_on_this_cp_rank`
    and pass ``packed_seq_params=`` to the model; the result equals the masked batch's exactly (rows
    never share a document; RoPE restarts per document, see :mod:`.rope`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    pos = batch["position_ids"]
    b, s = pos.shape
    flat = pos.reshape(-1)
    if bool((pos[:, 0] != 0).any()):
        raise ValueError("packed_batch needs position_ids restarting at 0 at each row's start "
                         "(--reset-position-ids, or documents.document_mask)")
    cu = torch.cat([torch.nonzero(flat == 0).flatten(), torch.tensor([b * s])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    out: dict[str, Any] = {}
    for key, val in batch.items():
        if key == "attention_mask":
            continue
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[:2]) == (b, s):
            val = val.reshape(1, b * s, *val.shape[2:])
        out[key] = val
    out["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                               max_seqlen_q=longest, max_seqlen_kv=longest)
    return out
