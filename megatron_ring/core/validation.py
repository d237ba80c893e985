"""Input validation for ring attention, and the cross-rank consistency check.

:func:`check_same_across_ranks` all-gathers a small integer signature of the call (shapes, dtypes,
options) over the ring group and raises the same ValueError on every rank if any rank differs, so a
mismatch is reported instead of hanging in (or silently corrupting) the ring exchange. It runs once per
new signature per group; afterwards the same signature costs a set lookup.
"""
from __future__ import annotations

import datetime
import struct
import weakref
import zlib
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_ring.device import ops_for
from megatron_ring.transport.groups import context

__all__ = ["FORMATS", "check_inputs", "call_signature", "call_tag", "check_same_across_ranks", "check_cu_seqlens",
           "check_window", "host_values"]

FORMATS = ("bshd", "sbhd")  # plus "thd" (packed documents), turned into bshd with b=1 by the api

_SIGNATURE_FIELDS = (
    "q.ndim", "q.shape[0]", "q.shape[1]", "q.shape[2]", "q.shape[3]",
    "k.shape[0]", "k.shape[1]", "k.shape[2]", "k.shape[3]",
    "v.shape[0]", "v.shape[1]", "v.shape[2]", "v.shape[3]",
    "q.dtype", "k.dtype", "v.dtype", "device type", "causal", "layout", "qkv_format", "comm_dtype",
    "softmax_scale", "head_chunks", "cu_seqlens", "window", "comm_type", "dropout/softmax_offset/kv_pieces",
)
#: the per-call values (compared with a new signature only, and in-band in every call's tag), always sent as two
#: fields each, whether it was given and its value (zeros where not): a rank with an int dropout seed or a call id
#: and one without (dropout off, a tensor seed, no call id) send tensors of one size, and the difference is named
_PER_CALL_FIELDS = ("int dropout_seed given", "dropout_seed", "call_id given", "call_id")
_INT63 = (1 << 63) - 1  # per-call integers as int64 (a seed's bits above 63 are not compared)


def _code(x: Any) -> int:
    """A stable small integer for a name-like value (dtype, string, None)."""
    return zlib.crc32(str(x).encode())


def _shape4(t: torch.Tensor) -> list[int]:
    return (list(t.shape) + [-1] * 4)[:4]


def call_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, layout: Any,
                   qkv_format: Any, comm_dtype: Any, softmax_scale: float | None,
                   head_chunks: Any = 1, cu_seqlens: Any = None, window: Any = None,
                   comm_type: Any = "p2p", extras: Any = None) -> tuple[int, ...]:
    """The integers every rank of the group must agree on (see ``_SIGNATURE_FIELDS``)."""
    scale_bits = struct.unpack("<q", struct.pack("<d", float(softmax_scale)))[0] if softmax_scale else 0
    layout_name = getattr(layout, "name", layout)
    return (q.ndim, *_shape4(q), *_shape4(k), *_shape4(v), _code(q.dtype), _code(k.dtype),
            _code(v.dtype), _code(q.device.type), int(bool(causal)), _code(layout_name),
            _code(qkv_format), _code(comm_dtype), scale_bits,
            head_chunks if isinstance(head_chunks, int) else _code(head_chunks), _code(_listed(cu_seqlens)),
            _code(_listed(window)), _code(comm_type), _code(extras))


def per_call_row(per_call: Mapping[str, int] | None) -> tuple[int, ...]:
    """The per-call fields (``_PER_CALL_FIELDS``) of ``per_call`` (keys ``"dropout_seed"`` and ``"call_id"``: the
    int dropout seed, the call id; those not given are left out): for each, whether it was given and its value as
    int64. On every checked call (its tag): no more than the two lookups."""
    get = (per_call or {}).get
    seed, call_id = get("dropout_seed"), get("call_id")
    return ((0, 0) if seed is None else (1, int(seed) & _INT63)) + (
        (0, 0) if call_id is None else (1, int(call_id) & _INT63))


