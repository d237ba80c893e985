"""Attention dropout seeds from Megatron's model-parallel RNG tracker.

:func:`dropout_seed` draws ONE integer per layer call from the tracker (the generator Megatron's own
attention dropout uses) and mixes in the layer number. The tracker is seeded identically on every CP rank
(and at every CP size) by ``model_parallel_cuda_manual_seed``, advances with every call, and is
saved/restored by activation recompute. The ring keys its dropout on global positions, so a CP=4 run
equals the CP=1 run with the same seed.
"""
from __future__ import annotations

import torch

__all__ = ["dropout_seed", "row_seed"]

_MIX = 0x9E3779B97F4A7C15
_M63, _M62 = (1 << 63) - 1, (1 << 62) - 1


def dropout_seed(layer_number: int, device: torch.device) -> torch.Tensor:
    """A dropout seed from Megatron's model-parallel RNG state and the layer number (see module doc): a
    one-element int64 tensor on ``device``, never read on the host (no device sync per layer call; under a
    CUDA graph the draw is part of the graph and advances with each replay)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    try:
        with tracker.fork():
            draw = torch.randint(0, 2 ** 62, (1,), device=device)
    except Exception as exc:  # noqa: BLE001 - the tracker raises a bare Exception when not seeded
        raise RuntimeError("attention dropout in ring attention draws its seed from Megatron's model-parallel "
                           "RNG tracker; call megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) "
                           f"first ({exc})") from exc
    return (draw.reshape(()) ^ ((int(layer_number) * _MIX) & _M63)) & _M63  # draw < 2^62: no sign bit


def row_seed(base: torch.Tensor, row: int) -> torch.Tensor:
    """``(base + MIX * (row + 1)) mod 2^63`` on the device without int64 overflow (``base`` in [0, 2^63)):
    one seed per packed batch row, from the layer's seed."""
    c = (_MIX * (row + 1)) & _M63
    lo = (base & _M62) + (c & _M62)  # < 2^63
    top = ((base >> 62) + (c >> 62) + (lo >> 62)) & 1
    return (lo & _M62) | (top << 62)
