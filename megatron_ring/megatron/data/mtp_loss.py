"""Multi-token prediction (MTP) at CP > 1: Megatron's MTP loss normalization, made CP-invariant on request.

Megatron (core_v0.16 through main) divides each CP rank's MTP loss by that rank's own count of rolled
tokens (``roll_tensor(loss_mask)[1]`` is a local sum, never reduced over CP). Rolling drops one token at the
end of the sequence, and only the CP rank holding that end loses it, so the ranks' counts differ by one and
each rank's tokens are weighted 1 / (its own count) instead of 1 / (the sequence's count). The main loss
is not affected. At CP > 1 the MTP gradient therefore differs from CP=1 by O(1 / sequence length) per token,
whatever the attention: measured on CPU with stock ``pretrain()`` (docs/megatron-runs.md), CP=2 matches
CP=1 on the first iterations and drifts to ~1e-5 per token by the third.

:func:`cp_invariant_mtp_loss` replaces that count by the sequence's count shared equally by the CP ranks
(all-reduced over the CP group, divided by its size): every MTP token then carries the weight it has at
CP=1, for the averaged and the per-token (``--calculate-per-token-loss``) loss alike, and the logged MTP
loss becomes the sequence mean. Packed (THD) batches are left as Megatron computes them. Opt in with
``MEGATRON_RING_MTP_CP_INVARIANT=1`` (read when the ring's MTP spec is built) or by calling it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.megatron import compat
from megatron_ring.megatron.env import mtp_cp_invariant_from_env

__all__ = ["MTP_ENV", "cp_invariant_mtp_loss", "mtp_cp_invariant_requested", "apply_mtp_loss_choice"]

MTP_ENV = "MEGATRON_RING_MTP_CP_INVARIANT"



def mtp_cp_invariant_requested() -> bool:
    """Whether ``MEGATRON_RING_MTP_CP_INVARIANT`` asks for :func:`cp_invariant_mtp_loss`."""
    return mtp_cp_invariant_from_env()


def _with_cp_mean_count(roll: Callable) -> Callable:
    def roll_tensor(tensor: Any, shifts: int = -1, dims: int = -1, cp_group: Any = None,
                    packed_seq_params: Any = None) -> Any:
        rolled, count = roll(tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params)
        if count is None or packed_seq_params is not None or cp_group is None or cp_group.size() == 1:
            return rolled, count
        total = count.detach().to(torch.float64)  # a token count: exact in float64
        dist.all_reduce(total, group=cp_group)
        return rolled, (total / cp_group.size()).to(count.dtype if count.is_floating_point() else torch.float32)

    roll_tensor._megatron_ring = True  # type: ignore[attr-defined]
    roll_tensor.__wrapped__ = roll  # type: ignore[attr-defined]
    return roll_tensor


def cp_invariant_mtp_loss() -> list[str]:
    """Make Megatron's MTP loss weight each token as at CP=1 (module docstring). Idempotent; returns the
    modules it wrapped (or found wrapped). Each CP rank adds one scalar all-reduce per MTP roll."""
    done = []
    for name in compat.MTP_ROLL_TENSOR_USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(module, "roll_tensor", None)
        if fn is None:
            continue
        if not getattr(fn, "_megatron_ring", False):
            module.roll_tensor = _with_cp_mean_count(fn)  # type: ignore[attr-defined]
        done.append(name)
    return done


def apply_mtp_loss_choice(cp_size: int) -> str:
    """When the ring's MTP spec is built: apply :func:`cp_invariant_mtp_loss` if the environment asks; the
    start-up note on the MTP loss normalization at ``cp_size`` (empty at CP=1, where both agree)."""
    exact = mtp_cp_invariant_requested()
    if exact:
        cp_invariant_mtp_loss()
    if cp_size <= 1:
        return ""
    return (f"MTP loss weighted as at CP=1 ({MTP_ENV})" if exact else
            f"MTP loss normalized per CP rank as Megatron does; {MTP_ENV}=1 weights it as at CP=1")
