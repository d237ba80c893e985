"""``get_gpt_layer_ring_spec``: Megatron's local GPT layer spec with ring attention as core attention."""
from __future__ import annotations

from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import RingDotProductAttention

__all__ = ["get_gpt_layer_ring_spec"]


def get_gpt_layer_ring_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    **kwargs: Any,
) -> ModuleSpec:
    """Same arguments as ``get_gpt_layer_local_spec``; the only change is the core attention.

    Swap one line in a model builder::

        spec = get_gpt_layer_ring_spec(normalization="RMSNorm")   # was get_gpt_layer_local_spec(...)

    ``multi_latent_attention=True`` builds Megatron's ``MLASelfAttention`` layer (V's head dim differs
    from Q/K's; the ring packs K and V into one wire buffer all the same) with ring core attention.
    """
    spec = get_gpt_layer_local_spec(
        num_experts, moe_grouped_gemm, qk_layernorm, bool(multi_latent_attention), fp8,
        moe_use_legacy_grouped_gemm, normalization, qk_l2_norm, **kwargs)
    spec.submodules.self_attention.submodules.core_attention = RingDotProductAttention
    return spec
