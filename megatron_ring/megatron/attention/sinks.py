"""Megatron glue for attention sinks (``softmax_type``): ``"off-by-one"`` gives the ring ``softmax_offset=0.0``;
``"learnable"`` a parameter ``softmax_offset [num_heads / tp]`` created and initialised like Megatron's
``DotProductAttention``'s, whose gradient the ring returns for this rank's queries (Megatron's DP x CP
gradient all-reduce sums the CP ranks' parts)."""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["make_softmax_offset", "ring_softmax_offset"]

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