def call_tag(signature: Sequence[int], per_call: Mapping[str, int] | None = None) -> int:
    """A positive 63-bit hash of the call's signature and its per-call values (:func:`per_call_row`: the dropout
    seed, the call id): the tag every rank's K/V carry in the ring's status elements, compared on EVERY call
    without a collective (:mod:`~megatron_ring.core.status`). Python's hash of a tuple of ints is the same in every
    process (no per-process salt for ints), so equal calls give equal tags on every rank."""
    return (hash((tuple(signature), per_call_row(per_call))) & _INT63) or 1


def _listed(x: Any) -> Any:
    """Tensors as lists, so the code depends on the values only."""
    return list(host_values(x)) if isinstance(x, torch.Tensor) else (list(x) if isinstance(x, (tuple, list)) else x)


#: id -> (weak reference, version, values) of the device tensors read by :func:`host_values` (the newest 64)
_read: "OrderedDict[int, tuple[weakref.ref, int, tuple]]" = OrderedDict()


def host_values(t: torch.Tensor) -> tuple:
    """``t.tolist()`` as a tuple. A tensor on a device whose host reads are not free (CUDA) is read ONCE per
    (tensor object, version): the same ``cu_seqlens`` tensor passed to every layer of a step costs one
    device-to-host read per step, not one per layer and call. The version counter is the one autograd uses to
    detect in-place changes: every in-place torch op on the tensor (``copy_``, ``fill_``, an indexed write)
    bumps it and the next call reads again. Not seen: writes that bypass it (through ``.data``, DLPack or raw
    pointers); pass a new tensor (or a list) after such a write. Inference-mode tensors (no version counter)
    are read every call."""
    if ops_for(t.device).host_reads_free or t.is_inference():
        return tuple(t.tolist())
    key, version = id(t), t._version
    got = _read.get(key)
    if got is not None and got[0]() is t and got[1] == version:
        return got[2]
    values = tuple(t.tolist())  # the one read
    _read[key] = (weakref.ref(t), version, values)
    _read.move_to_end(key)
    while len(_read) > 64:
        _read.popitem(last=False)
    return values


def check_same_across_ranks(signature: Sequence[int], group: Any, device: torch.device,
                            describe: dict[str, Any], timeout: datetime.timedelta | None = None,
                            per_call: Mapping[str, int] | None = None) -> None:
    """Raise ValueError on every rank of ``group`` unless all ranks pass the same ``signature``.

    ``per_call``: values that change from call to call (``{"dropout_seed": .., "call_id": ..}``: the int dropout
    seed, the call id): compared together with a new signature, never a reason for a new check on their own (so a
    per-step seed or a per-layer call id costs no collective per call; a rank seeded differently, e.g. by its rank,
    is caught at the first call; later calls compare them in-band, in the call's tag).

    ``describe`` holds human-readable values of this rank's call, used only for the message. ``timeout``:
    the all-gather's deadline (None: the group's); a peer that is gone raises the backend's error
    (RuntimeError), one that does not answer in time TimeoutError (the caller names the lost rank).
    """
    seen = context(group).signatures  # held with the group, weakly (transport/groups.py)
    sig = tuple(signature)
    if sig in seen:
        return
    world = dist.get_world_size(group)
    mine = torch.tensor(sig + per_call_row(per_call), dtype=torch.int64, device=device)
    allsig = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(allsig, mine, group=group, async_op=True)
    if (work.wait(timeout) if timeout is not None else work.wait()) is False:
        raise TimeoutError(f"the all_gather did not complete within {timeout}")
    rows = torch.stack(allsig).cpu()
    fields = _SIGNATURE_FIELDS + _PER_CALL_FIELDS
    differing = [name for i, name in enumerate(fields) if not bool((rows[:, i] == rows[0, i]).all())]
    if differing:
        per_rank = "; ".join(
            f"rank {r}: " + ", ".join(f"{f}={_decode(f, int(rows[r, fields.index(f)]), describe)}"
                                      for f in differing)
            for r in range(world))
        raise ValueError(
            "ring_attention was called with different arguments on the ranks of its process group "
            f"(differing: {', '.join(differing)}; {per_rank}). Every rank must pass the same shapes, "
            "dtypes and options: check the batch sharding and sequence padding (all ranks need the same "
            "local sequence length), and the configuration each rank read.")
    if len(seen) >= 4096:  # e.g. a new cu_seqlens every step: keep the memory bounded
        seen.clear()
    seen.add(sig)


