"""attention sinks (``softmax_offset``) — a virtual key with zero value whose logit takes part in the
softmax denominator only. It is folded into the log-sum-exp of the ring's fp32 accumulator
(:func:`fold_sink`: one more term of the same merge, no extra kernel call or ring pass); the
backward uses the folded lse, so every block gradient is exact, and the sink's own gradient is
``-sum_i exp(sink - lse_i) * (dO_i . O_i)`` over this rank's queries (:func:`sink_grad`).
"""
from __future__ import annotations

import torch

__all__ = ["fold_sink", "sink_grad"]


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
