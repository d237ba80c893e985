"""The one independent float64 reference of the suite: full attention over the global sequence on one process.

``feature_reference`` is the implementation (explicit visibility mask from index grids: causal, documents,
sliding window; an optional sink logit per head, an extra softmax column whose value row is 0; an optional
positional dropout keep mask from ``megatron_ring.kernels.dropout.keep_mask`` evaluated ONCE on the full
global grid). ``attention_reference`` (plain causal / full) and ``doc_attention_reference`` (one packed
``[T, h, d]`` stream of documents) are views of it. Fully hidden rows (padding at or past ``cu[-1]``, or a
window that hides every key) give 0 and zero gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ring.kernels.dropout import keep_mask


def visible(S: int, causal: bool, cu=None, window=None) -> torch.Tensor:
    """``[S, S]`` bool: query i sees key j (global positions; ``cu`` document boundaries, ``window`` (left, right))."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = torch.ones(S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if cu is not None:
        cu_t = torch.as_tensor(cu)
        doc = torch.searchsorted(cu_t, torch.arange(S), right=True) - 1
        doc = torch.where(torch.arange(S) < cu_t[-1], doc, torch.full_like(doc, -1))
        ok &= (doc[:, None] == doc[None, :]) & (doc >= 0)[:, None]
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    return ok


def scores(q, k, *, causal, cu=None, window=None, scale=None, visible_only=True) -> torch.Tensor:
    """Float64 ``[b, h, S, S]`` scaled scores ``scale * q . k`` (GQA by repeating K heads), ``-inf`` where the
    mask of :func:`visible` hides the pair (``visible_only=False``: every pair). ``q [b, S, h, d]``,
    ``k [b, S, h_kv, d]``."""
    b, S, h, d = q.shape
    scale = scale if scale is not None else d ** -0.5
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(h // k.shape[2], 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    return s.masked_fill(~visible(S, causal, cu, window), float("-inf")) if visible_only else s


def feature_reference(q, k, v, *, causal, cu=None, window=None, sink=None, dropout_p=0.0, seed=None,
                      scale=None):
    """``q [b, S, h, dqk]``, ``k [b, S, h_kv, dqk]``, ``v [b, S, h_kv, dv]`` -> ``[b, S, h, dv]`` (float64).

    ``sink``: None or a tensor ``[h]`` (differentiable). GQA by repeating K/V heads."""
    b, S, h, _ = q.shape
    vh = v.double().transpose(1, 2).repeat_interleave(h // k.shape[2], 1)
    s = scores(q, k, causal=causal, cu=cu, window=window, scale=scale)
    if sink is not None:
        col = sink.double().view(1, h, 1, 1).expand(b, h, S, 1)
        s = torch.cat([s, col], -1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den == 0, torch.ones_like(den), den)
    if sink is not None:
        p = p[..., :-1]
    if dropout_p:
        pos = torch.arange(S)
        keep = keep_mask(seed, torch.arange(b * h), pos, pos, dropout_p).view(b, h, S, S)
        p = p * keep / (1.0 - dropout_p)
    return (p @ vh).transpose(1, 2)


def sink_weight(q, k, sink, *, causal, cu=None, window=None, scale=None) -> torch.Tensor:
    """Float64 ``[b, S, h]``: the softmax weight of the sink column in each query row (``exp(sink - lse)``, lse
    over the visible keys and the sink; 1 where a row sees no key), the mask of :func:`feature_reference`."""
    b, S, h, _ = q.shape
    s = scores(q, k, causal=causal, cu=cu, window=window, scale=scale)
    col = sink.double().view(1, h, 1, 1).expand(b, h, S, 1)
    return torch.softmax(torch.cat([s, col], -1), -1)[..., -1].transpose(1, 2)


def max_logit_reference(q, k, *, causal, cu=None, window=None, scale=None, visible_only=True) -> torch.Tensor:
    """Float64 ``[h, S]``: per query head and GLOBAL query position, the max over the batch and the visible
    keys (the mask of :func:`feature_reference`) of ``scale * q . k``; ``-inf`` where a query sees no key.
    ``q [b, S, h, d]``, ``k [b, S, h_kv, d]`` (GQA by repeating K heads). A rank's ``max_logit`` is the max of
    its own positions' columns. ``visible_only=False`` takes every pair (a negative control: a max that
    ignores the mask)."""
    return scores(q, k, causal=causal, cu=cu, window=window, scale=scale, visible_only=visible_only).amax(dim=(0, 3))


def attention_reference(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Float64 attention; q ``[b, S, h, d]``, k/v ``[b, S, h_kv, d]``."""
    return feature_reference(q, k, v, causal=causal, scale=scale)


def doc_attention_reference(q, k, v, cu, causal, window=None, scale=None):
    """``q [T, h, d]``, ``k, v [T, h_kv, d]``: one packed stream, ``cu`` its document boundaries (a list)."""
    return feature_reference(q[None], k[None], v[None], causal=causal, cu=list(cu), window=window, scale=scale)[0]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch's one-process SDPA in the inputs' dtype (``[b, S, h, d]`` in and out)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal, enable_gqa=True).transpose(1, 2)


def outputs_and_grads(fn, q, k, v, dout):
    """``(out, dq, dk, dv)`` of ``fn(q, k, v)`` for the upstream gradient ``dout`` (fresh leaves)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def documents_and_filler(cu_padded, lens) -> list[int]:
    """Boundaries of a padded packed stream as the float64 reference sees it: each document (``lens``, from the
    start of its padded slot ``cu_padded``) and, where the slot is longer, its filler as a document of its own."""
    cu = [0]
    for a, n, b in zip(cu_padded[:-1].tolist(), lens, cu_padded[1:].tolist()):
        cu += [a + n, b] if b > a + n else [a + n]
    return sorted(set(cu))


def block_reference(q, k, v, causal: bool, scale: float, visible=None, keep=None, p: float = 0.0):
    """One kernel block in float64: ``q [b, h, sq, d]``, ``k, v [b, h_kv, sk, d]`` -> ``(out, lse)``; causal is
    top-left aligned (query i sees keys j <= i), the block kernels' contract (kernels/block.py). ``visible``: a
    bool ``[sq, sk]`` mask besides (a row that sees no key gives out 0 and lse -inf); ``keep``: dropout's keep
    mask ``[b, h, sq, sk]`` of rate ``p`` (the kept weights scaled by ``1 / (1 - p)``; lse undropped)."""
    g = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if visible is not None:
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    if keep is not None:
        w = w * keep / (1.0 - p)
    return w @ v.double().repeat_interleave(g, 1), lse
