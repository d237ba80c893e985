"""Attention with position-keyed dropout as Triton kernels (CUDA; Triton is imported at the first launch, so this
module imports without it): the block attention of :class:`~megatron_ring.kernels.dropout.DropoutKernel`, flash
style, with the scores, the probabilities and the keep mask never in memory.

The keep/drop decision of each (row id, query position, key position) is :func:`..dropout.keep_mask`'s hash,
computed in registers in 32-bit unsigned arithmetic (the reference's int64 ``& 0xFFFFFFFF`` steps are the same
values): the row's hash once per query row, the key's once per key, the pair's finaliser per pair. Visibility is
the task's: ``causal`` (top-left, the plain tasks' flag) or, for a task with an explicit mask, the mask's rule on
its four vectors (positions and documents of the rows and keys: same document, not padding, ``j <= i`` where the
rule is causal, the window's edges), never a materialised ``[sq, sk]`` mask.

* forward: one program per (64 query rows, 32 for head dims over 128; batch row x head): the online softmax over
  key tiles; the lse is that of the undropped scores (dropout leaves the denominator), the output
  ``sum_j keep_ij p_ij v_j / (1 - p)``; a row that sees no key gets output 0 and lse -inf;
* backward: ``delta = rowsum(dO * O)`` (a kernel of its own), then one kernel for dK/dV (a program per key tile and
  K/V head, over the group's query heads and every query tile) and one for dQ (a program per query tile and head):
  no atomics, so the backward is deterministic.

Products are taken in the inputs' dtype (bf16/fp16) with fp32 accumulation, the probabilities rounded to it before
their products with V and dO, as torch's flash kernels do.
"""
from __future__ import annotations

import functools

import torch

from megatron_ring.triton_launch import Launcher

__all__ = ["dropout_attention_forward", "dropout_attention_backward"]


@functools.lru_cache(maxsize=1)
def _kernels():
    """The jitted kernels: their module is imported (again, after a cache clear) here, so Triton is imported at the
    first launch and ``TRITON_INTERPRET`` is read then."""
    import importlib

    from megatron_ring.kernels import _dropout_kernels

    mod = importlib.reload(_dropout_kernels)
    return mod.dropout_fwd, mod.dropout_bwd_kv, mod.dropout_bwd_q, mod.dropout_delta


#: the four kernels' launchers (the kernels looked up at each launch: tests replace them)
_FWD, _BWD_KV, _BWD_Q, _DELTA = (Launcher(lambda i=i: _kernels()[i]) for i in range(4))
_WARPS = 8


def _tiles(d: int) -> int:
    """Rows of a tile: 64, or 32 for head dims over 128 (registers)."""
    return 64 if d <= 128 else 32


def _common(q, k, v, qpos, kpos, mq, qd, mk, kd, seed_t, seed_int, rule_causal, left, right, scale, p, heads,
            head_offset):
    """The arguments every kernel takes after its tensors (see :func:`dropout_attention_forward`)."""
    import triton

    h, m, dqk = q.shape[1:]
    n, dv = k.shape[2], v.shape[-1]
    masked = mq is not None
    if not masked:  # unused by the kernels then: any pointers
        mq, qd, mk, kd = qpos, qpos, kpos, kpos
    seed_ptr = seed_t is not None
    ptrs = (qpos, kpos, mq, mk, qd, kd, seed_t if seed_ptr else qpos, int(seed_int))
    scalars = (h // k.shape[1], heads, head_offset, m, n, dqk, dv, float(scale), int(round(p * (1 << 24))),
               1.0 / (1.0 - p), int(left), int(right))
    flags = dict(MASKED=masked, RULE_CAUSAL=bool(masked and rule_causal), WIN_L=bool(masked and left >= 0),
                 WIN_R=bool(masked and right >= 0), SEED_PTR=seed_ptr,
                 BDQ=max(16, triton.next_power_of_2(dqk)), BDV=max(16, triton.next_power_of_2(dv)))
    return ptrs, scalars, flags


