"""Independent references: full-sequence attention on one process (float64 math, or torch SDPA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float | None = None) -> torch.Tensor:
    """Float64 math attention; q ``[b, S, h, d]``, k/v ``[b, S, h_kv, d]`` (GQA by repetition)."""
    qh, kh, vh = (t.double().transpose(1, 2) for t in (q, k, v))
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(1, 2)


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
