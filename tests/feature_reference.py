"""Independent float64 reference for MLA head dims, attention sinks and positional dropout.

Full attention over the global stream ``[b, S, h, d]`` on one process, with an explicit visibility mask
(causal / documents / window from index grids), an optional sink logit per head (an extra column of the
softmax whose value row is 0), and an optional keep mask over (batch row * h + head, i, j) taken from
``megatron_ring.kernels.dropout.keep_mask`` evaluated ONCE on the full global grid.
"""
from __future__ import annotations

import torch

from megatron_ring.kernels.dropout import keep_mask


def visible(S: int, causal: bool, cu=None, window=None) -> torch.Tensor:
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = torch.ones(S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if cu is not None:
        cu_t = torch.tensor(cu)
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


def feature_reference(q, k, v, *, causal, cu=None, window=None, sink=None, dropout_p=0.0, seed=None,
                      scale=None):
    """``q [b, S, h, dqk]``, ``k [b, S, h_kv, dqk]``, ``v [b, S, h_kv, dv]`` -> ``[b, S, h, dv]`` (float64).

    ``sink``: None or a float64 tensor ``[h]`` (differentiable)."""
    b, S, h, d = q.shape
    g = h // k.shape[2]
    scale = scale if scale is not None else d ** -0.5
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(g, 1)
    vh = v.double().transpose(1, 2).repeat_interleave(g, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible(S, causal, cu, window), float("-inf"))
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