def dropout_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor,
                              kpos: torch.Tensor, mq: torch.Tensor | None, qd: torch.Tensor | None,
                              mk: torch.Tensor | None, kd: torch.Tensor | None, seed_t: torch.Tensor | None,
                              seed_int: int, causal: bool, rule_causal: bool, left: int, right: int, scale: float,
                              p: float, heads: int, head_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, h, sq, dv] in q's dtype, lse [b, h, sq] fp32)`` of one block (BHSD views, any strides); the
    implementation of the op ``megatron_ring::dropout_attention``.

    ``qpos``, ``kpos``: the rows' and keys' global positions (int64, on q's device) that key the hash; ``mq``,
    ``qd``, ``mk``, ``kd``: an explicit mask's positions and documents of the rows and keys on the device (None: no
    explicit mask), ``rule_causal``, ``left``, ``right``: its rule (``-1``: unbounded); ``seed_t``: the
    one-element int64 device seed (folded in the kernel: no op of its own), else ``seed_int``, the 32-bit folded
    int seed; ``causal``: the plain task's top-left flag; ``p``, ``heads``, ``head_offset``: as
    :class:`..dropout.DropoutSpec`."""
    b, h, m, _ = q.shape
    out = torch.empty(b, h, m, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
    if b * h * m == 0:
        return out, lse
    ptrs, scalars, flags = _common(q, k, v, qpos, kpos, mq, qd, mk, kd, seed_t, seed_int, rule_causal, left, right,
                                   scale, p, heads, head_offset)
    bm = _tiles(max(q.shape[-1], v.shape[-1]))
    _FWD((-(-m // bm), b * h), q, k, v, out, lse, *ptrs, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
         *lse.stride(), h, *scalars, CAUSAL=bool(causal), BM=bm, BN=bm, num_warps=_WARPS, **flags)
    return out, lse


def dropout_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
                               mq: torch.Tensor | None, qd: torch.Tensor | None, mk: torch.Tensor | None,
                               kd: torch.Tensor | None, seed_t: torch.Tensor | None, seed_int: int, causal: bool,
                               rule_causal: bool, left: int, right: int, scale: float, p: float, heads: int,
                               head_offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the GLOBAL ``out`` and ``lse`` of its query rows (the other arguments as
    :func:`dropout_attention_forward`); each in its input's dtype, BHSD-contiguous. The implementation of the op
    ``megatron_ring::dropout_attention_backward``."""
    b, h, m, _ = q.shape
    hk, n = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)
    if b * h * m == 0 or n == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    ptrs, scalars, flags = _common(q, k, v, qpos, kpos, mq, qd, mk, kd, seed_t, seed_int, rule_causal, left, right,
                                   scale, p, heads, head_offset)
    bm = _tiles(max(q.shape[-1], v.shape[-1]))
    delta = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
    _DELTA((-(-m // bm), b * h), out, dout, delta, *out.stride(), *dout.stride(), h, m, v.shape[-1], BM=bm,
           BDV=flags["BDV"])
    common = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride())
    _BWD_KV((-(-n // bm), b * hk), q, k, v, dout, lse, delta, dk, dv, *ptrs, *common, *dk.stride(), *dv.stride(),
            hk, *scalars, CAUSAL=bool(causal), BM=bm, BN=bm, num_warps=_WARPS, **flags)
    _BWD_Q((-(-m // bm), b * h), q, k, v, dout, lse, delta, dq, *ptrs, *common, *dq.stride(),
           h, *scalars, CAUSAL=bool(causal), BM=bm, BN=bm, num_warps=_WARPS, **flags)
    return dq, dk, dv


# the launchers as registered ops (ONE op per direction where a mode, a fake tensor or a compiler sees the call;
# kernels/dropout.py calls the launchers directly elsewhere), with fake implementations
_forward_op = torch.library.custom_op("megatron_ring::dropout_attention", dropout_attention_forward, mutates_args=())
_backward_op = torch.library.custom_op("megatron_ring::dropout_attention_backward", dropout_attention_backward,
                                       mutates_args=())


@_forward_op.register_fake
def _forward_fake(q, k, v, *args):
    b, h, m, _ = q.shape
    return q.new_empty(b, h, m, v.shape[-1]), q.new_empty(b, h, m, dtype=torch.float32)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *args):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
