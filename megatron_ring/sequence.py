"""Split a full sequence into this rank's shard and gather it back, for any layout."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.api import resolve_group
from megatron_ring.schedules.layouts import Layout, get_layout

__all__ = ["shard_sequence", "gather_sequence"]


def _world_rank(group: Any) -> tuple[int, int]:
    group = resolve_group(group)
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(x: torch.Tensor, dim: int, group: Any = None, layout: str | Layout = "zigzag") -> torch.Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` (a new tensor, differentiable)."""
    lay = get_layout(layout)
    world, rank = _world_rank(group)
    seq_len = x.shape[dim]
    lay.check_global_len(seq_len, world)
    return x.index_select(dim, lay.positions(seq_len, world, rank).to(x.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, group, lay, world, rank, sum_grads):
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        seq_len = x_local.shape[dim] * world
        order = torch.cat([lay.positions(seq_len, world, r) for r in range(world)])
        stacked = torch.cat(parts, dim)  # rank order; `order` says where each row belongs globally
        full = torch.empty_like(stacked).index_copy_(dim, order.to(x_local.device), stacked)
        ctx.dim, ctx.group, ctx.lay, ctx.world, ctx.rank, ctx.sum_grads = dim, group, lay, world, rank, sum_grads
        return full

    @staticmethod
    def backward(ctx, grad_full):
        grad_full = grad_full.contiguous()
        if ctx.sum_grads:
            dist.all_reduce(grad_full, group=ctx.group)
        pos = ctx.lay.positions(grad_full.shape[ctx.dim], ctx.world, ctx.rank).to(grad_full.device)
        return grad_full.index_select(ctx.dim, pos), None, None, None, None, None, None


def gather_sequence(x_local: torch.Tensor, dim: int, group: Any = None, layout: str | Layout = "zigzag",
                    sum_grads: bool = False) -> torch.Tensor:
    """Rebuild the full tensor on every rank from each rank's shard along ``dim`` (differentiable).

    Backward returns this rank's slice of the incoming gradient, which is right when every rank uses the
    gathered tensor identically (e.g. the same loss). With ``sum_grads=True`` the gradients of all ranks
    are summed first (the adjoint of all-gather), for ranks that use it differently.
    """
    lay = get_layout(layout)
    world, rank = _world_rank(group)
    if world == 1:
        return x_local
    dim = dim % x_local.ndim
    return _GatherSequence.apply(x_local, dim, resolve_group(group), lay, world, rank, sum_grads)
