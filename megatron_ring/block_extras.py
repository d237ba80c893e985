"""Block-level extensions of the engine for today's models: MLA head dims, attention sinks, dropout.

* :class:`HeadDimPadKernel` — V's head dim ``d_v`` differs from Q/K's ``d_qk`` (multi-latent
  attention). torch's CPU flash op (and flash-attn 2) require equal head dims, so the wrapped kernel
  sees zero-padded operands: V (and dO, O in backward) padded to ``d_qk`` when ``d_v < d_qk``, Q and K
  padded to ``d_v`` otherwise. Zero columns change neither the scores nor the other output columns,
  so the result is exact; the padded columns are sliced off. Only the kernel's operands are padded:
  K and V travel the ring unpadded, as one packed buffer (the codecs pack K and V with separate shapes).
* attention sinks (``softmax_offset``) — a virtual key with zero value whose logit takes part in the
  softmax denominator only. It is folded into the log-sum-exp of the ring's fp32 accumulator
  (:func:`fold_sink`: one more term of the same merge, no extra kernel call or ring pass); the
  backward uses the folded lse, so every block gradient is exact, and the sink's own gradient is
  ``-sum_i exp(sink - lse_i) * (dO_i . O_i)`` over this rank's queries (:func:`sink_grad`).
* :class:`DropoutSpec` / :class:`DropoutKernel` — attention dropout whose keep/drop decision is a
  counter-based hash of ``(seed, batch row, head, GLOBAL query position, GLOBAL key position)``
  (:func:`keep_mask`). It is generated per block from the block's global positions, so forward,
  backward and any recompute see the same mask, and the result does not depend on the CP size or the
  layout: CP=P equals CP=1 with the same seed up to floating-point summation order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kernels import BlockKernel

__all__ = ["HeadDimPadKernel", "DropoutSpec", "DropoutKernel", "keep_mask", "fold_sink", "sink_grad",
           "NATIVE_HEAD_DIM_KERNELS"]

NATIVE_HEAD_DIM_KERNELS = ("math", "dropout")  # kernels that take d_v != d_qk without padding


def _pad_last(x: torch.Tensor, d: int) -> torch.Tensor:
    if x.shape[-1] == d:
        return x
    out = x.new_zeros(*x.shape[:-1], d)
    out[..., : x.shape[-1]].copy_(x)
    return out


class HeadDimPadKernel(BlockKernel):
    """Runs ``base`` on operands zero-padded to one head dim (exact; see the module docstring)."""

    def __init__(self, base: BlockKernel) -> None:
        self.base = base
        self.name = f"{base.name}+pad"
        self.supports_mask = base.supports_mask

    def supports(self, q):
        return self.base.supports(q)

    def forward(self, q, k, v, causal, scale, **kw):
        dqk, dv = q.shape[-1], v.shape[-1]
        d = max(dqk, dv)
        out, lse = self.base.forward(_pad_last(q, d), _pad_last(k, d), _pad_last(v, d), causal, scale, **kw)
        return out[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, **kw):
        dqk, dv_dim = q.shape[-1], v.shape[-1]
        d = max(dqk, dv_dim)
        dq, dk, dv = self.base.backward(_pad_last(dout, d), _pad_last(q, d), _pad_last(k, d), _pad_last(v, d),
                                        _pad_last(out, d), lse, causal, scale, **kw)
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]


# ---------------------------------------------------------------------------------------------- sinks
def fold_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Merge the virtual sink key (logit ``sink[h]``, value 0) into ``(out [b,h,s,d], lse [b,h,s])``,
    both fp32, in place: the log-sum-exp merge with a block whose output is 0."""
    s = sink.to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, s.expand_as(lse))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))  # rows without keys: exp(-inf) = 0, out stays 0
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d sink ``[h]`` (fp32) from THIS rank's queries (sum over the CP group for the full one)."""
    delta = (dout.float() * out.float()).sum(-1)  # [b, h, s]
    p_sink = torch.exp(sink.float().view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2))


