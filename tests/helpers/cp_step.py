"""One training step's reductions over the CP group, as Megatron's schedule does them for a model whose
sequence is split over CP: the loss's partial sum and every parameter's gradient are summed over the group.
Shared by the model workers that drive HybridModel / MambaModel by hand (no Megatron import here)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def reduce_over_cp(local_loss: torch.Tensor, model: torch.nn.Module, group, world: int) -> torch.Tensor:
    """Sum ``local_loss`` (a copy, detached) and every ``.grad`` of ``model`` over ``group`` (nothing at
    ``world == 1``); returns the summed loss."""
    rep = local_loss.detach().clone()
    if world > 1:
        dist.all_reduce(rep, group=group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
    return rep
