"""Attention dropout seeds from Megatron's model-parallel RNG tracker.

:func:`dropout_seed` draws ONE integer per layer call from the tracker (the generator Megatron's own
attention dropout uses) and mixes in the layer number. The tracker is seeded identically on every CP rank
(and at every CP size) by ``model_parallel_cuda_manual_seed``, advances with every call, and is
saved/restored by activation recompute. The ring keys its dropout on global positions, so a CP=4 run
equals the CP=1 run with the same seed.
"""
from __future__ import annotations

import torch

__all__ = ["dropout_seed"]

_MIX = 0x9E3779B97F4A7C15


def dropout_seed(layer_number: int, device: torch.device) -> int:
    """A dropout seed from Megatron's model-parallel RNG state and the layer number (see module doc)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    try:
        with tracker.fork():
            draw = torch.randint(0, 2 ** 62, (1,), device=device)
    except Exception as exc:  # noqa: BLE001 - the tracker raises a bare Exception when not seeded
        raise RuntimeError("attention dropout in ring attention draws its seed from Megatron's model-parallel "
                           "RNG tracker; call megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) "
                           f"first ({exc})") from exc
    return (int(draw.item()) ^ (int(layer_number) * _MIX)) & ((1 << 63) - 1)
