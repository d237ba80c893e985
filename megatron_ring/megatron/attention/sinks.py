"""Megatron glue for attention sinks (``softmax_type``): ``"off-by-one"`` gives the ring ``softmax_offset=0.0``;
``"learnable"`` a parameter ``softmax_offset [num_heads / tp]`` created and initialised like Megatron's
``DotProductAttention``'s, whose gradient the ring returns for this rank's queries (Megatron's DP x CP
gradient all-reduce sums the CP ranks' parts), and its distributed-checkpoint view (:func:`sharded_sinks`:
sharded over TP like Megatron's, so every TP rank's heads are saved)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

__all__ = ["make_softmax_offset", "ring_softmax_offset", "sharded_sinks"]

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


def sharded_sinks(module: torch.nn.Module, prefix: str, sharded_offsets: tuple, metadata: Optional[dict],
                  tp_group: Any) -> dict:
    """``module``'s sharded state dict as Megatron's ``DotProductAttention.sharded_state_dict`` makes it: the
    learnable ``softmax_offset`` (``[num_heads / tp]`` on each TP rank, heads in TP rank order) a tensor
    sharded over ``tp_group`` along its only axis, replicated over DP x CP; any other state replicated. (The
    default of ``MegatronModule`` would save it as replicated over TP: one TP rank's heads only.)"""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix,
                                               {"softmax_offset": 0}, sharded_offsets, tp_group=tp_group,
                                               dp_cp_group=metadata["dp_cp_group"])
