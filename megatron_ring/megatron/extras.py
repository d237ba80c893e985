"""Megatron glue for attention sinks (``softmax_type``) and attention dropout in the ring.

* ``softmax_type="off-by-one"``: the ring gets ``softmax_offset=0.0`` (a zero logit for every head);
  ``"learnable"``: a parameter ``softmax_offset [num_heads / tp]`` created, named and initialised like
  Megatron's ``DotProductAttention`` (``config.init_method``), passed to the ring, which returns its
  gradient for this rank's queries; Megatron's gradient all-reduce over data-parallel x CP then sums
  the CP ranks' parts like every other weight's.
* attention dropout: :func:`dropout_seed` draws ONE integer per layer call from Megatron's
  model-parallel RNG tracker (the generator Megatron's own attention dropout uses) and mixes in the
  layer number. The tracker is seeded identically on every CP rank (and at every CP size) by
  ``model_parallel_cuda_manual_seed``, advances with every call (so each step gets new masks), and is
  saved/restored by Megatron's activation recompute (so the recomputed forward sees the same mask).
  The ring then keys its dropout on global positions, so a CP=4 run equals the CP=1 run with the same
  seed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["make_softmax_offset", "ring_softmax_offset", "dropout_seed"]

_TYPES = ("vanilla", "off-by-one", "learnable")


def make_softmax_offset(config: Any, heads: int) -> Optional[torch.nn.Parameter]:
    """Megatron's learnable ``softmax_offset`` parameter (None for "vanilla" and "off-by-one")."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind not in _TYPES:
        raise ValueError(f"softmax_type={kind!r} is not supported; use one of {_TYPES}")
    if kind != "learnable":
        return None
    device = torch.cuda.current_device() if torch.cuda.is_available() and not config.use_cpu_initialization \
        else "cpu"
    param = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
    if config.perform_initialization:
        config.init_method(param)
    return param


def ring_softmax_offset(config: Any, param: Optional[torch.Tensor]) -> Any:
    """The ``softmax_offset`` argument of :func:`megatron_ring.ring_attention` for this config."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind == "off-by-one":
        return 0.0
    if kind == "learnable":
        return param
    return None


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
