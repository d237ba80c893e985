""":class:`DropoutSpec` / :class:`DropoutKernel` — attention dropout whose keep/drop decision is a
counter-based hash of ``(seed, batch row, head, GLOBAL query position, GLOBAL key position)``
(:func:`keep_mask`). It is generated per block from the block's global positions, so forward,
backward and any recompute see the same mask, and the result does not depend on the CP size or the
layout: CP=P equals CP=1 with the same seed up to floating-point summation order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_ring.kernels import dropout_triton  # the fused kernels' launchers and ops (Triton on use)
from megatron_ring.kernels.math_kernel import SCORE_BUDGET, MathKernel, RowTiled

_M32 = 0xFFFFFFFF

__all__ = ["DropoutSpec", "DropoutKernel", "FusedDropoutKernel", "keep_mask"]


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def keep_mask(seed: int | torch.Tensor, rows: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
              p: float) -> torch.Tensor:
    """Bool ``[len(rows), len(qpos), len(kpos)]``: True where the pair is kept.

    ``rows`` are global (batch row * heads + head) ids; positions are GLOBAL token positions. Drop
    iff the 24-bit hash falls below ``round(p * 2^24)``: the drop rate is that over 2^24. ``seed`` is an
    int or a one-element int64 tensor (on any device: it is never read on the host, so a CUDA graph
    replays with whatever the tensor holds); both give the same mask for the same 64-bit value.
    """
    dev = qpos.device
    s32 = _seed32(seed, dev)
    r = _fmix((torch.as_tensor(rows, dtype=torch.int64, device=dev) * 0x9E3779B1 + s32) & _M32)
    hq = _fmix(r[:, None] ^ (qpos.to(torch.int64)[None, :] & _M32))            # [rows, sq]
    hk = _fmix((kpos.to(torch.int64) * 0x27D4EB2F + 0x165667B1) & _M32)          # [sk]
    h = torch.bitwise_xor(hq[:, :, None], hk[None, None, :])
    _fmix_(h, torch.empty_like(h))  # the [rows, sq, sk] pass: in place, one scratch buffer
    return h.bitwise_right_shift_(8) >= int(round(p * (1 << 24)))


def _seed32(seed: int | torch.Tensor, dev: torch.device) -> int | torch.Tensor:
    """The seed folded to 32 bits: (low word) xor (high word) of its 64-bit two's-complement value. On an
    int64 tensor the arithmetic shift's sign bits fall outside the low word, so both paths agree."""
    if isinstance(seed, torch.Tensor):
        s = seed.reshape(()).to(device=dev, dtype=torch.int64)
        return (s ^ (s >> 32)) & _M32
    s = int(seed) & ((1 << 64) - 1)
    return (s ^ (s >> 32)) & _M32


def _fmix_(x: torch.Tensor, t: torch.Tensor) -> None:
    """:func:`_fmix` in place (``t``: scratch of x's shape)."""
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=t))
        if mul is not None:
            x.mul_(mul).bitwise_and_(_M32)


@dataclass(frozen=True)
class DropoutSpec:
    """Attention dropout: probability, seed, and this call's place in the global head numbering."""

    p: float
    seed: int | torch.Tensor  # an int, or a one-element int64 tensor (a device seed: never read on the host)
    heads: int          # query heads of the whole call (row id = batch row * heads + head)
    seq_len: int        # global sequence (stream) length
    head_offset: int = 0  # first query head of the tensors the engine sees (K/V pieces, a2a's head slices)

    def shifted(self, offset: int) -> "DropoutSpec":
        return replace(self, head_offset=offset)

    def keep(self, b: int, h: int, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        dev = qpos.device  # the row ids are made there: a host tensor would be a host-to-device copy per call
        heads = torch.arange(self.head_offset, self.head_offset + h, dtype=torch.int64, device=dev)
        rows = (torch.arange(b, dtype=torch.int64, device=dev)[:, None] * self.heads + heads[None, :]).flatten()
        return keep_mask(self.seed, rows, qpos, kpos, self.p).view(b, h, len(qpos), len(kpos))


class DropoutKernel(RowTiled):
    """fp32 block attention with the positional dropout mask (after softmax, scaled by 1/(1-p)).

    The lse is that of the undropped scores (dropout does not change the denominator), so the engine's
    merge is unchanged. Masks (causal, documents, windows) as :class:`~megatron_ring.kernels.block.MathKernel`.
    """

    name = "dropout"
    #: a tile also holds the int64 keep hashes and their scratch (16 bytes a pair): a quarter of the math
    #: kernel's score elements
    score_budget = SCORE_BUDGET // 4

    def __init__(self, spec: DropoutSpec) -> None:
        self.spec = spec

    def _probs(self, q, k, causal, scale, mask, rows, keys, lse=None):
        b, h, sq, _ = q.shape
        s = MathKernel._scores(q, k, causal, scale, mask, rows, keys).reshape(b, h, sq, -1)  # the math kernel's
        if lse is None:
            lse = torch.logsumexp(s, -1)
        p = torch.exp(s.sub_(lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)))
        return p, lse

    def _keep(self, q, qpos, kpos):
        return self.spec.keep(q.shape[0], q.shape[1], qpos.to(q.device), kpos.to(q.device))

    def _tile_forward(self, q, k, v, causal, scale, mask, rows, keys, qpos=None, kpos=None):
        b, h, sq, _ = q.shape
        p, lse = self._probs(q, k, causal, scale, mask, rows, keys)
        pd = p.masked_fill_(~self._keep(q, qpos[rows], kpos[keys]), 0.0).mul_(1.0 / (1.0 - self.spec.p))
        h_kv = k.shape[1]
        out = torch.einsum("bkgqs,bksd->bkgqd", pd.view(b, h_kv, h // h_kv, sq, -1), v.float())
        return out.reshape(b, h, sq, v.shape[-1]), lse

    def _tile_backward(self, dout, q, k, v, out, lse, causal, scale, mask, rows, keys, qpos=None, kpos=None):
        b, h, sq, _ = q.shape
        h_kv, g = k.shape[1], h // k.shape[1]
        p, _ = self._probs(q, k, causal, scale, mask, rows, keys, lse=lse.float())
        z = self._keep(q, qpos[rows], kpos[keys]).float().mul_(1.0 / (1.0 - self.spec.p))
        do = dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)
        dog = do.view(b, h_kv, g, sq, -1)
        dv = torch.einsum("bkgqs,bkgqd->bksd", (p * z).view(b, h_kv, g, sq, -1), dog)
        dp = torch.einsum("bkgqd,bksd->bkgqs", dog, v.float()).reshape(b, h, sq, -1)
        ds = p.mul_(dp.mul_(z).sub_(delta)).mul_(scale).view(b, h_kv, g, sq, -1)
        dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k.float()).reshape(q.shape)
        dk = torch.einsum("bkgqs,bkgqd->bksd", ds, q.float().view(b, h_kv, g, sq, -1))
        return dq, dk, dv


