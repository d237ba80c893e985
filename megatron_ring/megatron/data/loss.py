"""CP-aware loss and gradient reduction, so training at CP > 1 reports and steps exactly as CP = 1."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["CPLoss", "reduce_loss_over_cp", "allreduce_gradients"]


@dataclass(frozen=True)
class CPLoss:
    """``loss``: this rank's differentiable share (local masked sum / tokens of the whole CP group);
    summing its gradient over the CP group gives the CP = 1 gradient. ``reported``: the CP = 1 loss value
    (sum of losses and token counts over the CP group). ``num_tokens``: tokens in the CP group."""

    loss: torch.Tensor
    reported: torch.Tensor
    num_tokens: torch.Tensor


def _cp_group(group: Any) -> Any:
    if group is not None:
        return group
    from megatron_ring.megatron.groups.provider import get_ring_state, is_context_parallel_initialized
    from megatron_ring.megatron.groups.resolve import default_cp_group

    return default_cp_group(get_ring_state() if is_context_parallel_initialized() else None)


def reduce_loss_over_cp(losses: torch.Tensor, loss_mask: torch.Tensor, cp_group: Any = None, *,
                        group: Any = None) -> CPLoss:
    """Masked mean token loss over the full sequence from per-token ``losses`` ``[b, s_local]``.

    One all-reduce of ``[sum(loss * mask), sum(mask)]`` over the CP group ``cp_group`` (default: the
    registered ring). ``group=`` is the old spelling of ``cp_group=`` (one release, with a warning): the
    glue names the CP group ``cp_group`` as Megatron does; the library's ``ring_attention`` takes torch's
    ``group``.
    """
    if group is not None:
        import warnings
        warnings.warn("reduce_loss_over_cp(group=...) is deprecated: pass cp_group= (CHANGELOG.md)",
                      DeprecationWarning, stacklevel=2)
        cp_group = group if cp_group is None else cp_group
    group = _cp_group(cp_group)
    mask = loss_mask.float()
    local = (losses.float() * mask).sum()
    stats = torch.stack([local.detach(), mask.sum()])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    count = stats[1].clamp(min=1.0)
    return CPLoss(loss=local / count, reported=stats[0] / count, num_tokens=stats[1])


def allreduce_gradients(params: Iterable[torch.nn.Parameter] | torch.nn.Module, dp_cp_group: Any = None,
                        dp_size: int | None = None) -> None:
    """Sum gradients over DP x CP, then divide by the DP size (average over data-parallel replicas).

    Pair with :func:`reduce_loss_over_cp` (whose per-rank losses already carry the 1/tokens factor).
    Megatron's own DDP averages over DP x CP instead; with it, use Megatron-LM's per-token loss
    (``--calculate-per-token-loss``), see docs/megatron-lm.md.
    """
    from megatron.core import parallel_state as ps

    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    if dp_cp_group is None:
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if dp_size is None:
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=False)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or dist.get_world_size(dp_cp_group) == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=dp_cp_group)
    if dp_size > 1:
        flat /= dp_size
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
