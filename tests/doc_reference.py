"""Independent float64 reference for packed documents and windows: attention run per document.

Each document ``[cu[i], cu[i+1])`` is attended on its own (float64 math, causal and window masks built
from index grids); padding rows (at or past ``cu[-1]``) and rows whose window hides every key get 0.
"""
from __future__ import annotations

import torch

from feature_reference import visible


def doc_attention_reference(q, k, v, cu, causal, window=None, scale=None):
    """``q [T, h, d]``, ``k, v [T, h_kv, d]`` (a packed stream), ``cu`` a list of boundaries."""
    T, h, d = q.shape
    g = h // k.shape[1]
    scale = scale if scale is not None else d ** -0.5
    out = q.new_zeros(T, h, v.shape[-1], dtype=torch.float64)
    parts = []
    for a, b in zip(cu, cu[1:]):
        if b == a:
            continue
        qd = q[a:b].double().transpose(0, 1)
        kd = k[a:b].double().transpose(0, 1).repeat_interleave(g, 0)
        vd = v[a:b].double().transpose(0, 1).repeat_interleave(g, 0)
        ok = visible(b - a, causal, window=window)  # one document: causal and window only
        s = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~ok, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = torch.exp(s - m)
        den = e.sum(-1, keepdim=True)
        p = e / torch.where(den == 0, torch.ones_like(den), den)
        parts.append((a, b, (p @ vd).transpose(0, 1)))
    if not parts:
        return out + 0 * q.double().sum()  # keep the graph
    pieces, last = [], 0
    for a, b, o in parts:
        if a > last:
            pieces.append(out[last:a])
        pieces.append(o)
        last = b
    if last < T:
        pieces.append(out[last:T] + 0 * q[last:T].double())
    return torch.cat(pieces, 0)
