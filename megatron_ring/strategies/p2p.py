"""``p2p``: the ring (the engine itself). K/V blocks travel rank to rank, overlapped with compute."""
from __future__ import annotations

import torch

from megatron_ring.core.autograd import RingAttentionFunction
from megatron_ring.core.plan import RingPlan

__all__ = ["run"]


def run(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, plan: RingPlan, *, hierarchical_groups=None,
        sink: torch.Tensor | None = None) -> torch.Tensor:
    return RingAttentionFunction.apply(qh, kh, vh, plan, sink)