def _decode(field: str, value: int, describe: dict[str, Any]) -> str:
    """Numbers print as numbers; hashed names print as the local name when they match it."""
    if field in ("cu_seqlens", "window"):
        local = describe.get(field)
        return f"<{field} differs from this rank's {_listed(local)}>" if local is not None else "<differs>"
    if "shape" in field or field in ("q.ndim", "head_chunks") + _PER_CALL_FIELDS:
        return str(value)
    local = describe.get(field)
    if local is not None and _code(local) == value:
        return str(local)
    if field == "causal":
        return str(bool(value))
    return f"<{field} differs from this rank's {local}>" if local is not None else str(value)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str) -> None:
    """Shape/dtype/device checks that name the fix. Raises ValueError."""
    if qkv_format not in FORMATS:
        raise ValueError(f"unknown qkv_format {qkv_format!r}; use 'bshd' ([b, s, h, d]), 'sbhd' ([s, b, h, d]) or 'thd' ([t, h, d])")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor in {qkv_format} layout, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    bdim, sdim = (0, 1) if qkv_format == "bshd" else (1, 0)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, sequence and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[bdim] != k.shape[bdim] or q.shape[sdim] != k.shape[sdim]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch and local "
                         f"sequence length ({qkv_format})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    h, h_kv = q.shape[2], k.shape[2]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv}) for GQA/MQA; "
                         "fix num_attention_heads / num_query_groups")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last (head) dimension; call .contiguous() first")


def check_cu_seqlens(cu_seqlens: Any, total: int) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints, after checking it describes documents of a stream of ``total``
    tokens (int, 1-D, starts at 0, non-decreasing, ends at or before ``total``). Raises ValueError."""
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
            raise ValueError("cu_seqlens must hold integers; pass torch.tensor(cu_seqlens, dtype=torch.int32)")
        if len(cu_seqlens) < 1:
            raise ValueError("cu_seqlens must be 1-D [n_docs + 1] (global cumulative document lengths), got an "
                             "empty list")
        return _check_boundaries(tuple(int(x) for x in cu_seqlens), total)  # host values: no tensor, no read
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor (int32/int64), got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}; cast it with .int()")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [n_docs + 1] (global cumulative document lengths), got shape "
                         f"{tuple(cu_seqlens.shape)}; for one batch row per sequence use qkv_format='bshd'")
    # a device tensor: one read per tensor and version (host_values)
    return _check_boundaries(tuple(int(x) for x in host_values(cu_seqlens)), total)


def _check_boundaries(cu: tuple[int, ...], total: int) -> tuple[int, ...]:
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}; prepend 0")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be non-decreasing (cumulative document lengths); pass the GLOBAL "
                         "boundaries of the packed stream, the same on every rank")
    if cu[-1] > total:
        raise ValueError(f"cu_seqlens[-1]={cu[-1]} is past the packed stream's {total} tokens (local length x "
                         "ranks); pass the global boundaries and pad only at the end of the stream")
    return cu


def check_window(window: Any) -> tuple[int, int] | None:
    """``window`` as ``(left, right)`` ints (``-1`` unbounded) or None. Raises ValueError."""
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in window)):
        raise ValueError(f"window must be a pair of ints (left, right), -1 meaning unbounded, got {window!r}")
    if any(x < -1 for x in window):
        raise ValueError(f"window values must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return int(window[0]), int(window[1])