class FusedDropoutKernel(DropoutKernel):
    """:class:`DropoutKernel` as Triton kernels on CUDA for fp16/bf16 (kernels/dropout_triton.py): the same keep
    mask, visibility, lse and scaling, with the scores, probabilities and mask never in memory (the torch kernel
    holds ``[b, h, sq, sk]`` fp32 scores and int64 hashes per block). fp32 inputs run the torch kernel. Each
    direction is ONE registered op (``torch.ops.megatron_ring.dropout_attention`` and ``..._backward``, with fake
    implementations: they trace as one op), or its launcher called directly where ``direct(q, k, v)`` says nothing
    would see the op (the engine passes :func:`megatron_ring.core.launch.direct_launch_ok`: the op's Python
    dispatch costs host time of its own on every block)."""

    name = "dropout_fused"

    def __init__(self, spec: DropoutSpec, direct=None) -> None:
        super().__init__(spec)
        self.direct = direct

    @staticmethod
    def fuses(q: torch.Tensor) -> bool:
        """Whether ``q``'s blocks run on the fused kernels (fp16/bf16; fp32 runs the torch kernel)."""
        return q.dtype in (torch.float16, torch.bfloat16)

    @staticmethod
    def one_task(mask) -> bool:
        """Whether a whole block's mask runs as ONE task (the schedule's ``one_task``): always, for the fused
        kernels find each pair's visibility from the mask's four vectors and skip the tile pairs that see none,
        whatever the runs of positions along the rows (a block of Megatron's per-document zigzag: one launch per ring
        step, not one per pair of runs, each with its merge)."""
        return True

    def _args(self, q, causal, scale, mask, qpos, kpos) -> tuple:
        dev = q.device
        seed = self.spec.seed  # a device seed is folded in the kernel; an int here
        if isinstance(seed, torch.Tensor):
            seed_t, seed_int = seed.reshape(()).to(dev), 0
        else:
            seed_t, seed_int = None, _seed32(seed, dev)
        if mask is not None:
            mq, qd, mk, kd = mask.vectors(dev)
            window = mask.rule.window or (-1, -1)
            rule = (bool(mask.rule.causal), int(window[0]), int(window[1]))
        else:
            mq = qd = mk = kd = None
            rule = (False, -1, -1)
        return (qpos.to(dev), kpos.to(dev), mq, qd, mk, kd, seed_t, seed_int, bool(causal), *rule, float(scale),
                float(self.spec.p), int(self.spec.heads), int(self.spec.head_offset))

    def forward(self, q, k, v, causal, scale, mask=None, qpos=None, kpos=None):
        if not self.fuses(q):
            return super().forward(q, k, v, causal, scale, mask=mask, qpos=qpos, kpos=kpos)
        args = self._args(q, causal, scale, mask, qpos, kpos)
        if self.direct is not None and self.direct(q, k, v):
            return dropout_triton.dropout_attention_forward(q, k, v, *args)
        return torch.ops.megatron_ring.dropout_attention(q, k, v, *args)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, qpos=None, kpos=None):
        if not self.fuses(q):
            return super().backward(dout, q, k, v, out, lse, causal, scale, mask=mask, qpos=qpos, kpos=kpos)
        args = self._args(q, causal, scale, mask, qpos, kpos)
        if self.direct is not None and self.direct(dout, q, k, v, out, lse):
            return dropout_triton.dropout_attention_backward(dout, q, k, v, out, lse, *args)
        return torch.ops.megatron_ring.dropout_attention_backward(dout, q, k, v, out, lse, *args)