# -------------------------------------------------------------------------------------------- dropout
_M32 = 0xFFFFFFFF


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def keep_mask(seed: int, rows: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, p: float) -> torch.Tensor:
    """Bool ``[len(rows), len(qpos), len(kpos)]``: True where the pair is kept.

    ``rows`` are global (batch row * heads + head) ids; positions are GLOBAL token positions. Drop
    iff the 24-bit hash falls below ``round(p * 2^24)``: the drop rate is that over 2^24.
    """
    dev = qpos.device
    s = int(seed) & ((1 << 64) - 1)
    s32 = (s ^ (s >> 32)) & _M32
    r = _fmix((torch.as_tensor(rows, dtype=torch.int64, device=dev) * 0x9E3779B1 + s32) & _M32)
    hq = _fmix(r[:, None] ^ (qpos.to(torch.int64)[None, :] & _M32))            # [rows, sq]
    hk = _fmix((kpos.to(torch.int64) * 0x27D4EB2F + 0x165667B1) & _M32)          # [sk]
    h = torch.bitwise_xor(hq[:, :, None], hk[None, None, :])
    _fmix_(h, torch.empty_like(h))  # the [rows, sq, sk] pass: in place, one scratch buffer
    return h.bitwise_right_shift_(8) >= int(round(p * (1 << 24)))


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
    seed: int
    heads: int          # query heads of the whole call (row id = batch row * heads + head)
    seq_len: int        # global sequence (stream) length
    head_offset: int = 0  # first query head of the tensors the engine sees (head_chunks)

    def shifted(self, offset: int) -> "DropoutSpec":
        return replace(self, head_offset=offset)

    def keep(self, b: int, h: int, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        heads = torch.arange(self.head_offset, self.head_offset + h, dtype=torch.int64)
        rows = (torch.arange(b, dtype=torch.int64)[:, None] * self.heads + heads[None, :]).flatten()
        return keep_mask(self.seed, rows.to(qpos.device), qpos, kpos, self.p).view(b, h, len(qpos), len(kpos))


class DropoutKernel(BlockKernel):
    """fp32 block attention with the positional dropout mask (after softmax, scaled by 1/(1-p)).

    The lse is that of the undropped scores (dropout does not change the denominator), so the engine's
    merge is unchanged. Masks (causal, documents, windows) as :class:`~megatron_ring.kernels.MathKernel`.
    """

    name = "dropout"
    supports_mask = True

    def __init__(self, spec: DropoutSpec) -> None:
        self.spec = spec

    def _probs(self, q, k, causal, scale, mask, lse=None):
        b, h, sq, _ = q.shape
        h_kv = k.shape[1]
        qg = q.float().reshape(b, h_kv, h // h_kv, sq, -1)
        s = torch.einsum("bkgqd,bksd->bkgqs", qg, k.float()).mul_(scale).reshape(b, h, sq, -1)
        if causal:
            s.masked_fill_(torch.ones(sq, s.shape[-1], dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
        if mask is not None:
            s.masked_fill_(~mask.allowed(q.device), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, -1)
        p = torch.exp(s.sub_(lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)))
        return p, lse

    def _keep(self, q, qpos, kpos):
        return self.spec.keep(q.shape[0], q.shape[1], qpos.to(q.device), kpos.to(q.device))

    def forward(self, q, k, v, causal, scale, mask=None, qpos=None, kpos=None):
        b, h, sq, _ = q.shape
        p, lse = self._probs(q, k, causal, scale, mask)
        pd = p.masked_fill_(~self._keep(q, qpos, kpos), 0.0).mul_(1.0 / (1.0 - self.spec.p))
        h_kv = k.shape[1]
        out = torch.einsum("bkgqs,bksd->bkgqd", pd.view(b, h_kv, h // h_kv, sq, -1), v.float())
        return out.reshape(b, h, sq, v.shape[-1]).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, qpos=None, kpos=None):
        b, h, sq, _ = q.shape
        h_kv, g = k.shape[1], h // k.shape[1]
        p, _ = self._probs(q, k, causal, scale, mask, lse=lse.float())
        z = self._keep(q, qpos, kpos).float().mul_(1.0 / (1.0 - self.spec.p))
        do = dout.float()
        delta = (do * out.float()).sum(-1, keepdim=True)
        dog = do.view(b, h_kv, g, sq, -1)
        dv = torch.einsum("bkgqs,bkgqd->bksd", (p * z).view(b, h_kv, g, sq, -1), dog)
        dp = torch.einsum("bkgqd,bksd->bkgqs", dog, v.float()).reshape(b, h, sq, -1)
        ds = p.mul_(dp.mul_(z).sub_(delta)).mul_(scale).view(b, h_kv, g, sq, -1)
        dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k.float()).reshape(q.shape)
        dk = torch.einsum("bkgqs,bkgqd->bksd", ds, q.float().view(b, h_kv, g, sq, -1))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
